"""Server manners (issue 14): 429 and 503 say when to retry, and the remote client retries
idempotent calls on connection errors, 429 and 503 (never a POST), a bounded number of times."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import ConnectionLost, ResourceLimit, SandboxError
from corral.client import MAX_RETRY_WAIT, RETRIES, Client

from .server_fixtures import KEYS, ServerProcess, free_port


class Scripted(http.server.BaseHTTPRequestHandler):
    """Answers each request with the next status of ``script`` (then 200 {})."""

    script: list[int] = []
    seen: list[str] = []

    def _answer(self) -> None:
        self.seen.append(self.command)
        status = self.script.pop(0) if self.script else 200
        body = b"{}" if status == 200 else b'{"error": "resource_limit", "message": "later"}'
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        if status in (429, 503):
            self.send_header("retry-after", "0.1")
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[tuple[http.server.HTTPServer, str]]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Scripted.script, Scripted.seen = [], []
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_an_idempotent_call_is_retried_past_429_and_503(scripted: tuple[http.server.HTTPServer, str]) -> None:
    _, url = scripted
    Scripted.script = [503, 429]
    assert Client(url).request("GET", "/v1/sandboxes") == {}
    assert Scripted.seen == ["GET", "GET", "GET"]


def test_retries_are_bounded(scripted: tuple[http.server.HTTPServer, str]) -> None:
    _, url = scripted
    Scripted.script = [429] * (RETRIES + 5)
    with pytest.raises(ResourceLimit):
        Client(url).request("DELETE", "/v1/sandboxes/sb-x")
    assert len(Scripted.seen) == RETRIES + 1
    assert MAX_RETRY_WAIT <= 5


def test_a_post_is_never_repeated(scripted: tuple[http.server.HTTPServer, str]) -> None:
    _, url = scripted
    Scripted.script = [503]
    with pytest.raises(SandboxError):
        Client(url).request("POST", "/v1/sandboxes", json={})
    assert Scripted.seen == ["POST"]


def test_a_server_that_comes_up_meanwhile_is_reached() -> None:
    port = free_port()
    holder: dict[str, http.server.HTTPServer] = {}

    def start_late() -> None:
        time.sleep(0.3)
        holder["httpd"] = http.server.ThreadingHTTPServer(("127.0.0.1", port), Scripted)
        holder["httpd"].serve_forever()

    Scripted.script, Scripted.seen = [], []
    threading.Thread(target=start_late, daemon=True).start()
    try:
        assert Client(f"http://127.0.0.1:{port}").request("GET", "/healthz") == {}
    finally:
        while "httpd" not in holder:
            time.sleep(0.01)
        holder["httpd"].shutdown()
        holder["httpd"].server_close()
    with pytest.raises(ConnectionLost):
        Client(f"http://127.0.0.1:{free_port()}").request("GET", "/healthz")


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-manners", keys=KEYS, config={"max_sandboxes_per_tenant": 1}) as srv:
        yield srv


def test_the_servers_429_carries_retry_after(server: ServerProcess) -> None:
    with server.client("alice") as http:
        first = http.post("/v1/sandboxes", json={"limits": {"memory": "64M"}})
        assert first.status_code == 201, first.text
        try:
            refused = http.post("/v1/sandboxes", json={"limits": {"memory": "64M"}})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        finally:
            http.delete(f"/v1/sandboxes/{first.json()['id']}")


def test_code_takes_a_typed_body(server: ServerProcess) -> None:
    with server.client("alice") as http:
        sid = http.post("/v1/sandboxes", json={"limits": {"memory": "256M"}}).json()["id"]
        try:
            ran = http.post(f"/v1/sandboxes/{sid}/code", json={"code": "6 * 7"})
            assert ran.status_code == 200 and ran.json()["results"][0]["text"] == "42", ran.text
            for bad in ({"code": "1", "langauge": "python"}, {"cmd": "1"}, {"code": 5}):
                refused = http.post(f"/v1/sandboxes/{sid}/code", json=bad)
                assert refused.status_code in (400, 422) and refused.json()["error"] == "invalid_spec", refused.text
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


def test_stdin_b64_that_is_not_base64_is_a_typed_400(server: ServerProcess) -> None:
    with server.client("alice") as http:
        sid = http.post("/v1/sandboxes", json={"limits": {"memory": "64M"}}).json()["id"]
        try:
            ran = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat", "stdin_b64": "/w=="})
            assert ran.status_code == 200 and ran.json()["exit_code"] == 0, ran.text
            # not base64, and not even ASCII (b64decode refuses that before it looks: a 500 once)
            for bad in ("***", "\x80", "é"):
                refused = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat", "stdin_b64": bad})
                assert refused.status_code in (400, 422) and refused.json()["error"] == "invalid_spec", refused.text
        finally:
            http.delete(f"/v1/sandboxes/{sid}")
