"""Hostile input to ``corral serve``: what a request carries must be refused with a typed error,
never run as something else, crash a route or leave the server holding memory.

A real server on loopback without API keys (every caller is the one local tenant) and real
sandboxes of the process tier."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from corral.errors import InvalidSpec

from .sandbox_wait import wait_until
from .server_fixtures import ServerProcess


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    # WebSocket messages being received are bounded per tenant like request bodies
    config = {"max_sandboxes_per_tenant": 3, "max_memory_per_tenant": "1G", "max_request_bytes_per_tenant": "64M",
              "max_concurrent_execs": 16}
    with ServerProcess(state_dir / "srv-input", config=config) as srv:
        yield srv


@pytest.fixture(scope="module")
def sid(server: ServerProcess) -> Iterator[str]:
    with server.client() as http:
        response = http.post("/v1/sandboxes", json={"limits": {"memory": "128M"}})
        assert response.status_code == 201, response.text
        sandbox_id = str(response.json()["id"])
        try:
            yield sandbox_id
        finally:
            http.delete(f"/v1/sandboxes/{sandbox_id}")


def stream(server: ServerProcess, sid: str) -> ClientConnection:
    return connect(server.url.replace("http", "ws") + f"/v1/sandboxes/{sid}/exec/stream", open_timeout=10,
                   max_size=None)


def frames_until_end(ws: ClientConnection, limit: int = 1000) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    for _ in range(limit):
        frame = json.loads(ws.recv(timeout=20))
        frames.append(frame)
        if frame["type"] in ("result", "error"):
            break
    return frames


def exists(http: httpx.Client, sid: str, path: str) -> bool:
    return http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["test", "-e", path]}).json()["exit_code"] == 0


# -- NUL in a command --------------------------------------------------------------------------
NUL_COMMANDS: list[Any] = ["echo a\0; touch /tmp/nul-ran", ["sh", "-c", "touch /tmp/nul-ran\0 x"]]


@pytest.mark.parametrize("cmd", NUL_COMMANDS)
def test_nul_in_a_command_is_refused_by_the_library(sandbox: Any, cmd: Any) -> None:
    with pytest.raises(InvalidSpec, match="NUL"):
        sandbox.commands.run(cmd)
    with pytest.raises(InvalidSpec, match="NUL"):
        sandbox.commands.start(cmd)
    assert sandbox.commands.run("test -e /tmp/nul-ran").exit_code == 1
    # the allowed thing works: the same command without the NUL
    assert sandbox.commands.run("echo a; echo b").stdout == "a\nb\n"


@pytest.mark.parametrize("field", [{"cmd": "echo a\0; touch /tmp/nul-ran"},
                                   {"cmd": ["sh", "-c", "touch /tmp/nul-ran\0 x"]},
                                   {"cmd": "touch /tmp/nul-ran", "env": {"A": "x\0y"}},
                                   {"cmd": "touch /tmp/nul-ran", "env": {"A\0B": "x"}},
                                   {"cmd": "touch /tmp/nul-ran", "env": {"A\n": "x"}},
                                   {"cmd": "touch /tmp/nul-ran", "cwd": "/tmp\0/x"}])
def test_nul_in_a_command_is_a_typed_400_on_every_route(server: ServerProcess, sid: str,
                                                        field: dict[str, Any]) -> None:
    with server.client() as http:
        for path in (f"/v1/sandboxes/{sid}/exec", f"/v1/sandboxes/{sid}/commands"):
            response = http.post(path, json=field)
            assert (response.status_code, response.json()["error"]) == (400, "invalid_spec"), response.text
        with stream(server, sid) as ws:
            ws.send(json.dumps(field))
            frames = frames_until_end(ws)
        assert [f["type"] for f in frames] == ["error"] and frames[0]["error"] == "invalid_spec"
        assert not exists(http, sid, "/tmp/nul-ran")
        # the allowed thing works on each route
        ok = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo a; echo b"}).json()
        assert ok["stdout"] == "a\nb\n"
        assert http.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "true"}).status_code == 201
        with stream(server, sid) as ws:
            ws.send(json.dumps({"cmd": "echo a; echo b"}))
            assert frames_until_end(ws)[-1]["stdout"] == "a\nb\n"


# -- an env or argv past what exec takes ----------------------------------------------------------
KI = 1024
#: (env, the words of its refusal): one variable past the kernel's MAX_ARG_STRLEN, variables past
#: 1 MiB together, more variables than an environment may hold
TOO_LARGE_ENVS: list[tuple[dict[str, str], str]] = [
    ({"BIG": "a" * (128 * KI)}, "128 KiB"),
    ({f"V{n}": "a" * (120 * KI) for n in range(9)}, "1 MiB"),
    ({f"V{n}": "" for n in range(4097)}, "4096"),
]


@pytest.mark.parametrize(("env", "words"), TOO_LARGE_ENVS, ids=["one-value", "all-values", "count"])
def test_an_env_past_what_exec_takes_is_refused_at_every_entry_point(server: ServerProcess, sid: str,
                                                                     env: dict[str, str], words: str) -> None:
    """A spec's env was held by the server for the sandbox's life and rendered whole by every
    listing: 16 sandboxes of a 30 MiB env grew the server by 541 MiB (not given back), and a
    listing of them took 4.7 s of the event loop.  Now an env exec could not take is refused."""
    from corral.mcp_server import build_spec
    from corral.spec import SandboxSpec, parse_env_assignments

    with pytest.raises(InvalidSpec, match=words):  # the library and the MCP server's create
        SandboxSpec(env=env)
    with pytest.raises(InvalidSpec, match=words):
        build_spec(None, env=env)
    with pytest.raises(InvalidSpec, match=words):  # the CLI's --env K=V
        parse_env_assignments([f"{name}={value}" for name, value in env.items()])
    with server.client() as http:
        made = http.post("/v1/sandboxes", json={"limits": {"memory": "64M"}, "env": env})
        assert (made.status_code, made.json()["error"]) == (400, "invalid_spec"), made.text[:300]
        assert words in made.json()["message"]
        for path in (f"/v1/sandboxes/{sid}/exec", f"/v1/sandboxes/{sid}/commands"):
            refused = http.post(path, json={"cmd": "touch /tmp/env-ran", "env": env})
            assert (refused.status_code, refused.json()["error"]) == (400, "invalid_spec"), refused.text[:300]
        assert not exists(http, sid, "/tmp/env-ran")


def test_an_env_and_argv_exec_takes_are_run_and_a_listing_names_the_env_without_its_values(
        server: ServerProcess) -> None:
    fits = {"BIG": "b" * (128 * KI - 6), **{f"V{n}": "c" * (100 * KI) for n in range(8)}}  # NAME=value\0: 128 KiB
    with server.client() as http:
        made = http.post("/v1/sandboxes", json={"limits": {"memory": "64M"}, "env": fits})
        assert made.status_code == 201, made.text[:300]
        sandbox_id = made.json()["id"]
        try:
            ran = http.post(f"/v1/sandboxes/{sandbox_id}/exec",
                            json={"cmd": ["sh", "-c", 'echo ${#BIG} ${#V7} ${#1}', "sh", "d" * (128 * KI - 1)],
                                  "env": {"MORE": "e" * (64 * KI)}}).json()
            assert (ran["exit_code"], ran["stdout"]) == (0, f"{128 * KI - 6} {100 * KI} {128 * KI - 1}\n"), ran
            listed = [s for s in http.get("/v1/sandboxes").json()["sandboxes"] if s["id"] == sandbox_id]
            assert "env" not in listed[0]["spec"] and listed[0]["spec"]["env_names"] == sorted(fits)
            assert http.get(f"/v1/sandboxes/{sandbox_id}").json()["spec"]["env"] == fits
            for argv, words in ((["echo", "d" * (128 * KI)], "128 KiB"), (["echo", *["d" * (100 * KI)] * 21], "2 MiB"),
                                ("echo " + "d" * (128 * KI), "128 KiB")):
                refused = http.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": argv})
                assert (refused.status_code, refused.json()["error"]) == (400, "invalid_spec"), refused.text[:300]
                assert words in refused.json()["message"]
        finally:
            http.delete(f"/v1/sandboxes/{sandbox_id}")


# -- network entries past a host name's length ----------------------------------------------------
PADDED = " " * (1 << 20)


def test_a_network_entry_past_a_host_names_length_is_refused_and_one_with_spaces_is_kept_stripped(
        server: ServerProcess) -> None:
    """An ``allow`` entry was parsed stripped but held as given: 30 MiB of spaces before
    ``example.com`` was a valid entry, and 16 such sandboxes grew the server by 483 MiB (not given
    back), a listing of them by 367 MiB more (480 MiB in 3.1 s).  Now an entry is at most 300
    characters, a secret's binding is bounded too, and what the spec holds is the stripped text."""
    from corral.secrets import SecretBinding
    from corral.spec import SandboxSpec

    for spec, words in ((dict(allow=["example.org", PADDED + "example.com"]), "allow[1]"),
                        (dict(unsafe_allow_ranges=[PADDED + "10.0.0.0/8"]), "unsafe_allow_ranges[0]"),
                        (dict(secrets=["TOKEN@" + "h," * (1 << 19)]), "TOKEN"),
                        (dict(secrets=["TOKEN@" + ",".join(["h"] * 65)]), "65 hosts"),
                        (dict(secrets=["TOKEN@" + PADDED[:400] + "h"]), "300 characters"),
                        (dict(secrets=["T" * 300 + "@h"]), "256 characters"),
                        (dict(secrets=[f"T{n}@" + ",".join(f"h{m}" for m in range(64)) for n in range(17)]),
                         "1088 hosts")):
        with pytest.raises(InvalidSpec, match=re.escape(words)) as refused:
            SandboxSpec(network="allow", **spec)  # type: ignore[arg-type]
        assert len(str(refused.value)) < 1000
    with pytest.raises(InvalidSpec, match="300 characters"):  # a binding made in code
        SandboxSpec(network="allow", secrets=(SecretBinding("TOKEN", (PADDED + "h",)),))
    kept = SandboxSpec(network="allow", allow=["  Example.com:443 ", "\t*.example.org"],
                       unsafe_allow_ranges=[" 10.0.0.0/8 "], secrets=["TOKEN@ h.example "])
    assert (kept.allow, kept.unsafe_allow_ranges) == (("Example.com:443", "*.example.org"), ("10.0.0.0/8",))
    assert kept.secrets[0].hosts == ("h.example",)

    with server.client() as http:
        made = http.post("/v1/sandboxes", json={"limits": {"memory": "64M"}, "network": "allow",
                                                "allow": [PADDED + "example.com"]})
        assert (made.status_code, made.json()["error"]) == (400, "invalid_spec"), made.text[:300]
        assert "allow[0]" in made.json()["message"] and len(made.text) < 1000
        made = http.post("/v1/sandboxes", json={"limits": {"memory": "64M"}, "network": "allow",
                                                "allow": ["  example.com  "]})
        assert made.status_code == 201, made.text[:300]
        try:
            assert made.json()["spec"]["allow"] == ["example.com"]
            listed = [s for s in http.get("/v1/sandboxes").json()["sandboxes"] if s["id"] == made.json()["id"]]
            assert listed[0]["spec"]["allow"] == ["example.com"]
        finally:
            http.delete(f"/v1/sandboxes/{made.json()['id']}")


