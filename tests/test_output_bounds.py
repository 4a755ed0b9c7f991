"""What one tenant's commands can make the server hold of their output, bounded per tenant.

Before: each command was bounded by its sandbox's ``max_output``, but not a tenant's commands
together -- 16 concurrent execs printing 2 x 64 MiB grew the server to 6.3 GB, and two
sandboxes' background commands (16 running and 16 ended kept per sandbox) to 5.4 GB; a tenant
may hold 32 sandboxes.  Now a tenant's running commands count 2 x ``max_output`` each against
``max_output_bytes_per_tenant`` (the rest wait their turn; a background start is 429) and its
ended background commands' output against ``max_kept_output_per_tenant``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from corral.server.output_shares import OutputShares

from .server_fixtures import KEYS, ServerProcess

MiB = 1 << 20


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    config = {"max_output_bytes_per_tenant": "40M", "max_kept_output_per_tenant": "24M",
              "max_background_commands": 8}
    with ServerProcess(state_dir / "srv-output-bounds", keys=KEYS, config=config) as srv:
        yield srv


def create(http: httpx.Client, max_output: str) -> str:
    response = http.post("/v1/sandboxes", json={"limits": {"memory": "128M", "max_output": max_output}})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def test_a_tenants_running_commands_hold_at_most_its_output_bound_and_the_rest_wait(server: ServerProcess) -> None:
    """max_output 8M counts 16 MiB a command: with 40M, two of alice's commands run at once and the
    others wait (all four answered, none refused); bob is not held behind her; a background start
    past the bound is 429 at once, and starts again once a command ended."""
    with server.client("alice") as alice, server.client("bob") as bob:
        sid = create(alice, "8M")
        bob_sid = create(bob, "8M")
        # each counts the commands running beside it (its own marker file included)
        probe = "touch /tmp/r.$$; sleep 0.6; ls /tmp | grep -c '^r\\.'; rm /tmp/r.$$"
        answers: list[httpx.Response] = []

        def one() -> None:
            with server.client("alice") as http:
                answers.append(http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": probe, "timeout": 30}))

        threads = [threading.Thread(target=one) for _ in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        bob_answer = bob.post(f"/v1/sandboxes/{bob_sid}/exec", json={"cmd": "echo bob", "timeout": 10})
        bob_done_while_alice_ran = any(thread.is_alive() for thread in threads)
        for thread in threads:
            thread.join(60)
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        at_once = max(int(a.json()["stdout"].strip()) for a in answers)
        assert at_once <= 2, f"{at_once} of alice's 16 MiB commands ran at once under a 40M bound"
        assert bob_answer.json()["stdout"] == "bob\n" and bob_done_while_alice_ran

        background = [alice.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "sleep 30", "timeout": 60})
                      for _ in range(3)]
        assert [r.status_code for r in background] == [201, 201, 429], [r.text for r in background]
        assert "max_output_bytes_per_tenant" in background[2].json()["message"]
        first = background[0].json()["pid"]
        assert alice.delete(f"/v1/sandboxes/{sid}/commands/{first}").status_code == 204
        deadline = time.monotonic() + 10
        while (again := alice.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "true", "timeout": 10})).status_code \
                == 429 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert again.status_code == 201, again.text
        alice.delete(f"/v1/sandboxes/{sid}")
        bob.delete(f"/v1/sandboxes/{bob_sid}")


def test_a_streamed_command_counts_like_an_exec(server: ServerProcess) -> None:
    """Two streamed commands of 16 MiB each hold 32 of alice's 40M: her next exec waits until one
    of them ended (a streamed command's queue is the server's memory as much as an exec's result)."""
    with server.client("alice") as alice:
        sid = create(alice, "8M")
        url = server.url.replace("http", "ws") + f"/v1/sandboxes/{sid}/exec/stream"
        with contextlib.ExitStack() as stack:
            streams = [stack.enter_context(connect(url, additional_headers=server.headers("alice")))
                       for _ in range(2)]
            for ws in streams:
                ws.send(json.dumps({"cmd": "sleep 1", "timeout": 10}))
                assert json.loads(ws.recv(timeout=10))["type"] == "started"
            started = time.monotonic()
            answer = alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "timeout": 10})
            waited = time.monotonic() - started
            assert answer.status_code == 200, answer.text
            results = [json.loads(ws.recv(timeout=10)) for ws in streams]
            assert [r["type"] for r in results] == ["result", "result"]
            assert waited >= 0.5, f"the exec ran after {waited:.2f} s, beside two streams that filled the bound"
        alice.delete(f"/v1/sandboxes/{sid}")


def _ended(http: httpx.Client, sid: str, cmd: str) -> int:
    pid = int(http.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": cmd, "timeout": 30}).json()["pid"])
    deadline = time.monotonic() + 30
    while any(c["pid"] == pid for c in http.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]):
        assert time.monotonic() < deadline, "the command did not end"
        time.sleep(0.05)
    return pid


