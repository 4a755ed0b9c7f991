"""The HTTP API against a real ``corral serve`` on loopback: raw HTTP and a WebSocket client."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from .server_fixtures import KEYS, ServerProcess


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    config = {"max_request_bytes": 1 << 20, "max_sandboxes_per_tenant": 3, "max_memory_per_tenant": "1G",
              "max_concurrent_execs": 2, "metrics_tenants": ["alice"]}
    with ServerProcess(state_dir / "srv-api", keys=KEYS, config=config) as srv:
        yield srv


def create(http: httpx.Client, **body: object) -> str:
    response = http.post("/v1/sandboxes", json={"limits": {"memory": "128M"}, **body})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def test_lifecycle_exec_and_files(server: ServerProcess) -> None:
    with server.client("alice") as http:
        sid = create(http)
        assert http.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        assert sid in [s["id"] for s in http.get("/v1/sandboxes").json()["sandboxes"]]
        result = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo out; echo err >&2; exit 3"}).json()
        assert (result["exit_code"], result["stdout"], result["stderr"]) == (3, "out\n", "err\n")
        assert set(result) >= {"exit_code", "stdout", "stderr", "duration_ms", "timed_out", "oom_killed",
                               "signal", "truncated"}
        argv = http.post(f"/v1/sandboxes/{sid}/exec",
                         json={"cmd": ["sh", "-c", 'echo "$X" $(pwd); cat'], "env": {"X": "x1"}, "cwd": "/tmp",
                               "stdin": "in"}).json()
        assert argv["stdout"] == "x1 /tmp\nin"
        put = http.put(f"/v1/sandboxes/{sid}/files/content", params={"path": "d/f.bin"}, content=b"\x00\xffdata",
                       headers={"content-type": "application/octet-stream"})
        assert put.status_code == 204, put.text
        got = http.get(f"/v1/sandboxes/{sid}/files/content", params={"path": "d/f.bin"})
        assert got.content == b"\x00\xffdata"
        # the sandbox's bytes on the API's origin: saved by a browser, never shown as its page
        assert (got.headers["content-type"], got.headers["content-disposition"], got.headers["x-content-type-options"],
                got.headers["content-security-policy"]) == ("application/octet-stream", "attachment", "nosniff", "sandbox")
        listing = http.get(f"/v1/sandboxes/{sid}/files", params={"path": "d"}).json()["entries"]
        assert [(e["name"], e["size"]) for e in listing] == [("f.bin", 6)]
        assert http.post(f"/v1/sandboxes/{sid}/files/dir", params={"path": "e/f"}).status_code == 204
        assert http.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "e/f"}).json()["type"] == "dir"
        for route, method in (("/files/content", http.put), ("/files/dir", http.post)):
            suid = method(f"/v1/sandboxes/{sid}{route}", params={"path": "s", "mode": 0o4755}, content=b"x")
            assert (suid.status_code, suid.json()["error"]) == (400, "invalid_spec"), suid.text
            assert "setuid" in suid.json()["message"]
        assert http.delete(f"/v1/sandboxes/{sid}/files", params={"path": "d/f.bin"}).status_code == 204
        gone = http.get(f"/v1/sandboxes/{sid}/files/content", params={"path": "d/f.bin"})
        assert (gone.status_code, gone.json()["error"]) == (404, "file_not_found")
        assert http.delete(f"/v1/sandboxes/{sid}").status_code == 204
        missing = http.get(f"/v1/sandboxes/{sid}")
        assert (missing.status_code, missing.json()["error"]) == (404, "not_found")


def test_timeout_and_oom_results(server: ServerProcess) -> None:
    with server.client("alice") as http:
        sid = create(http, limits={"memory": "64M"})
        try:
            timeouts_before = metric(http.get("/metrics").text, "corral_exec_timeouts_total")
            slow = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 30", "timeout": 0.5}).json()
            assert slow["timed_out"] is True and slow["duration_ms"] < 10_000
            hog = http.post(f"/v1/sandboxes/{sid}/exec",
                            json={"cmd": ["python3", "-c", "b = bytearray(400 << 20); print(len(b))"]}).json()
            assert hog["oom_killed"] is True and hog["stdout"] == ""
            # the sandbox survives both
            assert http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo ok"}).json()["stdout"] == "ok\n"
            metrics = http.get("/metrics").text
            # the server is shared by this module's tests: count this test's timeout, not a total
            assert metric(metrics, "corral_exec_timeouts_total") == timeouts_before + 1
            assert "corral_live_sandboxes" in metrics and "corral_sandbox_create_seconds_bucket" in metrics
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


def metric(text: str, name: str) -> float:
    """The value of an unlabelled Prometheus sample (0 when the series is not there yet)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value)
    return 0.0


