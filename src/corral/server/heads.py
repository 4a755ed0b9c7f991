"""uvicorn's httptools protocol with bounds on a request's head (its request line and headers).

httptools keeps a URL or header being received in memory however long it grows, and uvicorn
sets no bound: one connection sending an endless header grew the server by a MiB per MiB sent
(360 MiB and on), before any key could be checked.  Past :data:`MAX_HEAD` bytes of one head the
client is answered 431 and the connection closed (h11, uvicorn's other parser, has such a bound
of its own: 16 KiB).

Kept-alive connections waiting for their next request are held up to ``timeout_keep_alive``
(65 s): one client's 80 idle connections filled a server's 64 and every other client got 503
for a minute.  Once more than half of ``max_connections`` are open, each new connection closes
the oldest of those that have sent nothing yet (silent connections reopened as fast as the head
timeout below closed them kept the server full, with no key), then idle ones (their clients open
a new one when they next ask, as after any keep-alive timeout).

A connection that sent part of a head kept its place until the head timeout: one address's 80
connections sending a byte of a head every second filled a keyed server's 64, and every tenant
got 503, no key ever shown.  A client writes its head at once, so a head that arrives in pieces
is rare, and brief.  Now each address (an IPv6 one's /64) may have at most
``max_partial_heads_per_peer`` connections with part of a head and not all of it; the
connection that would pass that is answered 429 and closed at once (unless it is running a
request, with a next head coming).  Silent connections are not counted (a burst of one client's
connections is silent until the server reads them, and these give way as above), nor
connections between requests.  Many addresses' partial heads are met past half of
``max_connections``: a head :data:`SLOW_HEAD` seconds or more in the making gives way to a new
connection too, oldest first, after the silent ones and before idle ones.  A connection running a
request never gives way.

A connection that gives way counts as open no more at once: uvloop calls ``connection_lost``
only after its next look at the sockets, and a request read in that look (the very one the
connection was closed to make room for) was answered 503 while they were many.

uvicorn does not time a head either: a connection that sent nothing, or half a head, was held
for ever, and ``max_connections`` of them made the server answer 503 to everyone.  A head must
now arrive whole within ``head_timeout`` seconds of the connection (or of its first byte, for the
next request on a kept-alive connection), or the client is answered 408 and the connection closed.
"""
from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
from collections.abc import Iterator

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .host_guard import PEER_OF_CONNECTION, PeerOfConnection

#: bytes of one request's head a client may send (uvicorn's h11 allows 16 KiB, nginx 8-32 KiB)
MAX_HEAD = 64 << 10

#: seconds after a head's first byte from which, past half of max_connections, the head gives way
#: to new connections if it is not whole (a client writes its head at once: it arrives within a
#: round trip or two, a lost segment's retransmission included)
SLOW_HEAD = 2.0