# -- JSON nested too deep to parse -------------------------------------------------------------
def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def inside(prefix: str, value: str) -> str:
    """``value`` as the last field of the JSON object(s) ``prefix`` opens."""
    return prefix + value + "}" * prefix.count("{")


@pytest.mark.parametrize("levels", [100_000, 990])
def test_json_nested_too_deep_is_a_typed_400_on_every_route(server: ServerProcess, sid: str, levels: int) -> None:
    nested = deep(levels)
    bodies = {  # the fast routes (create, exec) and FastAPI's, whole body and one field
        "/v1/sandboxes": [nested, inside('{"network": ', nested), inside('{"metadata": {"a": ', nested)],
        f"/v1/sandboxes/{sid}/exec": [nested, inside('{"cmd": ', nested)],
        f"/v1/sandboxes/{sid}/commands": [inside('{"cmd": ', nested)],
        f"/v1/sandboxes/{sid}/code": [inside('{"code": "1", "envs": ', nested)],
        f"/v1/sandboxes/{sid}/contexts": [inside('{"language": ', nested)],
    }
    with server.client() as http:
        for path, contents in bodies.items():
            for content in contents:
                response = http.post(path, content=content, headers={"content-type": "application/json"})
                assert response.status_code == 400, (path, content[:40], response.text[:200])
                assert response.json()["error"] == "invalid_spec"
                assert "nested too deep" in response.json()["message"]
        assert http.get("/healthz").status_code == 200
    # the exec stream: a first frame is refused with an error frame and the close code of a 400
    with stream(server, sid) as ws:
        ws.send(inside('{"cmd": "echo hi", "env": ', nested))
        frame = json.loads(ws.recv(timeout=20))
        assert frame["error"] == "invalid_spec" and "nested too deep" in frame["message"]
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=20)
        assert ws.close_code == 4400
    # ... a control frame is refused and the stream goes on
    with stream(server, sid) as ws:
        ws.send(json.dumps({"cmd": "read line; echo got $line"}))
        assert json.loads(ws.recv(timeout=20))["type"] == "started"
        ws.send(inside('{"type": "stdin", "data": ', nested))
        frame = json.loads(ws.recv(timeout=20))
        assert frame["error"] == "invalid_spec" and "nested too deep" in frame["message"]
        ws.send(json.dumps({"type": "stdin", "data": "x\n"}))
        frames = frames_until_end(ws)
    assert frames[-1]["type"] == "result" and frames[-1]["stdout"] == "got x\n"