def _stream(server: ServerProcess, sid: str, tenant: str = "alice"):  # type: ignore[no-untyped-def]
    return connect(server.url.replace("http", "ws") + f"/v1/sandboxes/{sid}/exec/stream",
                   additional_headers=server.headers(tenant), open_timeout=10, legacy=True)


def test_stream_order_stdin_and_result(server: ServerProcess) -> None:
    with server.client("alice") as http:
        sid = create(http)
        try:
            with _stream(server, sid) as ws:
                ws.send(json.dumps({"cmd": "echo one; sleep 0.2; echo two >&2; sleep 0.2; read x; echo got $x; "
                                           "exit 7"}))
                frames = []
                while True:
                    frame = json.loads(ws.recv(timeout=20))
                    frames.append(frame)
                    if frame["type"] == "stderr":
                        ws.send(json.dumps({"type": "stdin", "data": "hello\n"}))
                    if frame["type"] in ("result", "error"):
                        break
            kinds = [(f["type"], f.get("data")) for f in frames if f["type"] in ("stdout", "stderr")]
            assert kinds == [("stdout", "one\n"), ("stderr", "two\n"), ("stdout", "got hello\n")]
            assert frames[0]["type"] == "started"
            assert frames[-1]["type"] == "result" and frames[-1]["exit_code"] == 7
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


def _frames_until_result(ws: Any) -> list[dict[str, Any]]:
    frames = []
    while True:
        frames.append(json.loads(ws.recv(timeout=20)))
        if frames[-1]["type"] in ("result", "error"):
            return frames


def _output_frames(frames: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str, bytes]:
    """The stdout frames, their text (what a client of ``data`` sees) and their bytes."""
    out = [f for f in frames if f["type"] == "stdout"]
    raw = b"".join(base64.b64decode(f["data_b64"]) if "data_b64" in f else f["data"].encode() for f in out)
    return out, "".join(f["data"] for f in out), raw


def test_output_that_is_not_utf8_also_comes_as_its_bytes_and_text_stays_text(server: ServerProcess) -> None:
    """An output frame whose bytes are not UTF-8 carries them in ``data_b64`` (they came only as
    U+FFFD text); ``data`` is the text as before, and a character cut between two writes is text."""
    printed = "printf 'caf\\303'; sleep 0.3; printf '\\251 \\377\\376 end\\n'"
    with server.client("alice") as http:
        sid = create(http)
        try:
            with _stream(server, sid) as ws:
                ws.send(json.dumps({"cmd": printed}))
                out, text, raw = _output_frames(_frames_until_result(ws))
            assert out[0] == {"type": "stdout", "data": "caf"}  # its cut é waits for the rest of it
            assert raw == b"caf\xc3\xa9 \xff\xfe end\n"
            assert text == "café \ufffd\ufffd end\n"
            with _stream(server, sid) as ws:
                ws.send(json.dumps({"cmd": "printf 'caf\\303'; sleep 0.3; printf '\\251\\n'"}))
                out, text, raw = _output_frames(_frames_until_result(ws))
            assert text == "café\n" and not any("data_b64" in f for f in out)  # text alone stays text alone
            started = http.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": printed})
            assert started.status_code == 201, started.text
            pid = started.json()["pid"]
            with connect(server.url.replace("http", "ws") + f"/v1/sandboxes/{sid}/commands/{pid}/stream",
                         additional_headers=server.headers("alice"), open_timeout=10, legacy=True) as ws:
                out, text, raw = _output_frames(_frames_until_result(ws))
            assert raw == b"caf\xc3\xa9 \xff\xfe end\n" and text == "café \ufffd\ufffd end\n"
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


