"""uvicorn's WebSocket protocol (websockets-sansio) with bounds on what clients' messages hold
while they are being received.

A message is held whole before the app sees it: up to uvicorn's ``ws_max_size`` (16 MiB) per
connection, in the parser's buffer (a frame arriving) and in the frames of a fragmented message.
uvicorn bounds nothing across connections, and kept that buffer after the connection was gone:
45 connections, each sending the header of a 16 MiB frame and most of its payload and then
leaving, grew the server by 720 MiB, for good (on loopback, where no key is asked for).

Now:

* what a connection holds of a message being received -- arriving, or arrived and not yet taken
  by the app -- is given back as the app takes the message, and dropped with the connection;
* the bytes of one tenant's messages being received at once are bounded (the server's
  ``max_request_bytes_per_tenant``, as for request bodies; stdin the exec stream holds for a
  command counts there too): the connection whose bytes would pass the bound is closed with 1009.  The tenant is the one the handshake's API key names; without
  keys every caller is the one local tenant; handshakes with no valid key share one bound of
  their own (they are refused by the routes, but may send before that).

And on what is sent: a handler's send waits while the connection's write buffer is full, and a
client that never reads never empties it.  uvicorn's keepalive then "closes" the connection, but
``transport.close()`` waits for that buffer to drain, so the connection was never lost and its
handler waited in its send for ever, holding what it was sending (an attached background
command's whole output, an exec stream's output share and exec slot).  Now a connection whose
writes make no progress (its buffer does not shrink) for ``send_timeout`` (the server's
``ws_send_timeout``, 30 s) is aborted: its handler's send fails as for a client that left.  A
keepalive that times out aborts it ``close_timeout`` (10 s) after its close frame.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from asyncio import TimerHandle
from collections import deque
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.http11 import Request

from ..errors import SandboxError
from ..host.heap import return_free_memory
from .limits import TenantTally

#: whose messages are counted together when the handshake's key names no tenant
NO_TENANT = "(no valid key)"
#: the close code for a message that may not be received: "message too big"
CLOSE_TOO_BIG = 1009
#: seconds a connection's writes may make no progress before it is aborted (ServerConfig.ws_send_timeout)
SEND_TIMEOUT = 30.0


class BoundedWebSocketProtocol(WebSocketsSansIOProtocol):
    #: bytes of messages being received, per tenant (``bounded_ws_protocol`` makes a class with its own)
    receiving: TenantTally = TenantTally(None)
    #: the tenant an Authorization header names (raises SandboxError for none)
    tenant_of: Callable[[str | None], str] = staticmethod(lambda _: NO_TENANT)
    _tenant = NO_TENANT
    #: bytes counted for this connection's message being received
    _counted = 0
    #: seconds its writes may make no progress (``bounded_ws_protocol`` sets the server's)
    send_timeout = SEND_TIMEOUT
    #: the next look at whether writes made progress, while they are paused
    _stall_check: TimerHandle | None = None
    #: the write buffer's size at the previous look
    _stall_buffered = 0

    def handle_connect(self, event: Request) -> None:
        try:
            self._tenant = type(self).tenant_of(event.headers.get("Authorization"))
        except SandboxError:
            self._tenant = NO_TENANT
        super().handle_connect(event)

    #: sizes of the whole messages queued for the app, oldest first
    _queued: deque[int] | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # from the handshake on (its tenant is known; websockets bounds the handshake itself)
        if self.handshake_initiated:
            self._count()

    def send_receive_event_to_app(self) -> None:
        size, queued = sum(len(frame) for frame in self.frames), self.queue.qsize()
        super().send_receive_event_to_app()
        if self.queue.qsize() > queued:
            if self._queued is None:
                self._queued = deque()
            self._queued.append(size)

    async def receive(self) -> Any:
        message = await super().receive()
        if message["type"] == "websocket.receive" and self._queued:
            self._queued.popleft()
            self._count()
        return message

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._drop_partial_message()
        self._stop_stall_check()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._check_stall_later()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_stall_check()

    def keepalive_timeout(self) -> None:
        super().keepalive_timeout()
        # the close frame waits behind what the client did not read; it never will
        self.loop.call_later(self.close_timeout, self._abort)

    def _check_stall_later(self) -> None:
        self._stop_stall_check()
        self._stall_buffered = self.transport.get_write_buffer_size()
        self._stall_check = self.loop.call_later(type(self).send_timeout, self._check_stall)

    def _stop_stall_check(self) -> None:
        if self._stall_check is not None:
            self._stall_check.cancel()
            self._stall_check = None

    def _check_stall(self) -> None:
        self._stall_check = None
        if self.disconnected or self.writable.is_set():
            return
        if self.transport.get_write_buffer_size() < self._stall_buffered:
            self._check_stall_later()  # a slow reader, but a reader
            return
        self._abort()

    def _abort(self) -> None:
        """Drop the connection and what it has not sent: connection_lost follows (its handler's send fails)."""
        if self.disconnected:
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # a reset, not a FIN queued behind the unread bytes: the kernel would keep them, and the
            # socket, while the client goes on not reading
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _count(self) -> None:
        """Count what this connection now holds for its tenant; past the bound, the connection is
        closed and what it held dropped."""
        if self.disconnected:
            return  # given back at the loss
        held = len(self.conn.reader.buffer) + sum(len(frame) for frame in self.frames) + sum(self._queued or ())
        change = held - self._counted
        if change <= 0:
            if change:
                type(self).receiving.give(self._tenant, -change)
                self._counted = held
            return
        if type(self).receiving.take(self._tenant, change):
            self._counted = held
            return
        tally = type(self).receiving
        self._refuse(f"tenant's WebSocket messages being received would pass {tally.limit} bytes")

    def _refuse(self, reason: str) -> None:
        if not self.transport.is_closing():
            self.conn.fail(CLOSE_TOO_BIG, reason[:120])
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.queue.put_nowait({"type": "websocket.disconnect", "code": CLOSE_TOO_BIG, "reason": reason})
            self.close_sent = True
            self.transport.close()
        self._drop_partial_message()

    def _drop_partial_message(self) -> None:
        # the parser's buffer and a fragmented message's frames: nothing will read them now
        self.conn.reader.discard()
        self.frames = []
        self._queued = None
        if self._counted:
            type(self).receiving.give(self._tenant, self._counted)
            if self._counted >= TRIM_AFTER:
                return_free_memory()
            self._counted = 0


#: dropping this much of a message makes the server give its free memory back to the host
TRIM_AFTER = 1 << 20


def bounded_ws_protocol(tenant_of: Callable[[str | None], str], receiving: TenantTally,
                        send_timeout: float = SEND_TIMEOUT) -> type[BoundedWebSocketProtocol]:
    """The protocol class, counting messages being received in ``receiving`` (per tenant, with its
    bound) and aborting connections whose writes make no progress for ``send_timeout`` seconds."""
    attributes: dict[str, Any] = {"receiving": receiving, "tenant_of": staticmethod(tenant_of),
                                  "send_timeout": send_timeout}
    return type("BoundedWebSocketProtocol", (BoundedWebSocketProtocol,), attributes)
