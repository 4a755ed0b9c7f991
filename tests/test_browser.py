"""Scenario 3: headless Chromium in a sandbox, driven from the host through an exposed port.

The ``browser`` image is built once into the persistent image store (like
``base`` and ``python-data``; a fresh machine spends ~45 s on it after
``base``) and reused.  Chromium runs as users first try it, ``chromium
--headless --no-sandbox``: the sandbox is the boundary (docs/browser.md).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from corral import Sandbox
from corral.images import recipe as recipes
from corral.images.build import build
from egress_net import METADATA, TargetNet, target_net
from leaks import processes_naming, sandbox_leftovers

PNG = b"\x89PNG\r\n\x1a\n"
PAGE = ("<html><head><title>corral page</title></head><body><h1 id=x>static</h1>"
        "<script>document.getElementById('x').textContent = 'js ran ' + (6 * 7)</script></body></html>")
BROWSER = {"image": "browser", "memory": "1G", "pids": 512}
CHROMIUM = "chromium --headless --no-sandbox --disable-gpu --disable-background-networking"


@pytest.fixture(scope="module")
def browser_image(state_dir: Path) -> str:
    build(recipes.load("browser"), state_dir)  # the store's copy when built before (milliseconds)
    return "browser"


def wait_for(check: object, what: str, timeout: float = 30.0) -> object:
    """Poll ``check()`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()  # type: ignore[operator]
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def http_get(url: str, timeout: float = 5.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data: bytes = response.read()
            return data
    except OSError:
        return None


def need_tier(tier: str) -> None:
    from corral.tiers import tier_class

    availability = tier_class(tier).probe(Path(os.environ["CORRAL_STATE_DIR"]))
    if not availability.available:
        pytest.skip(f"the {tier} tier is not available here: {availability.reason}")


@pytest.mark.parametrize("tier", ["process", "gvisor"])
def test_chromium_dump_dom_and_screenshot(browser_image: str, tier: str) -> None:
    need_tier(tier)
    with Sandbox.create(tier=tier, **BROWSER) as sb:
        sb.files.write("/tmp/page.html", PAGE)
        shm = sb.commands.run("df -B1 --output=size /dev/shm | tail -1; test -w /dev/shm")
        assert shm.exit_code == 0 and int(shm.stdout) <= sb.spec.limits.disk, shm  # on the disk tmpfs
        dom = sb.commands.run(f"{CHROMIUM} --dump-dom file:///tmp/page.html", timeout=120)
        assert dom.exit_code == 0 and '<h1 id="x">js ran 42</h1>' in dom.stdout, dom
        shot = sb.commands.run(f"cd /tmp && {CHROMIUM} --screenshot --window-size=640,480 file:///tmp/page.html",
                               timeout=120)
        assert shot.exit_code == 0, shot
        assert sb.files.read("/tmp/screenshot.png", format="bytes").startswith(PNG)
        # Chromium's own sandbox: refused in both tiers, our seccomp policy denying the namespaces it
        # needs (in gVisor too: a nested user namespace's capabilities reached the sandbox's own)
        own = sb.commands.run(CHROMIUM.replace(" --no-sandbox", "") + " --dump-dom file:///tmp/page.html",
                              timeout=120)
        assert own.exit_code != 0 and "No usable sandbox" in own.stderr, own


@pytest.mark.parametrize("tier", ["process", "gvisor", "microvm"])
def test_exposed_port_reaches_a_sandbox_with_no_network(state_dir: Path, tier: str) -> None:
    need_tier(tier)
    with Sandbox.create(tier=tier) as sb:  # network="none": loopback only, and it stays so
        server = sb.commands.start("cd /tmp && echo served > index.html && exec python3 -m http.server 8000 "
                                   "--bind 127.0.0.1", timeout=120)
        links = "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '; cat /proc/net/route"
        before = sb.commands.run(links).stdout
        tcp = sb.ports.expose(8000)
        unix = sb.ports.expose(8000, unix_socket=True)
        assert tcp.host == "127.0.0.1" and tcp.port > 0 and tcp.url == f"http://127.0.0.1:{tcp.port}/"
        assert wait_for(lambda: http_get(tcp.url + "index.html"), "the forwarded server") == b"served\n"
        assert unix.unix_socket is not None and (os.stat(unix.unix_socket).st_mode & 0o777) == 0o600
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(unix.unix_socket)
            client.sendall(b"GET /index.html HTTP/1.0\r\n\r\n")
            reply = b"".join(iter(lambda: client.recv(65536), b""))
        assert reply.startswith(b"HTTP/1.0 200") and reply.endswith(b"served\n")
        # the forward did not give the sandbox a network: still loopback only
        assert sb.commands.run(links).stdout == before
        if tier == "process":
            assert before.split()[0] == "lo" and "eth" not in before, before
        # denied both ways: a port nothing listens on gives a closed connection, not another one
        nothing = sb.ports.expose(8001)
        with socket.create_connection(("127.0.0.1", nothing.port), timeout=5) as client:
            client.settimeout(10)
            assert client.recv(1) == b""
        # a client holding a connection open across destroy (to a server that never closes it)
        sb.commands.start("python3 -c \"import socket, time; s = socket.create_server(('127.0.0.1', 8002)); "
                          "c = s.accept()[0]; c.sendall(b'hi'); time.sleep(600)\"", timeout=600)
        holder = sb.ports.expose(8002)
        held = wait_for(lambda: _connect_and_read(holder.port, b"hi"), "the holding server")
        server.kill()
    # destroyed: the held connection is cut, the listeners are gone, the Unix socket removed
    with held:  # type: ignore[attr-defined]
        held.settimeout(10)  # type: ignore[attr-defined]
        try:
            assert held.recv(65536) == b""  # type: ignore[attr-defined]
        except ConnectionResetError:
            pass
    for port in (tcp.port, nothing.port, holder.port):
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    assert not os.path.exists(unix.unix_socket)
    wait_for(lambda: not [t.name for t in threading.enumerate() if t.name.startswith("portfwd")],
             "the forwards' threads to end", 10)
    assert sandbox_leftovers(sb.id, state_dir) == []


#: in the sandbox: takes connections on port 8003, reads what comes, and never answers nor closes
DEAF_SERVER = """
import socket
server, held = socket.create_server(("127.0.0.1", 8003)), []
while True:
    conn = server.accept()[0]
    conn.recv(100)
    held.append(conn)
"""


def test_a_unix_forwards_relay_ends_with_its_client_and_a_half_closed_client_is_answered(state_dir: Path) -> None:
    """A forward's relay of a connection whose client had gone waited for the sandbox's side to
    answer or close: a sandbox server that did neither held two of the owner's threads and two
    sockets per finished connection for the forward's life (the server's port proxy makes one a
    request: 1,000 requests held 2,039 threads).  Now a Unix socket's relay ends once its client
    has closed; one that only half-closed (``shutdown(SHUT_WR)``) still gets its answer."""
    with Sandbox.create() as sb:
        sb.commands.start("cd /tmp && echo served > index.html && exec python3 -m http.server 8000 "
                          "--bind 127.0.0.1", timeout=120)
        sb.files.write("/tmp/deaf.py", DEAF_SERVER)
        sb.commands.start("python3 /tmp/deaf.py", timeout=120)
        web, deaf = sb.ports.expose(8000, unix_socket=True), sb.ports.expose(8003, unix_socket=True)
        assert web.unix_socket is not None and deaf.unix_socket is not None

        def half_closed_get() -> bytes | None:
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(str(web.unix_socket))
                client.sendall(b"GET /index.html HTTP/1.0\r\n\r\n")
                client.shutdown(socket.SHUT_WR)
                try:
                    reply = b"".join(iter(lambda: client.recv(65536), b""))
                except ConnectionResetError:  # (the server is not listening yet)
                    return None
            return reply if reply.endswith(b"served\n") else None

        assert wait_for(half_closed_get, "the forwarded server, asked by a half-closed client")

        def relays() -> list[str]:
            return [t.name for t in threading.enumerate() if t.name.startswith("portfwd-8003-")]

        def deaf_connection() -> None:
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(str(deaf.unix_socket))
                client.sendall(b"GET / HTTP/1.0\r\n\r\n")
                time.sleep(0.2)  # (relayed to the sandbox's server before the client goes)

        listening = "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8003), 1)\""
        wait_for(lambda: sb.commands.run(listening).exit_code == 0, "the deaf server")
        for _ in range(8):
            deaf_connection()
        wait_for(lambda: not relays(), "the relays of connections whose clients have gone to end", 10)
        # the allowed direction again, after them
        assert wait_for(half_closed_get, "the forwarded server, once more")


def _refused_connections_as(uid: int, port: int, count: int) -> int:
    """How many of ``count`` connections to 127.0.0.1:``port`` made one after another by a client
    running as ``uid`` were accepted and then closed without a byte; -1 if one could not connect."""
    from server_fixtures import as_user

    def connect() -> bytes:
        closed = 0
        for _ in range(count):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                try:
                    sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
                    closed += sock.recv(1) == b""
                except ConnectionResetError:  # closed with our request unread
                    closed += 1
        return str(closed).encode()

    return int(as_user(uid, connect) or -1)


def test_a_tcp_forward_relays_its_own_user_and_root_and_the_users_named_only(state_dir: Path) -> None:
    """Loopback TCP is every local user's: a forward (a browser's DevTools endpoint, often) relays
    only connections made by its process's user and root, and by ``local_users``; another user's
    connection is closed before anything reaches the sandbox (its server logs no request). Before:
    uid 65534 read the sandbox's server through any forward."""
    import subprocess

    from corral.errors import InvalidSpec
    from corral.host.portfwd import MAX_CONNECTIONS
    from server_fixtures import reply_as_user

    nobody = 65534
    request = b"GET /index.html HTTP/1.0\r\n\r\n"
    with Sandbox.create() as sb:
        sb.commands.start("cd /tmp && echo served > index.html && exec python3 -m http.server 8000 "
                          "--bind 127.0.0.1 2>/tmp/requests.log", timeout=120)
        own = sb.ports.expose(8000)
        shared = sb.ports.expose(8000, local_users=["nobody"])
        by_uid = sb.ports.expose(8000, local_users=[str(nobody)])
        assert wait_for(lambda: http_get(own.url + "index.html"), "the forwarded server") == b"served\n"
        assert http_get(shared.url + "index.html") == b"served\n"  # root is let in wherever others are
        served = sb.commands.run("grep -c 'GET /index.html' /tmp/requests.log").stdout

        # each attempt cut (accepted, then closed: no request reaches the sandbox's server), more
        # of them than a forward relays connections at once (MAX_CONNECTIONS): none keeps a slot
        assert _refused_connections_as(nobody, own.port, MAX_CONNECTIONS + 10) == MAX_CONNECTIONS + 10
        assert sb.commands.run("grep -c 'GET /index.html' /tmp/requests.log").stdout == served
        for forward in (shared, by_uid):  # the named user is let in, by name or by uid
            assert reply_as_user(nobody, forward.port, request, whole=True).endswith(b"served\n")
        assert _refused_connections_as(1000, shared.port, 1) == 1  # only the user named
        assert http_get(own.url + "index.html") == b"served\n"  # the owner still is, after refusals
        # later in the session, after a command timed out and a background one was killed: the same
        assert sb.commands.run("sleep 30", timeout=0.5).timed_out
        sb.commands.start("sleep 60").kill()
        assert _refused_connections_as(nobody, own.port, 3) == 3
        assert http_get(own.url + "index.html") == b"served\n"

        for bad, why in (({"local_users": ["no-such-user-corral"]}, "not a user of this host"),
                         ({"local_users": "nobody"}, "must be a list"),
                         ({"local_users": [-1]}, "not a user of this host"),
                         ({"local_users": ["nobody"], "unix_socket": True}, "Unix socket")):
            with pytest.raises(InvalidSpec, match=why):
                sb.ports.expose(8000, **bad)  # type: ignore[arg-type]
        assert len(sb.ports.list()) == 3
        # through the sandbox's owner (another process driving it by id): the names reach the owner
        script = ("import sys; from corral import Sandbox\n"
                  "print(Sandbox.connect(sys.argv[1]).ports.expose(8000, local_users=['nobody']).port)\n")
        out = subprocess.run([sys.executable, "-c", script, sb.id], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert reply_as_user(nobody, int(out.stdout), request, whole=True).endswith(b"served\n")
        assert _refused_connections_as(1000, int(out.stdout), 1) == 1


def test_forwards_closed_in_a_long_lived_sandbox_are_let_go(state_dir: Path) -> None:
    """2000 forwards exposed and closed one after another in one sandbox: none is kept once closed
    (before: the sandbox held every one it ever made, ~4 KB each: 10000 grew the caller by 43 MiB),
    and a forward left open throughout still answers on its own Unix socket (the closed ones' sockets
    never took its name)."""
    import gc

    from corral.host.portfwd import PortForward

    def forwards_alive() -> int:
        gc.collect()
        return sum(isinstance(o, PortForward) for o in gc.get_objects())

    with Sandbox.create() as sb:
        sb.commands.start("cd /tmp && echo kept > index.html && exec python3 -m http.server 8000 --bind 127.0.0.1",
                          timeout=120)
        first = sb.ports.expose(8000)  # the kept forward is not the first, and the first goes
        kept = sb.ports.expose(8000, unix_socket=True)
        sb.ports.close(first)
        before = forwards_alive()
        descriptors = len(os.listdir("/proc/self/fd"))
        for i in range(2000):
            sb.ports.close(sb.ports.expose(8000, unix_socket=i % 2 == 0))
        assert forwards_alive() - before <= 1, f"{forwards_alive() - before} closed forwards still held"
        # each TCP forward's listener and its netlink socket for asking who connects are closed with it
        assert len(os.listdir("/proc/self/fd")) - descriptors <= 2
        assert kept.unix_socket is not None and os.path.exists(kept.unix_socket)

        def get_kept() -> bytes | None:
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(str(kept.unix_socket))
                client.sendall(b"GET /index.html HTTP/1.0\r\n\r\n")
                reply = b"".join(iter(lambda: client.recv(65536), b""))
            return reply if reply.endswith(b"kept\n") else None

        assert wait_for(get_kept, "the forward left open")


def _connect_and_read(port: int, expected: bytes) -> socket.socket | None:
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    client.settimeout(5)
    try:
        if client.recv(len(expected)) == expected:
            return client
    except OSError:
        pass
    client.close()
    return None


class Cdp:
    """A minimal DevTools protocol client over one WebSocket (the ``websockets`` sync client)."""

    def __init__(self, url: str) -> None:
        from websockets.sync.client import connect

        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(connect(url, max_size=64 << 20, open_timeout=10))
        self.next_id = 0

    def call(self, method: str, session: str | None = None, **params: object) -> dict[str, object]:
        self.next_id += 1
        message: dict[str, object] = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        self.ws.send(json.dumps(message))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == self.next_id:
                assert "error" not in reply, reply
                result: dict[str, object] = reply["result"]
                return result
        raise AssertionError(f"no answer to {method}")

    def close(self) -> None:
        self._stack.close()


def start_chromium(sb: Sandbox, marker: str, url: str = "about:blank") -> tuple[object, str]:
    """Chromium with its DevTools endpoint on the sandbox's loopback port 9222, exposed; returns
    (command handle, the exposed base URL)."""
    handle = sb.commands.start(f"{CHROMIUM} --remote-debugging-port=9222 --user-data-dir=/tmp/{marker} {url}",
                               timeout=600)
    exposed = sb.ports.expose(9222)
    version = wait_for(lambda: http_get(exposed.url + "json/version"), "Chromium's DevTools endpoint", 60)
    assert b"webSocketDebuggerUrl" in version  # type: ignore[operator]
    return handle, exposed.url


def open_page(cdp: Cdp, url: str) -> str:
    target = cdp.call("Target.createTarget", url="about:blank")["targetId"]
    session = str(cdp.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"])
    cdp.call("Page.enable", session)
    cdp.call("Page.navigate", session, url=url)
    return session


def evaluate(cdp: Cdp, session: str, expression: str) -> object:
    result = cdp.call("Runtime.evaluate", session, expression=expression, returnByValue=True)
    return result["result"]["value"]  # type: ignore[index]


# the process tier only: Chromium under gVisor is held by the two other Chromium tests, and
# gVisor's exposed ports by test_exposed_port_reaches_a_sandbox_with_no_network (10 s saved)
@pytest.mark.parametrize("tier", ["process"])
def test_chromium_driven_over_cdp_through_an_exposed_port(browser_image: str, tier: str) -> None:
    need_tier(tier)
    with Sandbox.create(tier=tier, **BROWSER) as sb:
        sb.files.write("/tmp/page.html", PAGE)
        _, base = start_chromium(sb, "cdp-profile")
        version = json.loads(http_get(base + "json/version") or b"{}")
        # Chromium names the WebSocket after the Host it was asked by: the forwarded address
        assert version["webSocketDebuggerUrl"].startswith(base.replace("http://", "ws://")), version
        cdp = Cdp(version["webSocketDebuggerUrl"])
        try:
            session = open_page(cdp, "file:///tmp/page.html")
            wait_for(lambda: evaluate(cdp, session, "document.readyState") == "complete", "the page to load")
            assert evaluate(cdp, session, "document.title") == "corral page"
            html = evaluate(cdp, session, "document.documentElement.outerHTML")
            assert '<h1 id="x">js ran 42</h1>' in str(html)
            shot = cdp.call("Page.captureScreenshot", session, format="png")
            assert base64.b64decode(str(shot["data"])).startswith(PNG)
        finally:
            cdp.close()


HOSTILE = """<html><head><title>hostile</title></head><body><p id=status>loading</p><script>
const targets = {targets};
const tries = targets.map(url => fetch(url, {{mode: 'no-cors', cache: 'no-store'}})
  .then(() => 'answered', e => 'failed'));
tries.push(new Promise(done => {{ const img = new Image(); img.onload = img.onerror = () => done('img');
  img.src = targets[0] + 'img'; }}));
tries.push(new Promise(done => {{ const f = document.createElement('iframe');
  f.onload = () => done('iframe'); f.src = {redirect}; document.body.appendChild(f); }}));
tries.push(fetch('file://{secret}').then(r => r.text(), e => 'no file'));
Promise.all(tries).then(results => {{
  document.getElementById('status').textContent = 'rendered';
  const leaked = results.some(r => String(r).includes('{token}')) ? 'LEAKED' : 'clean';
  return fetch('/report?' + leaked + '&n=' + results.length);
}});
</script></body></html>"""


@pytest.fixture
def hostile_net() -> Iterator[TargetNet]:
    with target_net(prefix="cbp") as net:
        yield net


@pytest.mark.parametrize("tier", ["process", "gvisor"])
def test_hostile_page_reaches_only_the_allowed_site(browser_image: str, hostile_net: TargetNet,
                                                    tmp_path: Path, state_dir: Path, tier: str) -> None:
    need_tier(tier)
    net = hostile_net
    port = net.metadata_port
    token = "corral-login-data-" + os.urandom(6).hex()
    # a host file standing for the browser's password store, in a home the sandbox must not see
    login_data = tmp_path / "home/.config/chromium/Default/Login Data"
    login_data.parent.mkdir(parents=True)
    login_data.write_text(token)
    targets = [f"http://{METADATA}:{port}/", f"http://metadata.test:{port}/name", f"http://2852039166:{port}/dec",
               f"http://0xa9fea9fe:{port}/hex", f"http://0251.0376.0251.0376:{port}/oct",
               f"http://[::ffff:169.254.169.254]:{port}/v6", f"http://{net.other}:8080/rfc1918",
               "http://other.test:8080/rfc1918-name", f"http://{net.host_side}:{net.loopback_port}/host",
               f"http://127.0.0.1:{net.loopback_port}/loopback", f"http://loop.test:{net.loopback_port}/loop-name"]
    redirect = f"'/redirect?to=http://{METADATA}:{port}/redirected'"
    html = net.tmp / "html"
    html.mkdir()
    (html / "hostile.html").write_text(HOSTILE.format(targets=json.dumps(targets), redirect=redirect,
                                                      secret=login_data, token=token))
    # control: from the host, without the proxy, the forbidden targets answer
    for url in (f"http://{METADATA}:{port}/control", f"http://{net.other}:8080/control",
                f"http://127.0.0.1:{net.loopback_port}/control"):
        assert http_get(url) is not None, url
    before = len(net.hits("metadata")), len(net.hits("other")), len(net.loopback_hits)
    allow = ["target.test"]
    with Sandbox.create(tier=tier, allow=allow, unsafe_allow_ranges=[f"{net.target}/32"], **BROWSER) as sb:
        marker = "hostile-" + sb.id
        _, base = start_chromium(sb, marker)
        inside = sb.commands.run("grep -l chromium /proc/[0-9]*/comm | wc -l")
        assert int(inside.stdout) >= 2, inside  # the browser and its helpers
        if tier == "process":  # gVisor's are the Sentry's tasks, not host processes
            assert processes_naming(marker), "Chromium is a host process of the sandbox"
        version = json.loads(http_get(base + "json/version") or b"{}")
        cdp = Cdp(version["webSocketDebuggerUrl"])
        try:
            session = open_page(cdp, "http://target.test:8080/html/hostile.html")
            report = wait_for(lambda: [h for h in net.hits("target") if h["path"].startswith("/report")],
                              "the page's report", 60)
            assert evaluate(cdp, session, "document.getElementById('status').textContent") == "rendered"
            for secret_url in (f"file://{login_data}", "file:///root/.config/chromium/Default/Login%20Data"):
                session = open_page(cdp, secret_url)
                wait_for(lambda s=session: evaluate(cdp, s, "document.readyState") == "complete", "the file page")
                assert token not in str(evaluate(cdp, session, "document.documentElement.outerHTML"))
        finally:
            cdp.close()
        assert report[0]["path"].startswith("/report?clean&n=14"), report  # type: ignore[index]
        shell = sb.commands.run(f"cat '{login_data}' /root/.config/chromium/Default/'Login Data'; "
                                f"grep -rs {token} /tmp /home /root /workspace; true")
        assert token not in shell.stdout + shell.stderr and "No such file" in shell.stderr, shell
        refused = {e.destination for e in sb.network.audit() if e.kind == "refused"}
        # each forbidden kind was tried and refused, with an audit event: by the proxy, except link-local
        # addresses, which Chromium never sends to a proxy (an implicit bypass rule, like loopback's):
        # those direct attempts are refused by the sandbox's network, audited where the host owns it
        assert {f"{net.other}:8080", f"{net.host_side}:{net.loopback_port}"} <= refused, refused
        if tier == "process":
            assert f"{METADATA}:{port}" in refused, refused  # the allow namespace's nft rule
        assert any(h["path"].startswith("/redirect?to=") for h in net.hits("target"))
    # not one connection reached a forbidden target; no Chromium process outlived the sandbox
    assert (len(net.hits("metadata")), len(net.hits("other")), len(net.loopback_hits)) == before
    assert processes_naming(marker) == [] and processes_naming(sb.id) == []
    assert sandbox_leftovers(sb.id, state_dir) == []


def test_cli_run_expose_prints_the_address() -> None:
    import subprocess

    # it serves until asked for /bye (it served two requests: once, in a full run, root's found it gone)
    server = ("import http.server as h\n"
              "done = []\n"
              "class H(h.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(b'from the cli')\n"
              "        done.append(self.path == '/bye')\n"
              "s = h.HTTPServer(('127.0.0.1', 8000), H)\n"
              "while not any(done): s.handle_request()\n")
    from server_fixtures import reply_as_user

    corral = str(Path(sys.executable).with_name("corral"))
    for bad, said in ((["--expose-to", "nobody"], "give --expose PORT too"),
                      (["--expose", "8000", "--expose-to", "no-such-user-corral"], "--expose-to: 'no-such-user")):
        refused = subprocess.run([corral, "run", *bad, "--", "true"], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 125 and said in refused.stderr, refused
    proc = subprocess.Popen([corral, "run", "--expose", "8000", "--expose-to", "nobody", "--timeout", "60", "--",
                             "python3", "-c", server], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith("corral: port 8000 exposed at 127.0.0.1:"), line
        url = line.rsplit("(", 1)[1].rstrip(")\n")
        port = int(url.rsplit(":", 1)[1].strip("/"))
        # the user named reaches it, another is cut, root too reaches it (the server answers two requests)
        reply = wait_for(lambda: reply_as_user(65534, port, b"GET / HTTP/1.0\r\n\r\n", whole=True), "the server")
        assert reply.endswith(b"from the cli"), reply  # type: ignore[union-attr]
        assert _refused_connections_as(1000, port, 1) == 1
        assert http_get(url, timeout=30) == b"from the cli"
        assert http_get(url + "bye", timeout=30) == b"from the cli"
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()


def test_forwards_of_a_killed_owner_are_reaped(state_dir: Path) -> None:
    import signal
    import subprocess

    from leaks import run_gc

    script = ("from corral import Sandbox; import sys, time\n"
              "sb = Sandbox.create()\n"
              "tcp, unix = sb.ports.expose(8000), sb.ports.expose(8000, unix_socket=True)\n"
              "print(sb.id, tcp.port, unix.unix_socket, flush=True)\n"
              "time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        sandbox_id, port, unix_socket = owner.stdout.readline().split()
        assert os.path.exists(unix_socket)
        socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", int(port)), timeout=5):
        pass  # the listener died with its owner
    run_gc(sandbox_id)
    assert not os.path.exists(unix_socket)  # with the run directory
    assert sandbox_leftovers(sandbox_id, state_dir) == []