def test_a_name_that_is_not_utf8_is_listed_with_its_bytes_and_a_query_that_is_not_utf8_is_refused(
        server: ServerProcess) -> None:
    """One such name made the whole listing a 400; a path's %-escape that is not UTF-8 was taken as
    U+FFFD, and a file of that other name was written."""
    make = "import os; os.makedirs('/tmp/d'); open(b'/tmp/d/bad\\xffname', 'wb').write(b'payload')"
    with server.client("alice") as http:
        sid = create(http)
        files = f"/v1/sandboxes/{sid}/files"
        try:
            assert http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["python3", "-c", make]}).json()["exit_code"] == 0
            listing = http.get(files, params={"path": "/tmp/d"})
            assert listing.status_code == 200, listing.text
            [entry] = listing.json()["entries"]
            assert (entry["name"], entry["path"]) == ("bad\ufffdname", "/tmp/d/bad\ufffdname")
            assert base64.b64decode(entry["name_b64"]) == b"bad\xffname"
            assert base64.b64decode(entry["path_b64"]) == b"/tmp/d/bad\xffname"
            got = http.get(f"{files}/content", params={"path_b64": entry["path_b64"]})
            assert got.content == b"payload"
            assert http.get(f"{files}/stat", params={"path_b64": entry["path_b64"]}).json()["name_b64"] == entry["name_b64"]
            for method in ("GET", "PUT", "DELETE"):
                refused = http.request(method, f"{files}/content?path=/tmp/d/%FF" if method != "DELETE"
                                       else f"{files}?path=/tmp/d/%FF", content=b"x")
                assert refused.status_code == 400 and refused.json()["error"] == "invalid_spec", refused.text
                assert "not UTF-8" in refused.json()["message"]
            both = http.get(f"{files}/content", params={"path": "/tmp/d/x", "path_b64": entry["path_b64"]})
            assert both.status_code == 400 and "give one" in both.json()["message"]
            assert http.delete(files, params={"path_b64": entry["path_b64"]}).status_code == 204
            assert http.get(files, params={"path": "/tmp/d"}).json()["entries"] == []  # nothing named U+FFFD either
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


def test_stream_signal_kill_and_output_cap(server: ServerProcess) -> None:
    with server.client("alice") as http:
        sid = create(http, limits={"memory": "128M", "max_output": "64K"})
        try:
            with _stream(server, sid) as ws:
                ws.send(json.dumps({"cmd": ["sleep", "100"]}))
                assert json.loads(ws.recv(timeout=20))["type"] == "started"
                ws.send(json.dumps({"type": "signal", "signal": 15}))
                frame = json.loads(ws.recv(timeout=20))
                assert frame["type"] == "result" and frame["signal"] == 15
            with _stream(server, sid) as ws:
                ws.send(json.dumps({"cmd": "yes", "timeout": 2}))
                streamed, result = 0, None
                while result is None:
                    frame = json.loads(ws.recv(timeout=20))
                    if frame["type"] == "stdout":
                        streamed += len(frame["data"])
                    elif frame["type"] == "result":
                        result = frame
                assert streamed == 64 << 10 and result["truncated"] and len(result["stdout"]) == 64 << 10
            with _stream(server, sid) as ws:
                ws.send(json.dumps({"cmd": "sleep 100"}))
                assert json.loads(ws.recv(timeout=20))["type"] == "started"
                ws.send(json.dumps({"type": "resize", "rows": 24, "cols": 80}))
                assert "pty" in json.loads(ws.recv(timeout=20))["message"]
                ws.send(json.dumps({"type": "kill"}))
                frame = json.loads(ws.recv(timeout=20))
                assert frame["type"] == "result" and frame["exit_code"] != 0
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


