"""``corral mcp`` over stdio, driven by the official MCP SDK's own client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.host import cgroups

from .leaks import sandbox_leftovers
from .server_fixtures import CORRAL, mcp_stdio, status_as_user


@contextlib.contextmanager
def mcp_http_server(state_dir: Path, name: str, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """``corral mcp --http`` on a free loopback port, with a state directory of its own: (process,
    URL of its /mcp endpoint, state directory); terminated on the way out."""
    state = state_dir / name
    state.mkdir()
    os.chmod(state_dir, 0o711)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_API_KEY")}
    server = subprocess.Popen([CORRAL, "--state-dir", str(state), "mcp", "--http", "--port", str(port), *args],
                              env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "corral mcp --http did not start"
                time.sleep(0.1)
        yield server, f"http://127.0.0.1:{port}/mcp", state
    finally:
        server.terminate()
        server.wait(timeout=30)


def _payload(result: Any) -> dict[str, Any]:
    assert not result.is_error, result
    if result.structured_content:
        return dict(result.structured_content)
    return dict(json.loads(result.content[0].text))


def test_mcp_round_trip_and_session_cleanup(state_dir: Path) -> None:
    from mcp import ClientSession, stdio_client

    params, state = mcp_stdio(state_dir, "mcp")

    async def session() -> tuple[str, set[str]]:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            tools = {t.name for t in (await client.list_tools()).tools}
            assert {"create_sandbox", "run_command", "write_file", "read_file", "list_files",
                    "destroy_sandbox"} <= tools
            sid = _payload(await client.call_tool("create_sandbox", {"memory": "128M"}))["sandbox_id"]
            other = _payload(await client.call_tool("create_sandbox", {}))["sandbox_id"]
            ran = _payload(await client.call_tool("run_command", {"sandbox_id": sid, "command": "echo hi; exit 3"}))
            assert (ran["exit_code"], ran["stdout"]) == (3, "hi\n")
            _payload(await client.call_tool("write_file", {"sandbox_id": sid, "path": "n.txt", "content": "note"}))
            read = _payload(await client.call_tool("read_file", {"sandbox_id": sid, "path": "n.txt"}))
            assert read["content"] == "note"
            names = [e["name"] for e in _payload(await client.call_tool("list_files", {"sandbox_id": sid}))["entries"]]
            assert names == ["n.txt"]
            _payload(await client.call_tool("destroy_sandbox", {"sandbox_id": sid}))
            gone = await client.call_tool("run_command", {"sandbox_id": sid, "command": "true"})
            assert gone.is_error and "no sandbox" in gone.content[0].text
            live = {other}
            assert other in cgroups.list_sandbox_groups()
            return sid, live

    destroyed, left_open = asyncio.run(session())
    # the session ended with `other` still open: the server destroyed it on the way out
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (left_open & cgroups.list_sandbox_groups()):
        time.sleep(0.1)
    assert not ({destroyed} | left_open) & cgroups.list_sandbox_groups()
    assert list((state / "sandboxes").iterdir()) == []


def test_mcp_http_sessions_are_isolated_and_cleaned_up_each(state_dir: Path) -> None:
    """Streamable HTTP serves many sessions: each sees only its own sandboxes, and each session's
    sandboxes go when that session ends (client DELETE, or idle), not when the server does."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client


    def live() -> set[str]:
        return set(cgroups.list_sandbox_groups())

    def wait_gone(ids: set[str], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and ids & live():
            time.sleep(0.1)
        return not ids & live()

    async def scenario(url: str) -> tuple[str, str]:
        async with streamable_http_client(url) as (ra, wa), ClientSession(ra, wa) as a:
            await a.initialize()
            a_id = _payload(await a.call_tool("create_sandbox", {"memory": "128M"}))["sandbox_id"]
            async with streamable_http_client(url, terminate_on_close=False) as (rb, wb), \
                    ClientSession(rb, wb) as b:
                await b.initialize()
                b_id = _payload(await b.call_tool("create_sandbox", {"memory": "128M"}))["sandbox_id"]
                # the other session's sandbox is not there for b, exactly like a missing one
                foreign = await b.call_tool("run_command", {"sandbox_id": a_id, "command": "true"})
                assert foreign.is_error and "no sandbox" in foreign.content[0].text
                mine = _payload(await b.call_tool("run_command", {"sandbox_id": b_id, "command": "echo b"}))
                assert mine["stdout"] == "b\n"
                # b leaves without terminating its session: only the idle timeout can end it
        # a's client terminated its session (DELETE) on the way out
        return a_id, b_id

    with mcp_http_server(state_dir, "mcp-http", "--session-idle-timeout", "6") as (server, url, state):
        # no key guards it: a web page (DNS rebinding, or any Origin) is refused, as by the REST server
        initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "page", "version": "1"}}}
        accept = {"accept": "application/json, text/event-stream"}
        assert httpx.post(url, json=initialize, headers={**accept, "host": "evil.example"}).status_code == 421
        assert httpx.post(url, json=initialize, headers={**accept, "origin": "http://evil.example"}).status_code == 403
        port = int(url.split(":")[2].split("/")[0])
        body = json.dumps(initialize).encode()
        raw = (f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: application/json, text/event-stream\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        assert status_as_user(65534, port, raw) == 403  # another user of the host
        with socket.create_connection(("127.0.0.1", port)) as roots:  # naming root's connection: no matter
            forged = f"\r\nX-Forwarded-For: 127.0.0.1:{roots.getsockname()[1]}\r\n\r\n".encode()
            assert status_as_user(65534, port, raw.replace(b"\r\n\r\n", forged, 1)) == 403
        assert status_as_user(0, port, raw) == 200
        a_id, b_id = asyncio.run(scenario(url))
        assert wait_gone({a_id}, 10), "the terminated session's sandbox survived"
        assert b_id in live(), "the idle session's sandbox went before its idle timeout"
        assert wait_gone({b_id}, 20), "the idle session's sandbox survived its idle timeout"
        assert server.poll() is None
    assert list((state / "sandboxes").iterdir()) == []


def test_mcp_run_code_gives_images_and_every_text_is_capped(state_dir: Path) -> None:
    import base64
    import struct
    import zlib

    from mcp import ClientSession, stdio_client

    from corral.mcp_server import TEXT_CAP

    def png() -> bytes:  # a valid 1x1 PNG, made by hand (the sandbox's python needs no imaging library)
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))

    params, _ = mcp_stdio(state_dir, "mcp-content")
    image = png()

    async def session() -> None:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            sid = _payload(await client.call_tool("create_sandbox", {"memory": "256M"}))["sandbox_id"]
            code = (f"import base64\nclass Dot:\n    def _repr_png_(self):\n"
                    f"        return base64.b64decode({base64.b64encode(image).decode()!r})\n"
                    "print('x' * 30000)\nDot()")
            ran = await client.call_tool("run_code", {"sandbox_id": sid, "code": code})
            assert not ran.is_error and [c.type for c in ran.content] == ["text", "image"]
            assert ran.content[1].mime_type == "image/png" and base64.b64decode(ran.content[1].data) == image
            answer = json.loads(ran.content[0].text)
            assert len(answer["stdout"]) == TEXT_CAP and answer["cut"]["stdout"]["total_chars"] == 30001
            assert "read_file" in answer["note"] and answer["results"][0]["png"] == "(image content below)"
            big = _payload(await client.call_tool("run_command", {"sandbox_id": sid,
                                                                  "command": "head -c 50000 /dev/zero | tr '\\0' y"}))
            assert len(big["stdout"]) == TEXT_CAP and big["cut"]["stdout"]["total_chars"] == 50000
            # an exception's message and a JSON result are capped too (1,000,329 characters came whole)
            ran = await client.call_tool("run_code", {"sandbox_id": sid, "code": (
                "class J:\n    def _repr_json_(self):\n        return {'k': 'j' * 30000}\n"
                "display(J())\nraise ValueError('E' * 30000)")})
            answer = json.loads(ran.content[0].text)
            assert len(ran.content[0].text) < 4 * TEXT_CAP, len(ran.content[0].text)
            assert len(answer["error"]["value"]) == TEXT_CAP and answer["error"]["cut"]["value"]["total_chars"] >= 30000
            assert len(answer["results"][0]["json"]) == TEXT_CAP
            small = _payload(await client.call_tool("run_command", {"sandbox_id": sid, "command": "echo ok"}))
            assert small["stdout"] == "ok\n" and small["truncated"] is False and "cut" not in small
            await client.call_tool("run_command", {"sandbox_id": sid,
                                                   "command": "head -c 45000 /dev/zero | tr '\\0' z > big.txt"})
            pages, offset = [], 0
            while offset is not None:  # bounded: three pages of a 45000-character file
                page = _payload(await client.call_tool("read_file", {"sandbox_id": sid, "path": "big.txt",
                                                                     "offset": offset}))
                pages.append(page["content"])
                offset = page["next_offset"]
                assert len(pages) <= 3
            assert "".join(pages) == "z" * 45000 and [len(p) for p in pages] == [TEXT_CAP, TEXT_CAP, 5000]

    asyncio.run(session())