def _replay(server: ServerProcess, tenant: str, sid: str, pid: int) -> tuple[int, dict[str, Any]]:
    url = server.url.replace("http", "ws") + f"/v1/sandboxes/{sid}/commands/{pid}/stream"
    got = 0
    with connect(url, additional_headers=server.headers(tenant), max_size=None) as ws:
        while True:
            frame = json.loads(ws.recv(timeout=30))
            if frame["type"] == "stdout":
                got += len(frame["data"])
            elif frame["type"] == "result":
                return got, frame
            else:
                raise AssertionError(frame)


def test_ended_background_commands_keep_at_most_the_tenants_kept_output_bound(server: ServerProcess) -> None:
    """Each ended command printing 3 MiB keeps ~6 MiB (its output and its result): under a 24M bound
    alice's first three keep theirs, later ones keep none (result truncated, empty); bob's are his
    own; once alice's sandbox is gone, what it kept no longer counts."""
    prints = "head -c 3M /dev/zero | tr '\\0' a"
    with server.client("alice") as alice, server.client("bob") as bob:
        sid = create(alice, "4M")
        pids = [_ended(alice, sid, prints) for _ in range(5)]
        replays = [_replay(server, "alice", sid, pid) for pid in pids]
        for got, result in replays[:3]:
            assert got == 3 * MiB and len(result["stdout"]) == 3 * MiB and not result["truncated"]
        for got, result in replays[3:]:
            assert got == 0 and result["stdout"] == "" and result["truncated"] and result["exit_code"] == 0

        bob_sid = create(bob, "4M")
        got, result = _replay(server, "bob", bob_sid, _ended(bob, bob_sid, prints))
        assert got == 3 * MiB and not result["truncated"]

        assert alice.delete(f"/v1/sandboxes/{sid}").status_code == 204
        sid = create(alice, "4M")
        got, result = _replay(server, "alice", sid, _ended(alice, sid, prints))
        assert got == 3 * MiB and not result["truncated"], "a destroyed sandbox's kept output still counted"
        alice.delete(f"/v1/sandboxes/{sid}")
        bob.delete(f"/v1/sandboxes/{bob_sid}")


def test_a_command_that_stops_waiting_for_its_share_holds_none_of_it() -> None:
    """The shares' own bookkeeping: FIFO per tenant, a waiter cancelled before or after its grant
    leaves nothing counted, one larger than the whole bound runs alone."""

    async def scenario() -> None:
        shares = OutputShares(10)
        first = await shares.hold("a", 6)
        second = asyncio.ensure_future(shares.hold("a", 6))
        third = asyncio.ensure_future(shares.hold("a", 1))
        await asyncio.sleep(0)
        assert not second.done() and not third.done(), "a later, smaller command overtook a waiting one"
        other = shares.try_hold("b", 10)  # another tenant is not held behind "a"
        assert other is not None
        other()
        second.cancel()  # gone before its grant: the one behind it goes ahead
        release_third = await asyncio.wait_for(third, 5)
        assert shares.held["a"] == 7
        first()
        release_third()
        assert "a" not in shares.held

        holder = await shares.hold("a", 50)  # more than the bound: counted as all of it, runs alone
        assert shares.held["a"] == 10
        waiting = asyncio.ensure_future(shares.hold("a", 4))
        await asyncio.sleep(0)
        holder()  # grants the waiting one ...
        waiting.cancel()  # ... which is cancelled before it runs: nobody would release it
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0.01)
        assert "a" not in shares.held, shares.held

    asyncio.run(scenario())


#: what the stalling server waits for a WebSocket's writes to make progress before it aborts it
SEND_TIMEOUT = 8
#: 8 MiB of output on each stream, no byte of it valid text on its own terms: \x01 becomes six JSON bytes
PRINTS_16M = ("sleep 0.3; head -c 8M /dev/zero | tr '\\0' '\\1'; "
              "head -c 8M /dev/zero | tr '\\0' '\\1' >&2")
#: TCP_INFO's first byte: the connection's state
TCP_ESTABLISHED = 1


@pytest.fixture(scope="module")
def stalling_server(state_dir: Path) -> Iterator[ServerProcess]:
    config = {"max_output_bytes_per_tenant": "40M", "max_kept_output_per_tenant": "24M",
              "ws_send_timeout": SEND_TIMEOUT}
    with ServerProcess(state_dir / "srv-output-stalls", keys=KEYS, config=config) as srv:
        yield srv