def test_stream_on_a_pty_with_resize(server: ServerProcess) -> None:
    with server.client("alice") as http:
        sid = create(http)
        try:
            with _stream(server, sid) as ws:
                ws.send(json.dumps({"cmd": "stty size; read x; stty size", "pty": [24, 80]}))
                assert json.loads(ws.recv(timeout=20))["type"] == "started"
                output = ""
                while "24 80" not in output:
                    output += json.loads(ws.recv(timeout=20)).get("data", "")
                ws.send(json.dumps({"type": "resize", "rows": 40, "cols": 100}))
                ws.send(json.dumps({"type": "stdin", "data": "\n"}))
                while (frame := json.loads(ws.recv(timeout=20)))["type"] != "result":
                    assert frame["type"] == "stdout"  # a terminal has one output stream
                assert "40 100" in frame["stdout"] and frame["exit_code"] == 0
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


def test_closing_the_stream_kills_the_command(server: ServerProcess) -> None:
    with server.client("alice") as http:
        sid = create(http)
        try:
            with _stream(server, sid) as ws:
                ws.send(json.dumps({"cmd": "sleep 1000 & echo started; wait"}))
                while json.loads(ws.recv(timeout=20)).get("data") != "started\n":
                    pass
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                procs = http.post(f"/v1/sandboxes/{sid}/exec",
                                  json={"cmd": "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"}).json()["stdout"]
                if "sleep 1000" not in procs:
                    break
                time.sleep(0.2)
            assert "sleep 1000" not in procs
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


def test_tenants_are_isolated(server: ServerProcess) -> None:
    with server.client("alice") as alice, server.client("bob") as bob, server.client() as anonymous:
        sid = create(alice)
        try:
            assert anonymous.get("/v1/sandboxes").status_code == 401
            wrong = httpx.get(server.url + "/v1/sandboxes", headers={"Authorization": "Bearer not-a-key"})
            assert wrong.status_code == 401 and wrong.json()["error"] == "unauthorized"
            missing = bob.get("/v1/sandboxes/sb-0000000000000000")
            theirs = bob.get(f"/v1/sandboxes/{sid}")
            assert theirs.status_code == missing.status_code == 404
            assert theirs.json()["error"] == missing.json()["error"] == "not_found"
            assert bob.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}).status_code == 404
            assert bob.delete(f"/v1/sandboxes/{sid}").status_code == 404
            assert bob.get(f"/v1/sandboxes/{sid}/files", params={"path": "/"}).status_code == 404
            assert bob.get("/v1/sandboxes").json()["sandboxes"] == []
            ws = _stream(server, sid, "bob")
            # refused before the exec request is even read
            assert json.loads(ws.recv(timeout=10))["error"] == "not_found"
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404
            # and the owner still can
            assert alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}).json()["exit_code"] == 0
        finally:
            alice.delete(f"/v1/sandboxes/{sid}")


def test_quotas_answer_429(server: ServerProcess) -> None:
    with server.client("bob") as bob:
        big = bob.post("/v1/sandboxes", json={"limits": {"memory": "2G"}})
        assert big.status_code == 429 and "memory" in big.json()["message"]
        ids = [create(bob) for _ in range(3)]
        try:
            over = bob.post("/v1/sandboxes", json={"limits": {"memory": "128M"}})
            assert over.status_code == 429
            assert over.json()["error"] == "resource_limit" and "3 live sandboxes" in over.json()["message"]
        finally:
            for sid in ids:
                bob.delete(f"/v1/sandboxes/{sid}")
        create_again = create(bob)
        bob.delete(f"/v1/sandboxes/{create_again}")


