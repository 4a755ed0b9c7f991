"""The egress proxy: HTTP (absolute-form and CONNECT) and SOCKS5 on one Unix socket.

One proxy serves one sandbox; its socket is bind-mounted into the sandbox, where
a relay on the sandbox's loopback forwards to it (the sandbox has no network
interface at all).  Every connection is decided by :class:`~.policy.Policy`:
the name is resolved once and the proxy connects to the checked address, never
to the name.  Refusals become audit events.

Threads, not asyncio: each tunnel is two ``os.splice`` loops that copy in the
kernel without holding the GIL, which is what keeps bulk transfers fast.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..host.conntrack import nat_destination
from ..host.sockets import close_listener
from ..secrets import Secret
from .audit import AuditLog
from .client_wire import (
    HANDSHAKE_TIMEOUT,
    SOCKS_BAD_ATYP,
    SOCKS_BAD_CMD,
    SOCKS_NOT_ALLOWED,
    SOCKS_OK,
    SOCKS_UNREACHABLE,
    HandshakeTooSlow,
    ProxyError,
    read_head,
    recv_exact,
    send_refusal,
    socks_reply,
    split_host_port,
)
from .echo_forms import EchoMatcher, Form
from .echo_guard import ResponseGuard, copy_guarded
from .policy import Decision, Policy
from .request_head import (
    MalformedHead,
    RequestHead,
    body_framing_problem,
    parse_head,
    request_authority,
    same_host,
)
from .tunnel import (
    BULK_SEND,
    BULK_TUNNELS,
    BULK_WINDOW,
    MAX_CONNECTIONS,
    OWNER_TUNNELS,
    PIPE_SIZE,
    RATE_RULE,
    SMALL_PIPE,
    SMALL_SEND,
    SMALL_WINDOW,
    WORKERS,
    ConnectionRate,
    pump,
)
from .upstream_guard import ensure_loaded, guarded_socket

if TYPE_CHECKING:
    from .tls import SandboxCA  # cryptography costs ~0.1 s to import: only when secrets need it

CONNECT_TIMEOUT = 10.0

_HOP_HEADERS = {b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive"}
# Towards a secret-bound host: an encoded response is decoded to be scanned anyway, but asking
# for identity spares that work, and a range could fetch an echoed value in pieces too short to see
_BOUND_DROPPED = {b"accept-encoding", b"te", b"range", b"if-range",
                  # and no switch to a protocol the echo guard cannot read (h2c's compressed headers,
                  # a WebSocket's compressed messages): the Connection field that asks for it is
                  # replaced anyway, but a lax server might switch on Upgrade alone
                  b"upgrade", b"http2-settings", b"sec-websocket-extensions"}


class DeliveryRefused(Exception):
    """The host's NAT took a connection the policy allowed to an address it refuses."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.rule)
        self.decision = decision


