"""What a request must be before the egress proxy puts a brokered secret's real value in it.

The targets run in this module's own network namespace (names start with ``creq``).  Each
attack was found against the proxy as it was: the real value went to another site named on
the bound host's address, heads the proxy and the server split differently let stripped fields
through, and a client that reset or spoke false TLS kept the upstream socket open.
"""

from __future__ import annotations

import base64
import datetime
import os
import ssl
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from corral import Sandbox
from corral.egress import tls
from egress_net import TargetNet, target_net

SECRET = "sk-live-req-0123456789abcdef-REAL"

#: a raw client in the sandbox: to the proxy (CONNECT first if asked), the request with TOKEN
#: replaced by the placeholder, then the answer's status line (or what went wrong)
RAW = r'''
import base64, os, socket, sys
request = base64.b64decode(sys.argv[1]).replace(b"TOKEN", os.environ["API_TOKEN"].encode())
s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
if len(sys.argv) > 2:
    s.sendall(b"CONNECT " + sys.argv[2].encode() + b" HTTP/1.1\r\nHost: " + sys.argv[2].encode() + b"\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = s.recv(4096)
        if not chunk:
            break
        answer += chunk
    if not answer.startswith(b"HTTP/1.1 200"):
        print("connect:", answer[:40]); sys.exit()
s.sendall(request)
answer = b""
try:
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        answer += chunk
except OSError as e:
    print("error", e)
print(answer.split(b"\r\n", 1)[0].decode() or "closed")
'''


@pytest.fixture(scope="module")
def net() -> Iterator[TargetNet]:
    with target_net(prefix="creq") as testnet:
        yield testnet


@pytest.fixture(scope="module")
def sb(net: TargetNet) -> Iterator[Sandbox]:
    with Sandbox.create(allow=["target.test", "other.test"], secrets=["API_TOKEN@target.test"],
                        unsafe_allow_ranges=[f"{net.target}/32", f"{net.other}/32"],
                        secret_values={"API_TOKEN": SECRET}) as sandbox:
        sandbox.files.write("/tmp/raw.py", RAW)
        yield sandbox


def raw(sb: Sandbox, request: bytes, tunnel: str | None = None) -> str:
    args = f"/tmp/raw.py {base64.b64encode(request).decode()}" + (f" {tunnel}" if tunnel else "")
    r = sb.commands.run(f"python3 {args}", timeout=30)
    assert r.exit_code == 0, r
    return r.stdout.strip()


def keys_seen(net: TargetNet, path: str) -> list[str | None]:
    return [h["headers"].get("X-Key") for h in net.hits() if h["path"] == path]


def test_a_real_value_goes_only_into_a_request_that_names_its_host(net: TargetNet, sb: Sandbox) -> None:
    placeholder = sb.network.env["API_TOKEN"]
    key = '-H "X-Key: $API_TOKEN"'
    # the allowed direction: plain HTTP, HTTPS (intercepted), raw with the port named
    for cmd in (f"curl -fsS {key} http://target.test:8080/ok-http",
                f"curl -fsS {key} https://target.test:8443/ok-https"):
        assert sb.commands.run(cmd, timeout=30).exit_code == 0
    assert raw(sb, b"GET /ok-tunnel HTTP/1.1\r\nHost: target.test:8080\r\nX-Key: TOKEN\r\n\r\n",
               "target.test:8080") == "HTTP/1.1 200 OK"
    for path in ("/ok-http", "/ok-https", "/ok-tunnel"):
        assert keys_seen(net, path) == [SECRET], path
    before = len([e for e in sb.network.audit() if e.kind == "secret-withheld"])

    # on the bound host's address, a request that names another site (a CDN's other tenant)
    for cmd, path in ((f'curl -sS {key} -H "Host: other.test" http://target.test:8080/h1', "/h1"),
                      (f'curl -sS {key} -H "Host: other.test:8080" http://target.test:8080/h2', "/h2"),
                      (f'curl -sS {key} -H "Host: other.test" https://target.test:8443/h3', "/h3"),
                      (f'curl -sS {key} -H "Host: target.test" http://target.test:8080/h4', "/h4")):  # port 80
        sb.commands.run(cmd, timeout=30)
        assert keys_seen(net, path) == [placeholder], cmd
    forms = {
        "/two-hosts": (b"GET http://target.test:8080/two-hosts HTTP/1.1\r\nHost: target.test:8080\r\n"
                       b"Host: other.test\r\nX-Key: TOKEN\r\n\r\n", None),
        "/abs-other": (b"GET http://other.test:8080/abs-other HTTP/1.1\r\nHost: target.test:8080\r\n"
                       b"X-Key: TOKEN\r\n\r\n", "target.test:8080"),
        "/userinfo": (b"GET /userinfo HTTP/1.1\r\nHost: target.test:8080@other.test\r\nX-Key: TOKEN\r\n\r\n",
                      "target.test:8080"),
        "/backslash": (b"GET /backslash HTTP/1.1\r\nHost: other.test\\@target.test:8080\r\nX-Key: TOKEN\r\n\r\n",
                       "target.test:8080"),
        "/no-host": (b"GET /no-host HTTP/1.0\r\nX-Key: TOKEN\r\n\r\n", "target.test:8080"),
    }
    for path, (request, tunnel) in forms.items():
        raw(sb, request, tunnel)
        assert SECRET not in keys_seen(net, path), path
    withheld = [e for e in sb.network.audit() if e.kind == "secret-withheld"][before:]
    assert len(withheld) >= 4 + len(forms) - 1, withheld  # (a server may refuse one before logging it)
    assert any("other.test" in e.rule for e in withheld), withheld