def test_concurrent_exec_limit(server: ServerProcess) -> None:
    with server.client("alice") as http:
        sid = create(http)
        try:
            streams = [_stream(server, sid) for _ in range(2)]
            for ws in streams:
                ws.send(json.dumps({"cmd": "sleep 5"}))
                assert json.loads(ws.recv(timeout=10))["type"] == "started"
            third = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
            assert third.status_code == 429 and "at once" in third.json()["message"]
            for ws in streams:
                ws.close()
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"imagee": "host"}, 400, "unknown field"),
    ({"limits": {"memory": "1K"}}, 400, "memory"),
    ({"limits": {"memroy": "1G"}}, 400, "unknown field"),
    ({"limits": {"pids": -1}}, 400, "pids"),
    ({"tier": "nope"}, 400, "tier"),
    ({"workspace": "/etc"}, 400, "workspace"),
    ({"idle_timeout": -5}, 400, "idle_timeout"),
    ({"idle_timeout": "5"}, 422, "idle_timeout"),  # strict: "5" and true were taken for numbers
    ({"lifetime": True}, 422, "lifetime"),
    ({"lifetime": 10**9}, 400, "lifetime"),
    ({"env": {"1BAD": "x"}}, 400, "env"),
    ({"limits": "lots"}, 422, "limits"),
    ({"limits": {"max_output": "1G"}}, 400, "max_output"),
    ({"network": "allow", "allow": ["example.com"], "secrets": ["TOKEN@example.com"]}, 400, "server's environment"),
    ({"network": "allow", "allow": ["10.0.0.0/8"], "unsafe_allow_ranges": ["10.0.0.0/8"]}, 400, "server"),
])
def test_bad_create_requests_say_what_is_wrong(server: ServerProcess, body: dict[str, object], status: int,
                                               words: str) -> None:
    with server.client("alice") as http:
        response = http.post("/v1/sandboxes", json=body)
    assert response.status_code == status, response.text
    assert words in response.json()["message"]


def test_bad_exec_file_and_size_requests(server: ServerProcess) -> None:
    with server.client("alice") as http:
        sid = create(http)
        try:
            base = f"/v1/sandboxes/{sid}"
            for body in ({"cmd": ""}, {"cmd": []}, {"cmd": "true", "timeout": -1}, {"cmd": "true", "bogus": 1},
                         {"cmd": "true", "timeout": "5"}, {"cmd": "true", "timeout": True},
                         {"cmd": ["a\u0000b"]}, {"cmd": "true", "cwd": "x\u0000"}):
                response = http.post(base + "/exec", json=body)
                assert 400 <= response.status_code < 500, (body, response.text)
                assert response.json()["message"]
            for route, body in (("/fork", {"count": "2"}), ("/fork", {"count": True}), ("/timeout", {"timeout": "60"})):
                assert http.post(base + route, json=body).status_code == 422, (route, body)
            negative = http.post(base + "/timeout", json={"timeout": -5})
            assert negative.status_code == 400 and "positive" in negative.json()["message"], negative.text
            for raw in ('{"cmd": "echo \\ud800"}', '{"cmd": ["echo", "\\ud800"]}', '{"cmd": "true", "stdin": "\\ud800"}',
                        '{"cmd": "true", "env": {"A": "\\ud800"}}', '{"cmd": "true", "cwd": "/\\ud800"}'):
                lone = http.post(base + "/exec", content=raw, headers={"content-type": "application/json"})
                assert lone.status_code == 400 and "Unicode" in lone.json()["message"], (raw, lone.text)
            lone_env = http.post("/v1/sandboxes", content='{"env": {"A": "\\ud800"}}',
                                 headers={"content-type": "application/json"})
            assert lone_env.status_code == 400, lone_env.text
            escaping = http.get(base + "/files/content", params={"path": "../../etc/shadow"})
            assert escaping.status_code == 400 and "'..'" in escaping.json()["message"]
            huge = http.put(base + "/files/content", params={"path": "big"}, content=b"x" * (2 << 20),
                            headers={"content-type": "application/octet-stream"})
            assert huge.status_code == 413 and "limit" in huge.json()["message"]
            chunked = http.put(base + "/files/content", params={"path": "big"},
                               content=iter([b"x" * (1 << 19)] * 4),
                               headers={"content-type": "application/octet-stream"})
            assert chunked.status_code == 413
            extend = http.post(base + "/timeout", json={"timeout": 10**7})
            assert extend.status_code == 400 and "max lifetime" in extend.json()["message"]
            assert http.post(base + "/timeout", json={"timeout": 120}).status_code == 200
            assert http.post("/v1/sandboxes", content=b"{not json",
                             headers={"content-type": "application/json"}).status_code == 422
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