def test_one_mcp_sessions_long_commands_do_not_hold_another_sessions_calls(state_dir: Path) -> None:
    """Session a runs 9 commands of 4 s at once; session b's command is answered meanwhile (before:
    every tool call went to asyncio's default pool, cpus + 4 = 6 threads here, and b waited for a's
    sleeps); a's own commands past its share (8) wait their turn and all end well."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client


    async def scenario(url: str) -> tuple[float, list[dict[str, Any]]]:
        async with streamable_http_client(url) as (ra, wa), ClientSession(ra, wa) as a, \
                streamable_http_client(url) as (rb, wb), ClientSession(rb, wb) as b:
            await a.initialize()
            await b.initialize()
            a_id = _payload(await a.call_tool("create_sandbox", {"memory": "128M"}))["sandbox_id"]
            b_id = _payload(await b.call_tool("create_sandbox", {"memory": "128M"}))["sandbox_id"]
            long = [asyncio.ensure_future(a.call_tool("run_command", {"sandbox_id": a_id, "command": "sleep 4",
                                                                       "timeout": 60}))
                    for _ in range(9)]
            await asyncio.sleep(0.5)  # held behind them, b would wait 3.5 s
            started = time.monotonic()
            mine = _payload(await b.call_tool("run_command", {"sandbox_id": b_id, "command": "echo b"}))
            waited = time.monotonic() - started
            assert mine["stdout"] == "b\n"
            return waited, [_payload(r) for r in await asyncio.gather(*long)]

    with mcp_http_server(state_dir, "mcp-http-share") as (_, url, _):
        waited, results = asyncio.run(scenario(url))
    assert waited < 2.5, f"session b's command waited {waited:.1f} s behind session a's"
    assert [r["exit_code"] for r in results] == [0] * 9, results


def test_mcp_http_call_longer_than_idle_timeout_keeps_its_sandbox_and_a_gone_client_is_reaped(
        state_dir: Path) -> None:
    """The idle timeout counts from the end of a session's last request, as the SDK's does: a command
    running longer than it keeps its sandbox (it was killed mid-command: 'the sandbox stopped while the
    command ran' at 7 s of a 12 s sleep with a 6 s timeout), and a client that goes away mid-command
    leaves its session idle from then on: its sandbox, and the command in it, go after the timeout."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async def long_call(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
        async with streamable_http_client(url) as (r, w), ClientSession(r, w) as client:
            await client.initialize()
            sid = _payload(await client.call_tool("create_sandbox", {"memory": "128M"}))["sandbox_id"]
            ran = _payload(await client.call_tool("run_command", {"sandbox_id": sid, "command": "sleep 6; echo done",
                                                                  "timeout": 60}))
            again = _payload(await client.call_tool("run_command", {"sandbox_id": sid, "command": "echo again"}))
            return ran, again

    made: list[str] = []

    async def gone_mid_command(url: str) -> None:
        async with streamable_http_client(url, terminate_on_close=False) as (r, w), ClientSession(r, w) as client:
            await client.initialize()
            made.append(_payload(await client.call_tool("create_sandbox", {"memory": "128M"}))["sandbox_id"])
            await client.call_tool("run_command", {"sandbox_id": made[0], "command": "sleep 300", "timeout": 600})

    async def leave_after(seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(gone_mid_command(url), seconds)

    with mcp_http_server(state_dir, "mcp-idle", "--session-idle-timeout", "3") as (server, url, state):
        ran, again = asyncio.run(long_call(url))
        assert (ran["exit_code"], ran["stdout"], again["stdout"]) == (0, "done\n", "again\n"), (ran, again)
        asyncio.run(leave_after(2))
        left = time.monotonic()
        assert made and made[0] in cgroups.list_sandbox_groups()
        while time.monotonic() - left < 30 and made[0] in cgroups.list_sandbox_groups():
            time.sleep(0.2)
        assert made[0] not in cgroups.list_sandbox_groups(), "a gone client's sandbox outlived the idle timeout"
        assert time.monotonic() - left >= 2.5, "the sandbox went before the idle timeout"
        assert server.poll() is None
    assert list((state / "sandboxes").iterdir()) == []


def _peak_rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmHWM")


def test_mcp_command_output_costs_the_server_a_bounded_amount(state_dir: Path) -> None:
    """A session's 8 sandboxes each print 40 MiB to stdout and to stderr at once: the model is shown
    20000 characters of each, and the MCP server keeps at most MCP_MAX_OUTPUT of each stream while it
    makes the answer (before: the sandbox's 16 MiB default, 2 x 16 MiB bytes and their text per call:
    +1.2 GiB for 8 calls of random bytes); a short output still comes back whole."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from corral.mcp_server import MCP_MAX_OUTPUT, TEXT_CAP

    async def flood(url: str, pid: int) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
        async with streamable_http_client(url) as (r, w), ClientSession(r, w) as client:
            await client.initialize()
            ids = [_payload(await client.call_tool("create_sandbox", {"memory": "64M"}))["sandbox_id"]
                   for _ in range(8)]
            small = _payload(await client.call_tool("run_command", {"sandbox_id": ids[0], "command": "echo hi"}))
            before = _peak_rss_mib(pid)
            command = "head -c 40M /dev/zero | tr '\\0' a; head -c 40M /dev/zero | tr '\\0' b >&2"
            answers = await asyncio.gather(*[client.call_tool("run_command", {"sandbox_id": sid, "command": command,
                                                                              "timeout": 120}) for sid in ids])
            return _peak_rss_mib(pid) - before, [_payload(a) for a in answers], small

    with mcp_http_server(state_dir, "mcp-flood") as (server, url, _state):
        grew, answers, small = asyncio.run(flood(url, server.pid))
    assert grew < 200, f"8 flooding commands grew the MCP server by {grew} MiB"
    assert (small["stdout"], small["truncated"]) == ("hi\n", False) and "cut" not in small
    for answer in answers:
        assert answer["exit_code"] == 0 and answer["truncated"], answer.keys()
        assert answer["stdout"] == "a" * TEXT_CAP and answer["stderr"] == "b" * TEXT_CAP
        assert answer["cut"]["stdout"]["total_chars"] <= MCP_MAX_OUTPUT, answer["cut"]


def test_mcp_http_delete_ends_the_session_the_sdk_terminated(state_dir: Path) -> None:
    """A DELETE naming two session ids (two ``mcp-session-id`` headers): the SDK terminates the first,
    and Corral ends that same session's sandboxes at once (before: it read the last header, so it ended
    another session -- or, for a made-up id, none, and the terminated session's sandbox lived on until
    the idle timeout); the other session's sandbox is untouched."""
    import httpx

    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}

    def sse_json(reply: httpx.Response) -> dict[str, Any]:
        data = [line[5:] for line in reply.text.splitlines() if line.startswith("data:")]
        return dict(json.loads(data[-1] if data else reply.text))

    def open_session(client: httpx.Client, url: str) -> tuple[str, str]:
        reply = client.post(url, json=initialize, headers=headers)
        key = reply.headers["mcp-session-id"]
        own = {**headers, "mcp-session-id": key}
        client.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=own)
        made = sse_json(client.post(url, headers=own, json={"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "create_sandbox", "arguments": {"memory": "64M"}}}))
        return key, json.loads(made["result"]["content"][0]["text"])["sandbox_id"]

    with mcp_http_server(state_dir, "mcp-dup") as (server, url, _state), httpx.Client(timeout=30) as client:
        ended_key, ended_sb = open_session(client, url)
        _other_key, other_sb = open_session(client, url)
        reply = client.request("DELETE", url, headers=[("mcp-session-id", ended_key),
                                                       ("mcp-session-id", "0" * 32)])
        assert reply.status_code < 300, reply.text
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and ended_sb in cgroups.list_sandbox_groups():
            time.sleep(0.1)
        assert ended_sb not in cgroups.list_sandbox_groups(), "the terminated session's sandbox lived on"
        assert other_sb in cgroups.list_sandbox_groups()
        assert server.poll() is None


def test_mcp_http_a_connected_client_that_calls_nothing_is_idle(state_dir: Path) -> None:
    """A client of the SDK keeps a GET stream open for as long as it is connected (the server's
    messages to it); counted as a request in flight, it kept its session and sandboxes past the
    idle timeout for ever, a tool call or not."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async def scenario(url: str) -> tuple[str, float, bool]:
        async with streamable_http_client(url) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            made = _payload(await session.call_tool("create_sandbox", {"memory": "128M"}))["sandbox_id"]
            idle_from = time.monotonic()
            deadline = idle_from + 15
            while made in cgroups.list_sandbox_groups() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            return made, time.monotonic() - idle_from, made in cgroups.list_sandbox_groups()

    with mcp_http_server(state_dir, "mcp-connected-idle", "--session-idle-timeout", "3") as (server, url, _):
        _, waited, still_there = asyncio.run(scenario(url))
        assert not still_there, f"a connected client's sandbox outlived its idle timeout ({waited:.0f} s)"
        assert waited >= 2.5, "the sandbox went before the idle timeout"
        assert server.poll() is None


def test_mcp_lists_a_directory_holding_a_name_that_is_not_utf8(state_dir: Path) -> None:
    """One file whose name is not UTF-8 made list_files fail for its whole directory, embedded and
    through a server; the name is shown with \\xNN for its odd byte, marked, and the rest as ever."""
    from mcp import ClientSession, StdioServerParameters, stdio_client

    from .server_fixtures import KEYS, ServerProcess

    state = state_dir / "mcp-badname"
    state.mkdir()
    os.chmod(state_dir, 0o711)
    env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_API_KEY")}

    async def listing(env: dict[str, str]) -> dict[str, Any]:
        params = StdioServerParameters(command=CORRAL, args=["--state-dir", str(state), "mcp"], env=env)
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            sid = _payload(await client.call_tool("create_sandbox", {"memory": "128M"}))["sandbox_id"]
            made = await client.call_tool("run_command", {"sandbox_id": sid, "command": (
                "mkdir /tmp/d && python3 -c \"open(b'/tmp/d/bad\\xe9.txt', 'wb').write(b'hi')\" && echo x > /tmp/d/ok")})
            assert _payload(made)["exit_code"] == 0
            return _payload(await client.call_tool("list_files", {"sandbox_id": sid, "path": "/tmp/d"}))

    with ServerProcess(state_dir / "srv-mcp-badname", keys=KEYS) as server:
        remote = {**env, "CORRAL_URL": server.url, "CORRAL_API_KEY": KEYS["alice"]}
        for answer in (asyncio.run(listing(env)), asyncio.run(listing(remote))):
            assert answer["entries"] == [{"name": "bad\\xe9.txt", "type": "file", "size": 2, "not_utf8": True},
                                         {"name": "ok", "type": "file", "size": 2}], answer
            assert "not UTF-8" in answer["names_note"]


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGHUP"])
def test_a_stdio_mcp_server_told_to_stop_ends_and_destroys_its_sandboxes(state_dir: Path, stop: str) -> None:
    """`corral mcp` on stdio, its client still holding the pipe: SIGTERM destroyed its sandboxes
    but the process never ended (its exit waited for the SDK's stdin reader), and SIGHUP (the
    client's terminal closed) killed it by the default action, leaving cgroups, run directory and
    record until a janitor came.  Now each ends it in seconds, at 128 + the signal, a call still
    in flight, and nothing is left."""
    import signal

    state = state_dir / f"mcp-stdio-{stop}"
    state.mkdir()
    os.chmod(state_dir, 0o711)
    env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_API_KEY")}
    server = subprocess.Popen([CORRAL, "--state-dir", str(state), "mcp"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert server.stdin is not None and server.stdout is not None

    def call(ident: int, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        assert server.stdin is not None and server.stdout is not None
        message = {"jsonrpc": "2.0", "id": ident, "method": method, **({"params": params} if params else {})}
        server.stdin.write((json.dumps(message) + "\n").encode())
        server.stdin.flush()
        while True:
            answer = json.loads(server.stdout.readline())
            if answer.get("id") == ident:
                return answer

    try:
        call(1, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                               "clientInfo": {"name": "test", "version": "0"}})
        server.stdin.write(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
        made = call(2, "tools/call", {"name": "create_sandbox", "arguments": {"memory": "64M"}})
        sandbox_id = json.loads(made["result"]["content"][0]["text"])["sandbox_id"]
        assert (state / "sandboxes" / sandbox_id).exists()
        # a call in flight when the signal comes: a command that would run for minutes
        server.stdin.write((json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
            "name": "run_command", "arguments": {"sandbox_id": sandbox_id, "command": "sleep 300"}}}) + "\n").encode())
        server.stdin.flush()
        time.sleep(0.5)
        server.send_signal(getattr(signal, stop))
        assert server.wait(timeout=30) == 128 + getattr(signal, stop)
        assert sandbox_leftovers(sandbox_id, state) == []
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_the_model_gets_sandboxes_only_within_the_operators_bounds(state_dir: Path) -> None:
    """A model chose its sandboxes' size and reach: memory 1T, 1024 CPUs, a week per command, every
    public address.  Now each is refused past what `corral mcp` was started with (defaults: 4G,
    the host's CPUs, 3600 s, no destination at all), with the flag that holds it back named; what
    is within the bounds is made, a default over a bound is lowered to it, and all sandboxes'
    memory together is bounded too (a fork counts as its parent)."""
    from mcp import ClientSession, stdio_client

    def refused(result: Any, *words: str) -> None:
        assert result.is_error, result
        text = result.content[0].text
        assert all(word in text for word in words), text

    async def defaults() -> None:
        params, _ = mcp_stdio(state_dir, "mcp-bounds-default")
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            for asked, flag in (({"memory": "1T"}, "--max-memory"), ({"cpus": 1024}, "--max-cpus"),
                                ({"timeout": 604800}, "--max-timeout"), ({"allow": ["0.0.0.0/0"]}, "--allow (none)"),
                                ({"allow": ["pypi.org"]}, "--allow (none)")):
                refused(await client.call_tool("create_sandbox", {"memory": "64M", **asked}), "invalid_spec", flag)
            sid = _payload(await client.call_tool("create_sandbox", {"memory": "64M", "timeout": 3600}))["sandbox_id"]
            refused(await client.call_tool("run_command", {"sandbox_id": sid, "command": "true", "timeout": 86400}),
                    "--max-timeout")
            refused(await client.call_tool("run_code", {"sandbox_id": sid, "code": "1", "timeout": 86400}),
                    "--max-timeout")
            ran = _payload(await client.call_tool("run_command", {"sandbox_id": sid, "command": "echo in",
                                                                  "timeout": 30}))
            assert ran["stdout"] == "in\n"

    async def operators() -> None:
        params, _ = mcp_stdio(state_dir, "mcp-bounds-set", "--max-memory", "96M", "--max-total-memory", "192M",
                              "--max-cpus", "0.5", "--max-timeout", "30", "--allow", "*.example.test",
                              "--allow", "198.51.100.0/24:443")
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            init = await client.initialize()
            assert "memory up to 96M" in (init.instructions or ""), init.instructions
            first = _payload(await client.call_tool("create_sandbox", {}))["sandbox_id"]  # defaults lowered
            layout = cgroups.detect()
            limit_file = "memory.max" if layout.version == 2 else "memory.limit_in_bytes"
            group = layout.controllers["memory"] / cgroups.PARENT / first
            assert int((group / limit_file).read_text()) == 96 << 20
            refused(await client.call_tool("create_sandbox", {"memory": "128M"}), "--max-memory")
            refused(await client.call_tool("create_sandbox", {"cpus": 1}), "--max-cpus")
            refused(await client.call_tool("create_sandbox", {"allow": ["example.test"]}), "*.example.test")
            refused(await client.call_tool("create_sandbox", {"allow": ["198.51.100.7:80"]}), "--allow")
            second = _payload(await client.call_tool("create_sandbox", {
                "memory": "96M", "allow": ["api.example.test", "*.cdn.example.test", "198.51.100.7:443"]}))["sandbox_id"]
            refused(await client.call_tool("create_sandbox", {"memory": "16M"}), "resource_limit", "--max-total-memory")
            refused(await client.call_tool("fork_sandbox", {"sandbox_id": first}), "--max-total-memory")
            _payload(await client.call_tool("destroy_sandbox", {"sandbox_id": second}))
            forks = _payload(await client.call_tool("fork_sandbox", {"sandbox_id": first}))["sandbox_ids"]
            assert len(forks) == 1


    async def short_cells() -> None:  # a cell's own default (60 s) was past a lower --max-timeout
        params, _ = mcp_stdio(state_dir, "mcp-bounds-cells", "--max-timeout", "3")
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            sid = _payload(await client.call_tool("create_sandbox", {"memory": "256M"}))["sandbox_id"]
            started = time.monotonic()
            cell = await client.call_tool("run_code", {"sandbox_id": sid, "code": "import time; time.sleep(20)"})
            assert time.monotonic() - started < 15, "the cell ran past --max-timeout"
            assert "imeout" in cell.content[0].text, cell.content[0].text[:300]
            refused(await client.call_tool("run_code", {"sandbox_id": sid, "code": "1", "timeout": 5}), "--max-timeout")

    async def short_lives() -> None:  # a command's timeout left what it started running (helper 95)
        params, _ = mcp_stdio(state_dir, "mcp-bounds-lives", "--max-timeout", "5", "--max-lifetime", "4")
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            init = await client.initialize()
            assert "destroyed 4 s after it is made" in (init.instructions or ""), init.instructions
            sid = _payload(await client.call_tool("create_sandbox", {"memory": "64M"}))["sandbox_id"]
            ran = _payload(await client.call_tool("run_command", {
                "sandbox_id": sid, "command": "nohup sh -c 'while :; do sleep 1; done' > /dev/null 2>&1 &"}))
            assert ran["exit_code"] == 0
            group = cgroups.detect().controllers["pids"] / cgroups.PARENT / sid
            assert group.is_dir()  # the allowed case: it runs, within its lifetime
            deadline = time.monotonic() + 20
            while group.exists():
                assert time.monotonic() < deadline, "the sandbox outlived --max-lifetime"
                await asyncio.sleep(0.5)
            refused(await client.call_tool("run_command", {"sandbox_id": sid, "command": "true"}), "no sandbox")
            # a fork lives out its parent's life, not one of its own (helper 96: a chain of forks
            # kept a sandbox's files for ever)
            parent = _payload(await client.call_tool("create_sandbox", {"memory": "64M"}))["sandbox_id"]
            await asyncio.sleep(2)
            fork = _payload(await client.call_tool("fork_sandbox", {"sandbox_id": parent}))["sandbox_ids"][0]
            started = time.monotonic()
            while not (await client.call_tool("run_command", {"sandbox_id": fork, "command": "true"})).is_error:
                assert time.monotonic() - started < 20, "the fork outlived its parent's --max-lifetime"
                await asyncio.sleep(0.5)
            assert time.monotonic() - started < 2 + 1.5, "the fork lived a life of its own"

    asyncio.run(defaults())
    asyncio.run(operators())
    asyncio.run(short_cells())
    asyncio.run(short_lives())


@pytest.mark.parametrize("flags, said", [
    (["--max-memory", "12Q"], "--max-memory"), (["--max-total-memory", "-1"], "--max-total-memory"),
    (["--max-cpus", "0"], "--max-cpus"), (["--max-timeout", "nan"], "--max-timeout"),
    (["--max-lifetime", "-5"], "--max-lifetime"),
    (["--allow", "not a host!"], "allow 'not a host!'")])
def test_bad_operator_bounds_stop_corral_mcp_before_it_serves(state_dir: Path, flags: list[str], said: str) -> None:
    """Each bound `corral mcp` is given is checked before it serves anything: a typed error
    naming the flag, exit 125, nothing read from stdin."""
    env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_API_KEY")}
    out = subprocess.run([CORRAL, "--state-dir", str(state_dir / "mcp-bad-flags"), "mcp", *flags],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 125 and said in out.stderr, out


def test_the_mcp_reaper_destroys_every_expired_sandbox_whatever_one_raises() -> None:
    """A destroy that raised (a remote server briefly unreachable) left the session's other
    expired sandboxes running and untracked, and ended the reaper for the server's life (helper 96)."""
    from corral.mcp_limits import McpLimits
    from corral.mcp_server import Session, Sessions

    class Held:
        def __init__(self, sandbox_id: str, fails: bool) -> None:
            self.id, self.fails, self.killed = sandbox_id, fails, False

        def kill(self) -> None:
            self.killed = True
            if self.fails:
                raise ConnectionError("the server is unreachable")

    sessions = Sessions(limits=McpLimits(max_lifetime=10))
    session = sessions._by_id[None] = Session(sessions)
    held = [Held("sb-a", True), Held("sb-b", False), Held("sb-c", False)]
    now = time.monotonic()
    for sb in held:
        session.sandboxes[sb.id], session.made[sb.id] = sb, now - (5 if sb.id == "sb-c" else 11)
    sessions.end_expired(now)
    assert [sb.killed for sb in held] == [True, True, False] and list(session.sandboxes) == ["sb-c"]
    sessions.close()
    assert held[2].killed and not session.sandboxes


def test_a_fork_keeps_its_parents_clock_when_the_parent_goes_while_it_is_made() -> None:
    """The fork's clock was read from its parent's after the fork was made: a destroy of the
    parent sent 8 ms after the fork gave the fork a lifetime of its own (helper 97)."""
    from types import SimpleNamespace

    from corral.mcp_limits import McpLimits
    from corral.mcp_server import Session, Sessions

    sessions = Sessions(limits=McpLimits(max_lifetime=10))
    session = sessions._by_id[None] = Session(sessions)

    class Parent:
        id = "sb-parent"
        spec = SimpleNamespace(limits=SimpleNamespace(memory=64 << 20))

        def fork(self, count: int) -> list[Any]:
            session.sandboxes.pop(self.id)  # destroyed meanwhile, as destroy_sandbox does
            session.made.pop(self.id)
            return [SimpleNamespace(id="sb-fork", spec=self.spec, kill=lambda: None)]

    born = time.monotonic() - 9
    session.sandboxes["sb-parent"], session.made["sb-parent"] = Parent(), born
    asyncio.run(session.fork("sb-parent", 1))
    assert session.made["sb-fork"] == born
    sessions.end_expired(born + 10)
    assert not session.sandboxes