class EgressProxy:
    def __init__(self, sandbox_id: str, socket_path: Path, policy: Policy, audit: AuditLog,
                 secrets: Sequence[Secret] = (), ca: SandboxCA | None = None,
                 upstream_tls: ssl.SSLContext | None = None, socket_uid: int | None = None,
                 socket_gid: int | None = None) -> None:
        self.sandbox_id = sandbox_id
        self.socket_path = socket_path
        self.policy = policy
        self.audit = audit
        #: whether the kernel checks its connections again after the host's NAT and routing
        #: (upstream_guard); an operator's re-enabled ranges are the proxy's own checks alone
        self._guarded = not policy.unsafe_ranges and ensure_loaded()
        self.secrets = tuple(secrets)
        self.ca = ca
        self.upstream_tls = upstream_tls
        self._lock = threading.Lock()
        self._matchers: dict[tuple[str, ...], EchoMatcher] = {}
        self._open: set[socket.socket] = set()
        self._clients = 0
        self._bulk: set[socket.socket] = set()  # upstream sockets holding one of BULK_TUNNELS
        self._closed = False
        self._stopping = threading.Event()  # set by close(): the accept loop's waits end
        #: new connections this sandbox may open (CONNECTION_RATE): taken before each accept
        self.rate = ConnectionRate()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._listener.bind(str(socket_path))
        if socket_uid is not None:
            os.chown(socket_path, socket_uid, socket_uid if socket_gid is None else socket_gid)
        # a group only when the connecting host process is not the owner (gVisor's gofer): never "other"
        os.chmod(socket_path, 0o600 if socket_gid is None else 0o660)
        self._listener.listen(256)
        self._thread = threading.Thread(target=self._accept_loop, name=f"egress-{sandbox_id}", daemon=True)
        OWNER_TUNNELS.joined(sandbox_id)
        self._thread.start()

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._open)
        self._stopping.set()
        OWNER_TUNNELS.left(self.sandbox_id)
        close_listener(self._listener, live, self._thread)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def _track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            if self._closed:
                sock.close()
                raise ProxyError("proxy closed")
            self._open.add(sock)
        return sock

    def _untrack(self, *socks: socket.socket) -> None:
        for sock in socks:
            with self._lock:
                self._open.discard(sock)
                self._bulk.discard(sock)
            sock.close()

    def _size(self, upstream: socket.socket) -> None:
        """Bound what ``upstream`` may queue (see BULK_TUNNELS): before any data arrives."""
        with self._lock:
            bulk = len(self._bulk) < BULK_TUNNELS
            if bulk:
                self._bulk.add(upstream)
        # fixed sizes (no autotuning: it moves the window clamp too), set before the connection
        # is made so that the window scale it agrees on fits the window
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BULK_WINDOW if bulk else SMALL_WINDOW)
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BULK_SEND if bulk else SMALL_SEND)

    def _pump(self, client: socket.socket, upstream: socket.socket, early: bytes) -> None:
        with self._lock:
            pipe_size = PIPE_SIZE if upstream in self._bulk else SMALL_PIPE
        pump(client, upstream, early, pipe_size)

    def _accept_loop(self) -> None:
        while True:
            wait = self.rate.take()
            if wait:
                # over the rate: accept nothing for now.  What the sandbox opens meanwhile waits
                # in the listening socket's queue (its connect() waits once that is full), at no
                # cost to the owner; a thread sleeping per connection, or a refusal, would cost it
                if self._stopping.wait(wait):
                    return
                continue
            held = self.rate.settle()  # seconds this loop did not accept, since its last accept
            if held and _pending(self._listener):  # a connection waited for it
                self.audit.tally(self.sandbox_id, "rate-limited", RATE_RULE, "proxy", held)
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and not self._closed:
                    time.sleep(0.05)  # out of descriptors for now: this sandbox's egress must not end
                    continue
                return
            refused = None
            with self._lock:
                if self._clients >= MAX_CONNECTIONS:
                    refused = "too-many-connections"
                elif not OWNER_TUNNELS.take(self.sandbox_id):
                    refused = "host-connection-limit"
                else:
                    self._clients += 1
            if refused is not None:
                self.audit.record(self.sandbox_id, "refused", "*", None, refused, "proxy")
                conn.close()
                continue
            try:
                self._track(conn)
            except ProxyError:
                self._client_gone()
                return
            WORKERS.submit(self._serve, conn)

    def _client_gone(self) -> None:
        with self._lock:
            self._clients -= 1
        OWNER_TUNNELS.give(self.sandbox_id)

    # -- one client connection ----------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        # every socket opened for this client (upstream, TLS on either side) is closed here,
        # however the exchange ended: a reset or a false TLS handshake once left the upstream
        # open for the sandbox's life (it was only known once the exchange returned)
        opened: list[socket.socket] = []
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT)
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT
            first = conn.recv(1, socket.MSG_PEEK)
            if not first:
                return
            if first == b"\x05":
                self._socks5(conn, opened, deadline)
            else:
                self._http(conn, opened, deadline)
        except HandshakeTooSlow as exc:
            self.audit.record(self.sandbox_id, "refused", "*", None, f"handshake-too-slow: {exc}",
                              "socks5" if first == b"\x05" else "http")
        except (OSError, ProxyError, ssl.SSLError, ValueError):
            pass
        finally:
            self._untrack(conn, *reversed(opened))
            self._client_gone()

    def _refuse_audit(self, decision: Decision, asked: str, protocol: str) -> None:
        self.audit.record(self.sandbox_id, "refused", asked, decision.address, decision.rule, protocol)

    def _connect(self, decision: Decision, opened: list[socket.socket]) -> socket.socket:
        """A connection to ``decision``'s address, or :class:`DeliveryRefused` when the host's NAT
        took it to an address the policy refuses (nothing is sent on it then)."""
        assert decision.address is not None
        family = socket.AF_INET6 if ":" in decision.address else socket.AF_INET
        made = guarded_socket(family) if self._guarded else socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock = self._track(made)
        opened.append(sock)
        sock.settimeout(CONNECT_TIMEOUT)
        try:
            self._size(sock)
            sock.connect((decision.address, decision.port))
            real = nat_destination(sock)
        except OSError:
            self._untrack(sock)
            raise
        refused = self.policy.refused_by(ipaddress.ip_address(real)) if real is not None else None
        if refused is not None:
            self._untrack(sock)
            raise DeliveryRefused(Decision(False, decision.host, decision.port, real, f"{refused} via-host-nat"))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    # -- HTTP ------------------------------------------------------------------
    def _parsed(self, client: socket.socket, head: bytes, protocol: str) -> RequestHead | None:
        """``head`` parsed strictly, or None once the client was answered 400 (and it audited)."""
        try:
            parsed = parse_head(head)
            framing = body_framing_problem(parsed)
            if framing is not None:
                raise MalformedHead(framing)
            return parsed
        except MalformedHead as exc:
            self._refuse_malformed(client, "*", f"malformed-request-head: {exc}", protocol)
            return None

    def _refuse_malformed(self, client: socket.socket, asked: str, rule: str, protocol: str) -> None:
        """A request the proxy cannot read (its head, its target): audited, and answered 400."""
        self.audit.record(self.sandbox_id, "refused", asked, None, rule, protocol)
        client.sendall(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")

    def _refuse_target(self, client: socket.socket, target: str, why: str, protocol: str) -> None:
        """A request target the proxy cannot read (a bad port, not an http:// URL)."""
        self._refuse_malformed(client, target[:256], f"malformed-request-target: {why[:200]}", protocol)

    def _http(self, conn: socket.socket, opened: list[socket.socket], deadline: float) -> None:
        raw_head, rest = read_head(conn, deadline)
        head = self._parsed(conn, raw_head, "http")
        if head is None:
            return
        method, target = head.method.decode("latin-1"), head.target.decode("latin-1")
        if method == "CONNECT":
            try:
                host, port = split_host_port(target, None)
            except ProxyError as exc:  # closed with no word and no event before
                self._refuse_target(conn, target, str(exc), "http-connect")
                return
            decision = self.policy.decide(host, port)
            if not decision.allowed:
                self._refuse_audit(decision, target, "http-connect")
                send_refusal(conn, decision)
                return
            upstream = self._connect_or_502(conn, decision, opened, "http-connect")
            if upstream is None:
                return
            conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            bound = [s for s in self.secrets if s.binding.bound_to(decision.host)]
            if bound and self.ca is not None:
                self._intercept(conn, upstream, decision, rest, opened)
            else:
                self._pump(conn, upstream, rest)
            return
        url = urlsplit(target)
        if url.scheme != "http" or not url.hostname:
            self._refuse_target(conn, target, "not an http:// URL", "http")
            return
        try:
            port = 80 if url.port is None else url.port
        except ValueError:  # past 65535, or not a number: refused as CONNECT refuses it
            port = -1
        decision = self.policy.decide(url.hostname, port)
        if not decision.allowed:
            asked = f"{url.hostname}:{port}" if port >= 0 else url.netloc.rpartition("@")[2]  # (as it was asked)
            self._refuse_audit(decision, asked, "http")
            send_refusal(conn, decision)
            return
        upstream = self._connect_or_502(conn, decision, opened, "http")
        if upstream is None:
            return
        path = url.path or "/"
        if url.query:
            path += "?" + url.query
        new_head = self._rewrite_head(head.method + b" " + path.encode("latin-1") + b" " + head.version,
                                      head, decision, 80, "http")
        upstream.sendall(new_head + rest)
        guard = self._response_guard(decision, method, head.version, "http")
        if guard is None:
            self._pump(conn, upstream, b"")  # no secret bound: spliced, never scanned
        else:
            copy_guarded(conn, upstream, guard, self._cut_audit(decision, "http"))

    def _matcher(self, host: str) -> EchoMatcher | None:
        bound = [s for s in self.secrets if s.binding.bound_to(host)]
        if not bound:
            return None
        # one per set of secrets, not per host: a ``*.domain`` binding names hosts without end
        key = tuple(secret.name for secret in bound)
        with self._lock:
            matcher = self._matchers.get(key)
            if matcher is None:
                matcher = self._matchers[key] = EchoMatcher(bound)
        return matcher

    def _response_guard(self, decision: Decision, method: str, version: bytes, protocol: str) -> ResponseGuard | None:
        """For a host that received real values: what keeps them from coming back in, in any form."""
        matcher = self._matcher(decision.host)
        if matcher is None:
            return None
        asked = f"{decision.host}:{decision.port}"

        def echoed(form: Form, where: str) -> None:
            self.audit.record(self.sandbox_id, "secret-echo", asked, decision.address,
                              f"secret {form.secret} echoed as {where}", protocol)

        return ResponseGuard(matcher, echoed, head_request=method == "HEAD", http11_client=version != b"HTTP/1.0")

    def _cut_audit(self, decision: Decision, protocol: str) -> Callable[[str], None]:
        def record(rule: str) -> None:
            self.audit.record(self.sandbox_id, "refused", f"{decision.host}:{decision.port}", decision.address,
                              rule, protocol)
        return record

    def _connect_or_502(self, conn: socket.socket, decision: Decision,
                        opened: list[socket.socket], protocol: str) -> socket.socket | None:
        try:
            return self._connect(decision, opened)
        except DeliveryRefused as refusal:
            self._refuse_audit(refusal.decision, f"{decision.host}:{decision.port}", protocol)
            send_refusal(conn, refusal.decision)
            return None
        except OSError as exc:
            body = f"corral egress: cannot reach {decision.host}:{decision.port}: {exc.strerror or exc}\n".encode()
            conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nConnection: close\r\nContent-Type: text/plain\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            return None

    def _rewrite_head(self, request_line: bytes, head: RequestHead, decision: Decision, default_port: int,
                      protocol: str) -> bytes:
        """Drop hop-by-hop headers, force one request per connection, swap placeholders for bound
        hosts -- only in a request that names the host the connection goes to, and nothing else."""
        lines = [request_line]
        bound = any(s.binding.bound_to(decision.host) for s in self.secrets)
        named = request_authority(head, default_port)
        elsewhere = None  # why this request may not carry a real value, if it names another site
        if isinstance(named, str):
            elsewhere = f"the request names no single host ({named})"
        elif not same_host(named, decision.host, decision.port):
            elsewhere = f"the request names {named[0]}:{named[1]}, not {decision.host}:{decision.port}"
        for name, line in head.fields:
            if name in _HOP_HEADERS or (bound and name in _BOUND_DROPPED):
                continue
            lines.append(self._substitute(line, decision, elsewhere, protocol))
        if bound:
            lines.append(b"Accept-Encoding: identity")
        lines.append(b"Connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def _substitute(self, line: bytes, decision: Decision, elsewhere: str | None, protocol: str) -> bytes:
        asked = f"{decision.host}:{decision.port}"
        for secret in self.secrets:
            placeholder = secret.placeholder.encode()
            if placeholder not in line:
                continue
            if not secret.binding.bound_to(decision.host):
                why = f"secret {secret.name} is not bound to {decision.host}"
            elif elsewhere is not None:
                why = f"secret {secret.name}: {elsewhere}"
            else:
                line = line.replace(placeholder, secret.value.encode())
                continue
            self.audit.record(self.sandbox_id, "secret-withheld", asked, decision.address, why, protocol)
        return line

    def _intercept(self, conn: socket.socket, upstream: socket.socket, decision: Decision, rest: bytes,
                   opened: list[socket.socket]) -> None:
        """See the request inside a tunnel to a secret-bound host so its headers can carry the real value:
        TLS on both sides (our per-sandbox CA towards the sandbox), or plain HTTP as it comes."""
        assert self.ca is not None
        if rest:
            raise ProxyError("client sent data before the tunnel was established")
        first = conn.recv(1, socket.MSG_PEEK)
        protocol = "http"
        if first == b"\x16":  # a TLS handshake record
            # each TLS socket takes over its plain one's descriptor: it is the one to close
            client: socket.socket = self.ca.server_context(decision.host).wrap_socket(conn, server_side=True)
            opened.append(client)
            upstream_ctx = self.upstream_tls or ssl.create_default_context()
            server: socket.socket = upstream_ctx.wrap_socket(upstream, server_hostname=decision.host)
            opened.append(server)
            protocol = "https"
        else:
            client, server = conn, upstream
        raw_head, body = read_head(client, time.monotonic() + HANDSHAKE_TIMEOUT)
        head = self._parsed(client, raw_head, protocol)
        if head is None:
            return
        request_line = b" ".join((head.method, head.target, head.version))
        server.sendall(self._rewrite_head(request_line, head, decision, 443 if protocol == "https" else 80,
                                          protocol) + body)
        guard = self._response_guard(decision, head.method.decode("latin-1"), head.version, protocol)
        assert guard is not None  # only tunnels to secret-bound hosts are intercepted
        copy_guarded(client, server, guard, self._cut_audit(decision, protocol))


    # -- SOCKS5 ---------------------------------------------------------------
    def _socks5(self, conn: socket.socket, opened: list[socket.socket], deadline: float) -> None:
        _, count = recv_exact(conn, 2, deadline)
        methods = recv_exact(conn, count, deadline)
        if 0 not in methods:
            conn.sendall(b"\x05\xff")
            return
        conn.sendall(b"\x05\x00")
        _, cmd, _, atyp = recv_exact(conn, 4, deadline)
        if atyp == 1:
            host = str(ipaddress.IPv4Address(recv_exact(conn, 4, deadline)))
        elif atyp == 4:
            host = str(ipaddress.IPv6Address(recv_exact(conn, 16, deadline)))
        elif atyp == 3:
            host = recv_exact(conn, recv_exact(conn, 1, deadline)[0], deadline).decode("idna")
        else:
            socks_reply(conn, SOCKS_BAD_ATYP)
            return
        (port,) = struct.unpack("!H", recv_exact(conn, 2, deadline))
        asked = f"{host}:{port}"
        if cmd != 1:  # BIND and UDP ASSOCIATE would open paths the policy cannot see
            self.audit.record(self.sandbox_id, "refused", asked, None, "socks-command-not-supported", "socks5")
            socks_reply(conn, SOCKS_BAD_CMD)
            return
        decision = self.policy.decide(host, port)
        if not decision.allowed:
            self._refuse_audit(decision, asked, "socks5")
            socks_reply(conn, SOCKS_NOT_ALLOWED)
            return
        try:
            upstream = self._connect(decision, opened)
        except DeliveryRefused as refusal:
            self._refuse_audit(refusal.decision, asked, "socks5")
            socks_reply(conn, SOCKS_NOT_ALLOWED)
            return
        except OSError:
            socks_reply(conn, SOCKS_UNREACHABLE)
            return
        socks_reply(conn, SOCKS_OK)
        self._pump(conn, upstream, b"")


def _pending(listener: socket.socket) -> bool:
    """Whether a connection waits in ``listener``'s queue (poll, not select: the owner's
    descriptors may number past select's 1,024)."""
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    return bool(poller.poll(0))