def test_idle_timeout_and_lifetime_destroy_sandboxes(server: ServerProcess) -> None:
    with server.client("alice") as http:
        idle = create(http, idle_timeout=1)
        short = create(http, lifetime=2.5)
        extended = create(http, lifetime=1.5)
        assert http.post(f"/v1/sandboxes/{extended}/timeout", json={"timeout": 60}).status_code == 200
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # keep "short" busy: lifetime ends it anyway
            http.post(f"/v1/sandboxes/{short}/exec", json={"cmd": "true"})
            time.sleep(0.3)
        time.sleep(2)
        assert http.get(f"/v1/sandboxes/{idle}").status_code == 404
        assert http.get(f"/v1/sandboxes/{short}").status_code == 404
        assert http.get(f"/v1/sandboxes/{extended}").status_code == 200
        http.delete(f"/v1/sandboxes/{extended}")
    assert not any((server.state / "sandboxes" / sid).exists() for sid in (idle, short, extended))


@pytest.mark.parametrize("tier", ["process", "microvm"])
def test_a_fork_lives_out_its_parents_lifetime_not_one_of_its_own(server: ServerProcess, state_dir: Path,
                                                                   tier: str) -> None:
    """A fork keeps its parent's deadline, and cannot be extended past its parent's max lifetime:
    a microVM's fork carries the parent's running processes, and one got a fresh max_lifetime
    (9.4 s later than its parent's after 8 s), so forking before each deadline ran a process past
    the operator's max_lifetime for ever.  (The process tier's forks, from a snapshot, alike.)"""
    if tier != "process":
        from .tier_probe import skip_unless_tier

        skip_unless_tier(tier, state_dir)
    with server.client("alice") as http:
        parent = create(http, tier=tier, limits={"memory": "256M"}, lifetime=12)
        kid = ""
        try:
            started = http.post(f"/v1/sandboxes/{parent}/exec",
                                json={"cmd": "nohup sleep 100000 >/dev/null 2>&1 & echo started", "cwd": "/tmp"}).json()
            assert started["stdout"] == "started\n", started
            time.sleep(2)
            forked = http.post(f"/v1/sandboxes/{parent}/fork", json={"count": 1}, timeout=120)
            assert forked.status_code == 201, forked.text
            kid = forked.json()["sandboxes"][0]["id"]
            assert forked.json()["sandboxes"][0]["expires_at"] == http.get(f"/v1/sandboxes/{parent}").json()["expires_at"]
            # its max lifetime is counted from its parent's start: 3599 s from now is past it
            past = http.post(f"/v1/sandboxes/{kid}/timeout", json={"timeout": 3599})
            assert (past.status_code, past.json()["error"]) == (400, "invalid_spec"), past.text
            assert http.post(f"/v1/sandboxes/{kid}/timeout", json={"timeout": 3}).status_code == 200  # within it: allowed
            deadline = time.monotonic() + 20
            while http.get(f"/v1/sandboxes/{kid}").status_code != 404 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert http.get(f"/v1/sandboxes/{kid}").status_code == 404
        finally:
            for sid in (parent, kid):
                if sid:
                    http.delete(f"/v1/sandboxes/{sid}")


def test_a_background_command_is_not_idle_and_its_waiter_keeps_its_output(server: ServerProcess) -> None:
    """A sandbox running a background command is not reaped as idle (it was, after
    ``idle_timeout``, with a client waiting on it), it idles out once the command ends, and a
    waiter whose sandbox is destroyed under it gets what the command printed (it got an empty
    result)."""
    from corral import Sandbox

    with server.client("alice") as http:
        sid = create(http, idle_timeout=1)
        sb = Sandbox.connect(sid, url=server.url, api_key=KEYS["alice"])
        job = sb.commands.run("for i in 1 2 3 4 5 6; do echo tick$i; sleep 0.5; done; echo finished",
                              background=True)
        result = job.wait()
        assert result.exit_code == 0 and result.stdout.endswith("tick6\nfinished\n"), result
        job = sb.commands.run("for i in $(seq 40); do echo tick$i; sleep 0.1; done", background=True)
        waited: list[Any] = []
        waiter = threading.Thread(target=lambda: waited.append(job.wait()))
        waiter.start()  # attached before the sandbox goes
        time.sleep(1.5)
        assert http.delete(f"/v1/sandboxes/{sid}").status_code == 204
        waiter.join(30)
        assert waited and waited[0].stdout.startswith("tick1\ntick2\n"), waited
        sid = create(http, idle_timeout=1)
        job = Sandbox.connect(sid, url=server.url, api_key=KEYS["alice"]).commands.run("true", background=True)
        job.wait()
        time.sleep(2.5)
        assert http.get(f"/v1/sandboxes/{sid}").status_code == 404  # idle once nothing runs