# -- frames the exec stream does not take ------------------------------------------------------
def running(http: httpx.Client, sid: str, pid_file: str) -> bool:
    check = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": f"kill -0 $(cat {pid_file})"}).json()
    return check["exit_code"] == 0


@pytest.mark.parametrize("unexpected", [b"\x00\x01binary", "not json", '{"type": "dance"}'])
def test_an_unexpected_control_frame_is_refused_and_closing_still_kills(server: ServerProcess, sid: str,
                                                                       unexpected: str | bytes) -> None:
    pid_file = "/tmp/stream-cmd.pid"
    with server.client() as http:
        with stream(server, sid) as ws:
            ws.send(json.dumps({"cmd": f"echo $$ > {pid_file}; exec sleep 987"}))
            assert json.loads(ws.recv(timeout=20))["type"] == "started"
            ws.send(unexpected)
            frame = json.loads(ws.recv(timeout=20))
            assert (frame["type"], frame["error"]) == ("error", "invalid_spec")
            # the stream still reads its control frames
            ws.send(json.dumps({"type": "stdin", "data": "x"}))
            # (the pid file may still hold the previous case's pid: "started" can come before the
            # shell wrote its own, and a loaded host's CI saw it so)
            assert wait_until(lambda: running(http, sid, pid_file), 10, every=0.1)
        # the client closed: the command is killed
        for _ in range(100):
            if not running(http, sid, pid_file):
                break
            time.sleep(0.1)
        assert not running(http, sid, pid_file), "the command ran on after its stream was closed"