MALFORMED = {
    "bare LF": b"GET /{p} HTTP/1.1\r\nHost: target.test:8080\r\nX-Key: TOKEN\nRange: bytes=0-3\r\n\r\n",
    "folded": b"GET /{p} HTTP/1.1\r\nHost: target.test:8080\r\nX-Key: TOKEN\r\n Range: bytes=0-3\r\n\r\n",
    "space before colon": b"GET /{p} HTTP/1.1\r\nHost: target.test:8080\r\nRange : bytes=0-3\r\n\r\n",
    "NUL": b"GET /{p} HTTP/1.1\r\nHost: target.test:8080\r\nX-Key: TOKEN\0Range: bytes=0-3\r\n\r\n",
    "bare CR": b"GET /{p} HTTP/1.1\r\nHost: target.test:8080\r\nX-Key: TOKEN\rRange: bytes=0-3\r\n\r\n",
    # body lengths the server could read otherwise (the rest then a second request the proxy never saw)
    "two lengths": b"POST /{p} HTTP/1.1\r\nHost: target.test:8080\r\nContent-Length: 0\r\nContent-Length: 40\r\n\r\n",
    "length and chunked": (b"POST /{p} HTTP/1.1\r\nHost: target.test:8080\r\nContent-Length: 4\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    "chunked not last": b"POST /{p} HTTP/1.1\r\nHost: target.test:8080\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
}


@pytest.mark.parametrize("way", ["proxy", "tunnel"])
def test_a_head_the_server_could_split_differently_is_refused(net: TargetNet, sb: Sandbox, way: str) -> None:
    """Before, ``X-Key: v\\nRange: bytes=0-3`` was one field for the proxy (so ``Range`` was
    not stripped) and two for the server: a range could fetch an echoed value in pieces."""
    for name, template in MALFORMED.items():
        path = f"bad-{way}-{name.replace(' ', '-')}"
        request = template.replace(b"{p}", path.encode())
        if way == "proxy":
            request = request.replace(b"GET /", b"GET http://target.test:8080/", 1)
        assert raw(sb, request, "target.test:8080" if way == "tunnel" else None) == "HTTP/1.1 400 Bad Request", name
        assert not [h for h in net.hits() if h["path"] == "/" + path], name
    good = f"GET /good-{way} HTTP/1.1\r\nHost: target.test:8080\r\nX-Key: TOKEN\r\n\r\n".encode()
    if way == "proxy":
        good = good.replace(b"GET /", b"GET http://target.test:8080/", 1)
    assert raw(sb, good, "target.test:8080" if way == "tunnel" else None) == "HTTP/1.1 200 OK"
    assert keys_seen(net, f"/good-{way}") == [SECRET]
    assert any("malformed-request-head" in e.rule for e in sb.network.audit())


def test_an_absolute_url_with_a_port_out_of_range_is_refused_as_connect_refuses_it(net: TargetNet, sb: Sandbox) -> None:
    """``GET http://other.test:0/`` went to port 80 (a 502), ``:65536`` had its connection closed
    with no answer and no audit event; both are now 403 ``bad-port``, audited, as CONNECT's."""
    for port in ("0", "65536", "99999999"):
        request = f"GET http://other.test:{port}/p{port} HTTP/1.1\r\nHost: other.test\r\n\r\n".encode()
        assert raw(sb, request) == "HTTP/1.1 403 Forbidden", port
        assert any(e.rule == "bad-port" and e.destination == f"other.test:{port}" for e in sb.network.audit()), port
    assert raw(sb, b"GET http://other.test:8080/fine HTTP/1.1\r\nHost: other.test:8080\r\n\r\n") == "HTTP/1.1 200 OK"


def test_a_target_the_proxy_cannot_read_is_answered_400_and_audited(net: TargetNet, sb: Sandbox) -> None:
    """``CONNECT host:+8080``, a port of digits that are not ASCII (``²³``: ``isdigit()`` took
    them, ``int()`` did not), and a URL that is not http:// were closed with no answer (or a bare
    400) and no audit event."""
    for target, protocol in (("other.test:+8080", "http-connect"), ("other.test:\xb2\xb3", "http-connect"),
                             ("ftp://other.test/x", "http")):
        method = "CONNECT" if protocol == "http-connect" else "GET"
        request = f"{method} {target} HTTP/1.1\r\nHost: other.test\r\n\r\n".encode("latin-1")
        assert raw(sb, request) == "HTTP/1.1 400 Bad Request", target
        assert any(e.rule.startswith("malformed-request-target") and e.destination == target
                   and e.protocol == protocol for e in sb.network.audit()), target
    assert raw(sb, b"GET http://other.test:8080/readable HTTP/1.1\r\nHost: other.test:8080\r\n\r\n") == \
        "HTTP/1.1 200 OK"  # the allowed thing: a target it can read


def test_no_switch_to_a_protocol_the_guard_cannot_read_is_asked_of_a_bound_host(net: TargetNet, sb: Sandbox) -> None:
    """h2c's compressed headers and a WebSocket's compressed messages would carry an echo past
    the guard: towards a bound host ``Upgrade``, ``HTTP2-Settings`` and
    ``Sec-WebSocket-Extensions`` are dropped (the Connection field asking for a switch already
    was); towards another host they pass."""
    asks = '-H "Upgrade: h2c" -H "HTTP2-Settings: AAMAAABkAAQCAAAA" -H "Sec-WebSocket-Extensions: permessage-deflate"'
    for url in ("http://target.test:8080/up-bound", "http://other.test:8080/up-other"):
        assert sb.commands.run(f"curl -sS {asks} {url}", timeout=30).exit_code == 0
    bound = [h["headers"] for h in net.hits() if h["path"] == "/up-bound"]
    other = [h["headers"] for h in net.hits() if h["path"] == "/up-other"]
    assert bound and not {"Upgrade", "HTTP2-Settings", "Sec-WebSocket-Extensions"} & set(bound[0]), bound
    assert other and {"Upgrade", "HTTP2-Settings", "Sec-WebSocket-Extensions"} <= set(other[0]), other


BAD_CLIENTS = r'''
import socket, struct, sys
for i in range(int(sys.argv[1])):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(b"CONNECT target.test:8443 HTTP/1.1\r\nHost: target.test:8443\r\n\r\n")
    s.recv(4096)
    if i % 2:
        s.sendall(b"\x16\x03\x01\x00\x10" + b"not a client hello")  # a false TLS handshake
        s.recv(4096)
    else:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
    s.close()
print("done")
'''


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_client_that_resets_or_speaks_false_tls_leaves_no_upstream_open(net: TargetNet, sb: Sandbox) -> None:
    """The proxy runs in this (the owner's) process: 60 such clients once left ~30 upstream
    sockets open here, for the sandbox's life."""
    sb.files.write("/tmp/bad.py", BAD_CLIENTS)
    assert sb.commands.run("python3 /tmp/bad.py 4", timeout=60).stdout == "done\n"  # warm: threads, contexts
    time.sleep(0.5)
    before = _descriptors()
    assert sb.commands.run("python3 /tmp/bad.py 60", timeout=120).stdout == "done\n"
    deadline = time.monotonic() + 10
    while _descriptors() > before + 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _descriptors() <= before + 4, (before, _descriptors())
    # and the bound host is still served
    assert sb.commands.run('curl -fsS -H "X-Key: $API_TOKEN" https://target.test:8443/after-bad', timeout=30).exit_code == 0


def test_leaf_certificates_for_endless_names_stay_bounded(tmp_path: Path) -> None:
    """A ``*.domain`` binding under wildcard DNS: a context and two files per name, for ever
    (400 names: 143 MiB in the owner).  Now the most recent LEAF_CONTEXTS, and no files."""
    ca = tls.SandboxCA(tmp_path / "ca", "sb-test")
    contexts: list[Any] = [ca.server_context(f"n{i}.wild.test") for i in range(tls.LEAF_CONTEXTS + 40)]
    assert len(ca._contexts) == tls.LEAF_CONTEXTS
    assert list((tmp_path / "ca").iterdir()) == []
    assert ca.server_context(f"n{tls.LEAF_CONTEXTS + 39}.wild.test") is contexts[-1]  # recent: kept
    assert ca.server_context("n0.wild.test") is not contexts[0]  # dropped, made again


def _handshake(server: ssl.SSLContext, cafile: Path, host: str) -> None:
    """A TLS handshake, in memory, of a client that trusts ``cafile`` (as the sandbox does) and
    checks the name and dates, with ``server``; raises what the client would."""
    client = ssl.create_default_context(cafile=str(cafile))
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    ends = [client.wrap_bio(c_in, c_out, server_hostname=host), server.wrap_bio(s_in, s_out, server_side=True)]
    for _ in range(10):
        done = 0
        for end in ends:
            try:
                end.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if done == 2:
            return
    raise AssertionError("the handshake did not end")


def test_certificates_outlast_a_long_session(tmp_path: Path) -> None:
    """A sandbox lives up to 30 days with a lifetime (for ever without one) and trusts the CA it
    was given at its start: the CA stays valid for longer than that, and a leaf is minted afresh
    before it ends.  Both were valid for two days: after that, every HTTPS request of the
    sandbox to a host its secrets are bound to failed."""
    now = datetime.datetime.now(datetime.UTC)
    assert tls.SandboxCA(tmp_path / "ca-now", "sb-now").certificate.not_valid_after_utc - now > datetime.timedelta(days=365)
    clock = [now - datetime.timedelta(days=3)]
    ca = tls.SandboxCA(tmp_path / "ca", "sb-long", clock=lambda: clock[0])
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    first = ca.server_context("api.target.test")
    assert ca.server_context("api.target.test") is first  # the same within its first day
    clock[0] = now  # three days on, the sandbox still running
    renewed = ca.server_context("api.target.test")
    assert renewed is not first
    _handshake(renewed, tmp_path / "ca.crt", "api.target.test")  # the CA of three days ago, a fresh leaf
    # the denied direction: the leaf of three days ago has expired, and a client says so
    with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
        _handshake(first, tmp_path / "ca.crt", "api.target.test")
    with pytest.raises(ssl.SSLCertVerificationError, match=r"mismatch|match"):
        _handshake(renewed, tmp_path / "ca.crt", "other.target.test")


def test_one_echo_matcher_serves_every_name_of_a_wildcard_binding(tmp_path: Path) -> None:
    from corral.egress.audit import AuditLog
    from corral.egress.policy import Policy
    from corral.egress.proxy import EgressProxy
    from corral.secrets import SecretBinding, materialize

    secrets = materialize([SecretBinding.parse("W@*.wild.test")], {"W": "wild-secret-0123456789"})
    proxy = EgressProxy("sb-test", tmp_path / "proxy.sock", Policy([]), AuditLog(), secrets)
    try:
        first = proxy._matcher("a.wild.test")
        assert first is not None
        assert all(proxy._matcher(f"n{i}.wild.test") is first for i in range(200))
        assert proxy._matcher("other.test") is None and len(proxy._matchers) == 1
    finally:
        proxy.close()
