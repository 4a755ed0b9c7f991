"""Only its own user's programs may drive a server that asks for no key: no web page, no other
user of the host.

Without API keys the server answers anyone who reaches its loopback port, and a browser is such
a caller: a page of any site can POST there and open WebSockets (browsers apply no same-origin
rule to them), and with DNS rebinding (its own name resolving to 127.0.0.1) it reads every
answer: it could list the developer's sandboxes, run commands in them, read their files and give
new ones egress.

So, when no key is configured, a request must name the loopback in its ``Host`` (``127.0.0.1``,
``localhost``, ``[::1]``, any loopback address, any port; what every local client sends) -- else
421, as the MCP SDK answers -- and a request that carries an ``Origin`` (browsers send it on
every cross-origin request and WebSocket, and on a same-origin one that is not a GET) must come
from a page of the server itself (the origin its ``Host`` names) -- else 403. Not any page on the
loopback: a sandbox's forwarded port (``sb.ports.expose``) is a page on the loopback too, and
what it serves is the sandbox's; the server's own proxy into a sandbox's port serves it sandboxed
(an opaque origin, ``Origin: null``: see ``port_routes``). Clients that are not browsers send no
``Origin``.

Other users of the host reach the loopback too: a keyless server answers only connections whose
socket belongs to the server's own user or root (the kernel's socket diagnostics say whose:
:func:`corral.host.peers.tcp_peer_uid`) -- else 403 -- as the CLI's daemon answers only on a
root-only socket. Another user could otherwise list, read and drive the sandboxes of everyone
who uses the server. The configuration's ``local_users`` (``--local-user``) names more.

With keys nothing here is checked: a page has no key to send, a server reached by a DNS name
must accept it, and a key is what lets a user in.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from ..host.peers import tcp_peer_uid
from ..netrules import names_loopback
from .wire import error_response


def host_header_is_loopback(value: str) -> bool:
    """``Host: 127.0.0.1:8080``, ``localhost``, ``[::1]:80``, ... (a port, if any, is digits)."""
    if value.startswith("["):
        inside, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return False
        return names_loopback(inside)
    name, colon, port = value.partition(":")
    if colon and not port.isdigit():
        return False
    return names_loopback(name)


_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def origin_is_the_servers(origin: str, host: str, scheme: str) -> bool:
    """``Origin`` names the page's own origin: the request's scheme and ``Host`` (a page of this
    server, as its ``Host`` says the browser reached it). ``null`` (a file, a sandboxed frame or
    page) and every other origin, the loopback's included, are not."""
    try:
        page = urlsplit(origin)
        server = urlsplit(f"//{host}")
        page_port = page.port or _DEFAULT_PORTS.get(page.scheme)
        server_port = server.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:
        return False
    return (page.scheme in ("http", "https") and page.scheme == scheme.replace("ws", "http")
            and page.hostname is not None and page.hostname == server.hostname and page_port == server_port
            and not page.path and not page.query and not page.username)


#: the scope key of a connection's :class:`PeerOfConnection` (set by ``heads.BoundedHeadProtocol``)
PEER_OF_CONNECTION = "corral.peer_of_connection"


class PeerOfConnection:
    """Whose socket the client's end of one TCP connection is, once a request of it was served.

    The kernel is asked once per connection, not once per request (a netlink round trip, ~15-60 us
    of the event loop per request), and this is as strong as asking every time:

    * every byte of a TCP connection comes from the one client socket it was made with (a socket
      is never reconnected), and the uid the kernel reports is that socket's owner, set when it
      was made; so the answer at a connection's first served request holds for its later ones;
    * the owner changes only by ``fchown`` on the socket, which takes ``CAP_CHOWN`` over the
      owner's uid: only a served user (root, or a user with that capability over its own
      sockets) can hand its connection to another user that way -- and it can hand it over
      without changing the owner (``SCM_RIGHTS``, ``fork``), which the per-request check served
      all the same: a connection is its owner's to give;
    * the per-request lookup was, if anything, weaker late in a connection: it goes by the four
      addresses, and once the client's socket has closed (its last requests still queued here)
      the kernel answers for whatever socket holds those addresses then (none, or on older
      kernels, whose ``sock_i_uid`` reads a socket without its file as root's, root).

    Only a served uid is kept: a refused connection is asked about again at each request, as before.
    A WebSocket handshake (another protocol) and uvicorn's h11 carry none: asked every time."""

    __slots__ = ("served",)

    def __init__(self) -> None:
        self.served: int | None = None


class LoopbackCallersOnly:
    """ASGI middleware: the checks above, for HTTP requests and WebSocket handshakes alike."""

    def __init__(self, app: ASGIApp, also: Iterable[int] = ()) -> None:
        self.app = app
        #: whose connections are served: this process's user, root, and the ``local_users`` listed
        self.users = frozenset({0, os.geteuid(), *also})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = origin = None
        hosts = 0
        for name, value in scope["headers"]:
            if name == b"host":
                host, hosts = value.decode("latin-1"), hosts + 1
            elif name == b"origin":
                origin = value.decode("latin-1")
        if hosts > 1:  # which one names the server? (RFC 9112 3.2: refused); the proxy reads the first
            host = None
        if host is None or not host_header_is_loopback(host):
            await self._refuse(scope, receive, send, 421, "misdirected_request",
                               f"Host {host!r} is not this server's loopback: a server without API keys "
                               "answers only requests addressed to 127.0.0.1, localhost or [::1]")
            return
        if origin is not None and not origin_is_the_servers(origin, host, scope.get("scheme", "http")):
            await self._refuse(scope, receive, send, 403, "forbidden_origin",
                               f"Origin {origin!r}: a server without API keys answers no web page but "
                               "its own (configure API keys to serve other callers)")
            return
        connection: PeerOfConnection | None = scope.get(PEER_OF_CONNECTION)
        uid = connection.served if connection is not None else None
        if uid is None:
            uid = self._peer_uid(scope)
            if connection is not None and uid in self.users:
                connection.served = uid
        if uid not in self.users:
            await self._refuse(scope, receive, send, 403, "forbidden_user",
                               f"the connection's socket belongs to {'an unknown user' if uid is None else f'uid {uid}'}: "
                               "a server without API keys answers only its own user, root and its "
                               "local_users (list the user there, or configure API keys)")
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _peer_uid(scope: Scope) -> int | None:
        client, server = scope.get("client"), scope.get("server")
        if not client or not server or server[1] is None:
            return None
        try:
            return tcp_peer_uid((client[0], int(client[1])), (server[0], int(server[1])))
        except (OSError, ValueError):
            return None

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, code: str, message: str) -> None:
        if scope["type"] == "websocket":
            # before accept: the handshake is answered 403, the page learns nothing more
            await send({"type": "websocket.close", "code": 1008, "reason": code})
            return
        await error_response(status, code, message)(scope, receive, send)