def test_the_idle_clock_starts_when_a_background_command_ends(server: ServerProcess) -> None:
    """A sandbox whose client waited out a background command longer than ``idle_timeout`` was
    idle the moment the command ended (the clock ran from the wait's request) and reaped before
    the client's next request (the full suite saw SandboxNotFound once)."""
    from corral import Sandbox

    with server.client("alice") as http:
        sid = create(http, idle_timeout=2)
        job = Sandbox.connect(sid, url=server.url, api_key=KEYS["alice"]).commands.run("sleep 3", background=True)
        assert job.wait().exit_code == 0
        time.sleep(1.2)  # past two reaper passes, within the idle timeout from the command's end
        assert http.get(f"/v1/sandboxes/{sid}").status_code == 200
        time.sleep(3)  # and it still idles out once nothing is asked of it (a GET is use)
        assert http.get(f"/v1/sandboxes/{sid}").status_code == 404


def test_a_sandbox_whose_creator_left_before_the_answer_is_destroyed(server: ServerProcess) -> None:
    """A create whose client gave up (a short client timeout, a crash) left a sandbox nobody knew
    of, alive until its idle timeout and counted against the tenant's quota."""
    import socket

    with server.client("alice") as http:
        before = {s["id"] for s in http.get("/v1/sandboxes").json()["sandboxes"]}
        body = json.dumps({"limits": {"memory": "128M"}, "network": "allow", "allow": ["example.com"]}).encode()
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
                client.sendall(f"POST /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                               f"Authorization: Bearer {KEYS['alice']}\r\nContent-Type: application/json\r\n"
                               f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                time.sleep(0.005)  # the request is under way: the client gives up
        time.sleep(3)  # made (in well under a second), and destroyed at once
        assert not {s["id"] for s in http.get("/v1/sandboxes").json()["sandboxes"]} - before
        sid = create(http)  # the allowed direction: a client that waits gets its sandbox
        assert http.get(f"/v1/sandboxes/{sid}").status_code == 200
        http.delete(f"/v1/sandboxes/{sid}")


def test_openapi_document(server: ServerProcess) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    paths = doc["paths"]
    assert {"/v1/sandboxes", "/v1/sandboxes/{sandbox_id}", "/v1/sandboxes/{sandbox_id}/exec",
            "/v1/sandboxes/{sandbox_id}/timeout", "/v1/sandboxes/{sandbox_id}/files",
            "/v1/sandboxes/{sandbox_id}/files/content"} <= set(paths)
    assert "HTTPBearer" in doc["components"]["securitySchemes"]


def test_metrics_are_read_only_by_the_tenants_listed(server: ServerProcess) -> None:
    # the whole server's numbers (every tenant's sandboxes, commands, refusals): once any tenant's
    with server.client("alice") as alice, server.client("bob") as bob:
        assert alice.get("/metrics").status_code == 200 and "corral_execs_total" in alice.get("/metrics").text
        refused = bob.get("/metrics")
        assert refused.status_code == 403 and refused.json()["error"] == "forbidden", refused.text


def test_tenants_reach_only_what_the_operator_allows(state_dir: Path) -> None:
    """A tenant chose its sandboxes' reach freely (any public address, ``network="open"``): an
    operator had no say where its hosts' sandboxes send what they hold.  ``corral serve --allow``
    bounds it (a tenant's ``allow`` within, ``open`` refused) and ``--no-network`` takes it away;
    without either, public destinations stay the tenant's choice."""
    import subprocess

    from .server_fixtures import CORRAL

    args = ("--allow", "*.example.test", "--allow", "203.0.113.0/24:443")
    with ServerProcess(state_dir / "srv-allow", *args, keys=KEYS) as srv, srv.client("alice") as http:
        for asked in (["api.example.test"], ["*.cdn.example.test", "203.0.113.7:443"], ["203.0.113.0/28:443"]):
            made = http.post("/v1/sandboxes", json={"limits": {"memory": "64M"}, "network": "allow", "allow": asked})
            assert made.status_code == 201, (asked, made.text)
            assert http.delete(f"/v1/sandboxes/{made.json()['id']}").status_code == 204
        for body in ({"network": "allow", "allow": ["evil.test"]}, {"network": "allow", "allow": ["example.test"]},
                     {"network": "allow", "allow": ["203.0.113.7"]}, {"network": "allow", "allow": ["203.0.0.0/16:443"]},
                     {"network": "allow", "allow": ["api.example.test", "0.0.0.0/0"]}, {"network": "open"}):
            refused = http.post("/v1/sandboxes", json={"limits": {"memory": "64M"}, **body})
            assert refused.status_code == 400 and "corral serve --allow" in refused.json()["message"], (body, refused.text)
        assert http.get("/v1/sandboxes").json()["sandboxes"] == []
    with ServerProcess(state_dir / "srv-nonet", "--no-network", keys=KEYS) as srv, srv.client("alice") as http:
        refused = http.post("/v1/sandboxes", json={"network": "allow", "allow": ["example.com"]})
        assert refused.status_code == 400 and "none" in refused.json()["message"], refused.text
        made = http.post("/v1/sandboxes", json={"limits": {"memory": "64M"}})
        assert made.status_code == 201 and http.delete(f"/v1/sandboxes/{made.json()['id']}").status_code == 204
    for bad, said in ((["--allow", "not a host!"], "allow"), (["--allow", "x.test", "--no-network"], "allow"),
                      (["--port", "70000"], "port"), (["--port", "-1"], "port")):
        run = subprocess.run([CORRAL, "--state-dir", str(state_dir / "srv-badallow"), "serve", "--port", "0", *bad],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 125 and said in run.stderr, (bad, run.stderr)


def test_serve_on_port_0_listens_on_a_free_port_and_says_which(state_dir: Path) -> None:
    """`corral serve --port 0` said "0 picks a free one" and refused 0; now it binds one and prints it."""
    import re
    import signal
    import subprocess

    from .server_fixtures import CORRAL

    proc = subprocess.Popen([CORRAL, "--state-dir", str(state_dir / "srv-port0"), "serve", "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        found = re.search(r"serving on http://127\.0\.0\.1:(\d+) ", line)
        assert found and int(found.group(1)) > 0, line
        assert httpx.get(f"http://127.0.0.1:{found.group(1)}/healthz", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_egress_refusals_are_counted_after_each_command(server: ServerProcess) -> None:
    """The server counts each sandbox's refused destinations in /metrics after every command (it
    built the whole audit, up to 10,000 events, to count them: 79 ms of its CPU per command once a
    sandbox had filled it); the count reads the egress's own tally, dropped events included."""
    probe = ("python3 -c 'import socket\nfor i in range(3):\n"
             "    s = socket.create_connection((\"127.0.0.1\", 3128)); s.sendall(b\"CONNECT 192.0.2.1:%d HTTP/1.1\\r\\n\\r\\n\" % (i + 1))\n"
             "    print(s.recv(12).decode())'")
    with server.client("alice") as http:
        sid = create(http, network="allow", allow=["allowed.test"])
        try:
            before = metric(http.get("/metrics").text, "corral_egress_refused_total")
            r = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": probe}).json()
            assert r["stdout"].split() == ["HTTP/1.1", "403"] * 3, r
            assert metric(http.get("/metrics").text, "corral_egress_refused_total") == before + 3
            http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
            assert metric(http.get("/metrics").text, "corral_egress_refused_total") == before + 3
            events = http.get(f"/v1/sandboxes/{sid}/network/audit").json()["events"]
            assert [e["destination"] for e in events] == ["192.0.2.1:1", "192.0.2.1:2", "192.0.2.1:3"]
        finally:
            http.delete(f"/v1/sandboxes/{sid}")