def _never_reading_websocket(server: ServerProcess, tenant: str, path: str, first_message: str | None = None
                             ) -> socket.socket:
    """A WebSocket whose client never reads a byte (a receive buffer of a few KiB, full at once)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = base64.b64encode(os.urandom(16)).decode()
    head = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            f"Authorization: Bearer {KEYS[tenant]}\r\n\r\n")
    sock.sendall(head.encode())
    if first_message is not None:  # one masked text frame (mask 0: the payload as is)
        answer = b""
        while b"\r\n\r\n" not in answer:  # a frame sent before the handshake's answer is dropped
            answer += sock.recv(1)
        payload = first_message.encode()
        assert len(payload) < 126
        sock.sendall(bytes([0x81, 0x80 | len(payload)]) + b"\0\0\0\0" + payload)
    return sock


def _established(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == TCP_ESTABLISHED


def _rss_mib(server: ServerProcess) -> int:
    assert server.proc is not None
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) // 1024


def _background_starts(http: httpx.Client, count: int) -> list[int]:
    """How many of ``count`` background commands (16 MiB of alice's 40M each) a fresh sandbox may start."""
    sid = create(http, "8M")
    try:
        return [http.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "sleep 30", "timeout": 60}).status_code
                for _ in range(count)]
    finally:
        http.delete(f"/v1/sandboxes/{sid}")


def _wait_until_aborted(sock: socket.socket) -> float:
    started = time.monotonic()
    while _established(sock):
        assert time.monotonic() - started < SEND_TIMEOUT + 15, "a client that never reads was never cut off"
        time.sleep(0.2)
    return time.monotonic() - started


def test_an_attachment_that_never_reads_is_counted_and_cut_off_at_the_send_timeout(
        stalling_server: ServerProcess) -> None:
    """An attached client that never reads held its command's output in the server, counted by
    nothing once the command ended and its sandbox went, for as long as it kept its socket (2 x
    64 MiB a round: 60 -> 708 MiB after 4 rounds, still held 80 s later).  Now what it has not been
    sent counts against the tenant's output bound (16 MiB of alice's 40M: one more 16 MiB command
    starts, not two) and the connection is aborted once its writes made no progress for
    ``ws_send_timeout``: then nothing is counted or held.  A client that reads late, but reads,
    gets everything."""
    with stalling_server.client("alice") as alice:
        before = _rss_mib(stalling_server)
        sid = create(alice, "8M")
        started = alice.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": PRINTS_16M, "timeout": 30})
        pid = started.json()["pid"]
        stuck = _never_reading_websocket(stalling_server, "alice", f"/v1/sandboxes/{sid}/commands/{pid}/stream")
        with stuck:
            deadline = time.monotonic() + 30
            while any(c["pid"] == pid for c in alice.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]):
                assert time.monotonic() < deadline, "the command did not end"
                time.sleep(0.05)
            assert alice.delete(f"/v1/sandboxes/{sid}").status_code == 204
            starts_while_stuck = _background_starts(alice, 2)
            assert _established(stuck), "the machine was too slow to look before the send timeout"
            assert starts_while_stuck == [201, 429], "an attachment's unsent output was counted by nothing"
            _wait_until_aborted(stuck)
            time.sleep(0.5)  # its handler ends as the loss arrives
            assert _background_starts(alice, 2) == [201, 201], "an aborted attachment's output stayed counted"
            assert _rss_mib(stalling_server) < before + 24, "an aborted attachment's output stayed in the server"

        # the other direction: a client that only starts reading after a while gets it all
        sid = create(alice, "8M")
        pid = alice.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": PRINTS_16M, "timeout": 30}).json()["pid"]
        url = stalling_server.url.replace("http", "ws") + f"/v1/sandboxes/{sid}/commands/{pid}/stream"
        got = {"stdout": 0, "stderr": 0}
        with connect(url, additional_headers=stalling_server.headers("alice"), max_size=None) as ws:
            time.sleep(SEND_TIMEOUT / 2)
            while (frame := json.loads(ws.recv(timeout=30)))["type"] != "result":
                got[frame["type"]] += len(frame["data"])
        assert got == {"stdout": 8 * MiB, "stderr": 8 * MiB} and frame["exit_code"] == 0, (got, frame)
        alice.delete(f"/v1/sandboxes/{sid}")


def test_an_exec_stream_that_never_reads_gives_back_its_share_at_the_send_timeout(
        stalling_server: ServerProcess) -> None:
    """A streamed command whose client never reads: once it ended, its handler waited in its send
    for ever, holding the command's output share (16 MiB of alice's 40M) and its exec slot.  Now
    the connection is aborted once its writes made no progress for ``ws_send_timeout``."""
    with stalling_server.client("alice") as alice:
        sid = create(alice, "8M")
        request = json.dumps({"cmd": PRINTS_16M, "timeout": 30})
        stuck = _never_reading_websocket(stalling_server, "alice", f"/v1/sandboxes/{sid}/exec/stream", request)
        with stuck:
            time.sleep(2)  # the command printed what it prints and ended
            starts_while_stuck = _background_starts(alice, 2)
            assert _established(stuck), "the machine was too slow to look before the send timeout"
            assert starts_while_stuck == [201, 429]
            _wait_until_aborted(stuck)
            time.sleep(0.5)
            assert _background_starts(alice, 2) == [201, 201], "a stuck exec stream kept its output share"
        alice.delete(f"/v1/sandboxes/{sid}")