def peer_of(host: str) -> str:
    """The address connections are counted by: an IPv4 address (an IPv4-mapped IPv6 one's too),
    or an IPv6 address's /64 (what one host is given; it may use any address in it)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _answer(status: bytes, message: str) -> bytes:
    body = json.dumps({"error": "resource_limit", "message": message}).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


_TOO_LONG = _answer(b"431 Request Header Fields Too Large",
                    f"the request's line and headers are over the server's {MAX_HEAD} bytes")


class BoundedHeadProtocol(HttpToolsProtocol):
    #: seconds a head may take to arrive whole (``bounded_head_protocol`` makes a class with another)
    head_timeout = 30.0
    #: connections of one peer (:func:`peer_of`) with part of a head and not all of it
    max_partial_heads_per_peer = 8
    #: when the open head's first byte came (loop time), if it has not arrived whole
    _partial_since: float | None = None
    #: the peer this connection's partial head is counted for
    _counted_peer: str | None = None
    _head_timer: asyncio.TimerHandle | None = None
    #: a head is being received (from the connection's start, and after each request's end)
    _head_open = True
    #: its bytes so far
    _head_bytes = 0
    #: heads received whole on this connection
    _heads_done = 0

    def data_received(self, data: bytes) -> None:
        self._headless().pop(self, None)  # it said something: no longer silent
        was_open, heads_done = self._head_open, self._heads_done
        super().data_received(data)
        # all of ``data`` is head only if a head was open before and after it and none ended in it
        # (a chunk where one ended, or where a new one began, is not counted: at most one read more)
        if not (was_open and self._head_open and heads_done == self._heads_done):
            return
        if not self._head_bytes:
            self._head_begun()
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD and not self.transport.is_closing():
            self._head_open = False
            self.transport.write(_TOO_LONG)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_timer()
        headless = self._headless()
        limit = self.limit_concurrency
        if limit is not None and len(self.connections) > limit // 2:
            # the oldest that have sent nothing first (silent connections, reopened as fast as
            # the head timeout closed them, kept max_connections full, and every tenant got 503,
            # before any key was seen), then heads long in the making (a client writes its head
            # at once), then idle kept-alive ones: a client that sent a request is likelier to be one
            candidates = itertools.chain(_while_any(headless), self._slow_heads(), _while_any(self._kept_alive()))
            while len(self.connections) > limit // 2:
                other = next(candidates, None)
                if other is None:
                    break
                other._give_way()
        headless[self] = None

    def _give_way(self) -> None:
        """Close the connection, counting it as open no more (see the module's docstring)."""
        self.connections.discard(self)
        self._headless().pop(self, None)
        self._kept_alive().discard(self)
        self.transport.close()

    def _head_begun(self) -> None:
        """Part of a head has come, not all of it: count the connection for its peer, and close it
        if that passes the peer's bound (unless it is running a request)."""
        if self.transport.is_closing():
            return
        # its time runs from its first byte (on a kept-alive connection, "\r\n" between requests
        # begins no message, and had no timer: it was held until another connection made it give way)
        self._start_timer()
        self._kept_alive().discard(self)  # no longer idle
        self._partial_since = self.loop.time()
        self._partial()[self] = None
        if self.client is None:
            return
        peer = self._counted_peer = peer_of(self.client[0])
        counts = self._peer_partials()
        counts[peer] = counts.get(peer, 0) + 1
        if counts[peer] > self.max_partial_heads_per_peer and not self._running():
            self.transport.write(_answer(b"429 Too Many Requests", (
                f"{peer} has {counts[peer] - 1} other connections that sent part of a request's line and "
                f"headers and not all of it, the server's max_partial_heads_per_peer: send a head whole")))
            self._give_way()

    def _head_ended(self) -> None:
        """The partial head is whole, or its connection gone: it counts no more."""
        if self._partial_since is None:
            return
        self._partial_since = None
        self._partial().pop(self, None)
        peer, self._counted_peer = self._counted_peer, None
        if peer is not None:
            counts = self._peer_partials()
            if counts[peer] > 1:
                counts[peer] -= 1
            else:
                del counts[peer]

    def _running(self) -> bool:
        """A request of this connection is being handled (a next head may come meanwhile)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _slow_heads(self) -> Iterator[BoundedHeadProtocol]:
        """This server's connections whose head began :data:`SLOW_HEAD` seconds ago or more and is
        not whole, oldest first, but those running a request."""
        began_by = self.loop.time() - SLOW_HEAD
        for other in list(self._partial()):
            assert other._partial_since is not None
            if other._partial_since > began_by:
                return  # (in the order their heads began)
            if not other._running():
                yield other

    def _kept_alive(self) -> set[BoundedHeadProtocol]:
        """This server's connections waiting for their next request (kept with the server's
        state, shared by its connections)."""
        return self._shared().corral_idle  # type: ignore[attr-defined,no-any-return]

    def _headless(self) -> dict[BoundedHeadProtocol, None]:
        """This server's connections that have sent nothing yet, oldest first."""
        return self._shared().corral_headless  # type: ignore[attr-defined,no-any-return]

    def _partial(self) -> dict[BoundedHeadProtocol, None]:
        """This server's connections with part of a head and not all of it, in the order their
        heads began."""
        return self._shared().corral_partial  # type: ignore[attr-defined,no-any-return]

    def _peer_partials(self) -> dict[str, int]:
        """How many of those each peer has (:func:`peer_of`)."""
        return self._shared().corral_peer_partials  # type: ignore[attr-defined,no-any-return]

    def _shared(self) -> object:
        """The server's state, holding the sets above (shared by its connections)."""
        state = self.server_state
        if not hasattr(state, "corral_idle"):
            state.corral_idle = set()  # type: ignore[attr-defined]
            state.corral_headless = {}  # type: ignore[attr-defined]
            state.corral_partial, state.corral_peer_partials = {}, {}  # type: ignore[attr-defined]
        return state

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self._kept_alive().discard(self)
        self._headless().pop(self, None)
        self._head_ended()
        super().connection_lost(exc)

    #: a request has begun arriving and has not arrived whole
    _in_request = False

    #: whose socket the client's end is, once a request of it was served (``host_guard``)
    _peer: PeerOfConnection | None = None

    def on_message_begin(self) -> None:
        self._in_request = True
        self._kept_alive().discard(self)
        super().on_message_begin()
        if self._peer is None:
            self._peer = PeerOfConnection()
        self.scope[PEER_OF_CONNECTION] = self._peer  # type: ignore[literal-required]
        self._start_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # idle: waiting for a next request of which nothing has come yet
        if self.timeout_keep_alive_task is not None and not self._in_request and not self.transport.is_closing():
            self._kept_alive().add(self)

    def _start_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_late)

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.write(_answer(b"408 Request Timeout", f"no whole request line and headers arrived "
                                                                  f"within {self.head_timeout:g} s"))
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._stop_timer()
        self._headless().pop(self, None)
        self._head_ended()
        self._head_open, self._head_bytes = False, 0
        self._heads_done += 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open = True
        self._in_request = False


def _while_any(connections: dict[BoundedHeadProtocol, None] | set[BoundedHeadProtocol]) -> Iterator[
        BoundedHeadProtocol]:
    """The first of ``connections`` (of a dict: the oldest), for as long as there is one: the one
    taken gives way, which removes it."""
    while connections:
        yield next(iter(connections))


def bounded_head_protocol(head_timeout: float, max_partial_heads_per_peer: int) -> type[BoundedHeadProtocol]:
    """The protocol class, with ``head_timeout`` seconds for a head and at most
    ``max_partial_heads_per_peer`` partial heads per peer."""
    return type("BoundedHeadProtocol", (BoundedHeadProtocol,), {
        "head_timeout": head_timeout, "max_partial_heads_per_peer": max_partial_heads_per_peer})