def test_a_binary_first_frame_is_refused(server: ServerProcess, sid: str) -> None:
    with stream(server, sid) as ws:
        ws.send(json.dumps({"cmd": "echo hi"}).encode())
        frame = json.loads(ws.recv(timeout=20))
        assert frame["error"] == "invalid_spec" and "binary frames" in frame["message"]
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=20)
        assert ws.close_code == 4400


# -- code cells the kernel's parser cannot take --------------------------------------------------
def test_a_nul_or_deeply_nested_cell_is_its_own_error_over_rest(server: ServerProcess, sid: str) -> None:
    with server.client() as http:
        def cell(code: str) -> dict[str, Any]:
            response = http.post(f"/v1/sandboxes/{sid}/code", json={"code": code})
            assert response.status_code == 200, response.text
            return dict(response.json())

        assert cell("x = 1")["error"] is None
        for code in ("x = 2\0", "x = " + "-" * 100_000 + "1"):
            assert cell(code)["error"]["name"] in ("SyntaxError", "RecursionError")
        assert cell("x")["results"][0]["text"] == "1"


# -- WebSocket messages being received ----------------------------------------------------------
MiB = 1 << 20


def rss_mib(server: ServerProcess) -> float:
    assert server.proc is not None
    with open(f"/proc/{server.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def half_sent_message(server: ServerProcess, sid: str, sent: int = 15 * MiB) -> socket.socket:
    """A WebSocket on the exec stream that sent the header of a 16 MiB text frame and ``sent``
    bytes of its payload (or fewer, if the server closed it first)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET /v1/sandboxes/{sid}/exec/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                 f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head and len(head) < 65536:
        head += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 101"), head[:200]
    sock.sendall(bytes([0x81, 0x80 | 127]) + struct.pack("!Q", 16 * MiB) + b"\0\0\0\0")  # mask 0: payload as is
    piece = b"a" * MiB
    try:
        for _ in range(sent // MiB):
            sock.sendall(piece)
    except OSError:
        pass  # closed by the server
    return sock


def close_code(sock: socket.socket) -> int | None:
    """The code of the close frame the server sent on ``sock``, if it sent one."""
    data = b""
    try:
        while len(data) < 4:
            more = sock.recv(4 - len(data))
            if not more:
                break
            data += more
    except OSError:
        return None
    if len(data) < 4 or data[0] != 0x88:
        return None
    return int(struct.unpack("!H", data[2:4])[0])


def settled_rss(server: ServerProcess, below: float, seconds: float = 10) -> float:
    deadline = time.monotonic() + seconds
    while (rss := rss_mib(server)) >= below and time.monotonic() < deadline:
        time.sleep(0.2)
    return rss


def test_half_received_messages_are_dropped_at_close(server: ServerProcess, sid: str) -> None:
    before = rss_mib(server)
    socks = [half_sent_message(server, sid) for _ in range(4)]  # 60 MiB: within the tenant's 64 MiB
    try:
        time.sleep(0.5)
        holding = rss_mib(server)
        assert holding > before + 50, (before, holding)  # the test sees what the server holds
    finally:
        for sock in socks:
            sock.close()
    # (some of what was freed stays with the allocator: the margin)
    after = settled_rss(server, below=before + 30)
    assert after < before + 30, f"RSS {before:.0f} MiB -> {holding:.0f} holding -> {after:.0f} after close"


def test_a_tenant_cannot_hold_unbounded_half_received_messages(server: ServerProcess, sid: str) -> None:
    before = rss_mib(server)
    socks = []
    try:
        for _ in range(12):  # 180 MiB asked for; the tenant may hold 64 MiB of messages being received
            socks.append(half_sent_message(server, sid))
        time.sleep(0.5)
        holding = rss_mib(server)
        codes = [close_code(sock) for sock in socks[6:]]
    finally:
        for sock in socks:
            sock.close()
    assert holding < before + 64 + 40, f"RSS {before:.0f} MiB -> {holding:.0f} with 12 half-sent 16 MiB messages"
    assert codes.count(1009) == len(codes), codes  # those past the bound: closed, "message too big"
    assert settled_rss(server, below=before + 30) < before + 30
    # the allowed thing works: a large message on its own is received whole
    with stream(server, sid) as ws:
        ws.send(json.dumps({"cmd": "wc -c"}))
        assert json.loads(ws.recv(timeout=20))["type"] == "started"
        ws.send(json.dumps({"type": "stdin", "data": "b" * (12 * MiB)}))
        ws.send(json.dumps({"type": "stdin_close"}))
        frames = frames_until_end(ws)
    assert frames[-1]["type"] == "result" and frames[-1]["stdout"].strip() == str(12 * MiB), frames[-1]


def test_stdin_a_command_has_not_taken_is_bounded_per_tenant(server: ServerProcess, sid: str) -> None:
    """Streams whose commands read nothing: their stdin frames are held in the server (in flight
    to the command, and queued behind it) and count with the tenant's messages being received."""
    before = rss_mib(server)
    frame = json.dumps({"type": "stdin", "data": "b" * (12 * MiB)})
    told = 0
    with contextlib.ExitStack() as streams:
        for _ in range(8):  # 2 x 12 MiB each: 192 MiB asked for; the tenant may hold 64 MiB
            ws = streams.enter_context(stream(server, sid))
            ws.send(json.dumps({"cmd": "sleep 30", "timeout": 20}))
            assert json.loads(ws.recv(timeout=20))["type"] == "started"
            try:
                ws.send(frame)
                ws.send(frame)
                answer = json.loads(ws.recv(timeout=1))
                told += answer.get("error") == "resource_limit"
            except TimeoutError:
                pass
            except ConnectionClosed as closed:
                told += closed.rcvd is not None and closed.rcvd.code == 1009
        time.sleep(0.5)
        holding = rss_mib(server)
    # each byte counted is held up to ~3 times (the frame's text, its bytes, the agent's write)
    assert holding < before + 3 * 64 + 40, f"RSS {before:.0f} MiB -> {holding:.0f} with 8 x 2 x 12 MiB of stdin"
    assert told >= 1
