"""Request-size limit as a plain ASGI middleware: answered before any handler reads the body.

A declared ``Content-Length`` over the limit is refused at once; a chunked body
is buffered up to the limit and refused as soon as it goes over, so a client
can neither make the server buffer without bound nor reach a handler with a
half-read body.  A request with a body must name its tenant (its API
key) before any of it is read, and what one tenant's requests hold at once is
bounded too: without that, slow bodies on many connections held 31 MiB each,
with or without a key (20 connections: 620 MiB).  And a body must keep coming: each
``SMALL_BODY`` bytes of it within the server's ``request_head_timeout``, whatever its length
or framing (a chunked body sent a byte a second was held for as long as it pleased).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import SandboxError
from .wire import status_for

#: a body up to this size is read before the key is checked (uvicorn's own read-ahead per connection)
SMALL_BODY = 64 << 10


def once(release: Callable[[], None]) -> Callable[[], None]:
    """``release``, run at most once however often the result is called (a place given back from
    the several paths a request can end by)."""
    released = False

    def release_once() -> None:
        nonlocal released
        if not released:
            released = True
            release()
    return release_once


class TenantTally:
    """How much of one resource each tenant holds at once (request bodies' bytes, downloads'
    bytes, requests under way, ended commands' output), against a bound per tenant (None: counted
    only).  Safe from any thread: background commands' output is counted on the threads that read it."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str, amount: int) -> bool:
        """Count ``amount`` more for ``tenant``; False (nothing counted) if it would pass the bound."""
        with self._lock:
            held = self.held.get(tenant, 0) + amount
            if self.limit is not None and held > self.limit:
                return False
            self.held[tenant] = held
            return True

    def add(self, tenant: str, amount: int) -> None:
        """Count ``amount`` more for ``tenant`` even past the bound (what is already held: later
        takes then wait or are refused until it is given back)."""
        with self._lock:
            self.held[tenant] = self.held.get(tenant, 0) + amount

    def give(self, tenant: str, amount: int) -> None:
        """Give back ``amount`` of what :meth:`take` counted for ``tenant``."""
        with self._lock:
            left = self.held[tenant] - amount
            if left:
                self.held[tenant] = left
            else:
                del self.held[tenant]


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, tenant_of: Callable[[str | None], str] | None = None,
                 max_per_tenant: int | None = None, small_body_timeout: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        #: the tenant an Authorization header names (raises SandboxError if none); None: no check
        self.tenant_of = tenant_of
        self.max_per_tenant = max_per_tenant
        #: seconds a small body (up to SMALL_BODY) may take to arrive, and each further SMALL_BODY
        #: bytes of a larger or chunked one
        self.small_body_timeout = small_body_timeout
        #: bytes of request bodies each tenant has buffered
        self.buffered = TenantTally(max_per_tenant)

    @staticmethod
    async def _answer(send: Send, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": code, "message": message})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body.encode()})

    async def _refuse(self, send: Send) -> None:
        await self._answer(send, 413, "resource_limit",
                           f"request body is larger than the server's limit of {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared < 0 or declared > self.max_bytes:
                await self._refuse(send)
                return
        elif b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            declared = 0
        else:
            declared = -1  # chunked: its size is known once it has all arrived
        tenant = None
        # no body is read before its key names a tenant: a small one was, and a request without a
        # key whose body came a byte at a time held its connection (a request under way, which
        # never gives way to new connections) for request_head_timeout
        if declared != 0 and self.tenant_of is not None:
            authorization = headers.get(b"authorization")
            try:
                tenant = self.tenant_of(authorization.decode("latin-1") if authorization is not None else None)
            except SandboxError as exc:  # no key, no body read
                await self._answer(send, status_for(exc), exc.code, str(exc))
                return
        held = 0
        try:
            if tenant is not None and declared > 0:  # the whole declared length is held before any is read
                if not self.buffered.take(tenant, declared):
                    await self._too_much(send, tenant)
                    return
                held = declared
            # count what actually arrives, whatever was declared
            chunks: list[bytes] = []
            total = 0
            more = True
            # a small body must come in time (a client writes it with its head), and a larger or
            # chunked one at a least rate: each SMALL_BODY bytes of it within small_body_timeout.
            # (Only a small declared one was timed: a chunked or large body sent a byte a second
            # held its request, its connection and its tenant's bytes for as long as it pleased.)
            deadline = time.monotonic() + self.small_body_timeout if declared != 0 else None
            renewed_at = SMALL_BODY  # the bytes at which the deadline is renewed
            while more:
                try:
                    message = await (receive() if deadline is None else _receive_by(receive, deadline))
                except TimeoutError:
                    await self._answer(send, 408, "resource_limit", self._too_slow(declared))
                    return
                if message["type"] != "http.request":
                    return  # the client left mid-body: nothing to answer, and no half body for a handler
                chunk = message.get("body", b"")
                total += len(chunk)
                if total > self.max_bytes:
                    await self._refuse(send)
                    return
                if tenant is not None and declared < 0:  # chunked: held as it arrives
                    if not self.buffered.take(tenant, len(chunk)):
                        await self._too_much(send, tenant)
                        return
                    held += len(chunk)
                chunks.append(chunk)
                more = message.get("more_body", False)
                if deadline is not None and total >= renewed_at:
                    deadline = time.monotonic() + self.small_body_timeout
                    renewed_at = (total // SMALL_BODY + 1) * SMALL_BODY
            await self.app(scope, replay_body(b"".join(chunks), receive), send)
        finally:
            if held:
                assert tenant is not None
                self.buffered.give(tenant, held)

    def _too_slow(self, declared: int) -> str:
        if 0 < declared <= SMALL_BODY:
            return f"a body of {declared} bytes must arrive within {self.small_body_timeout:g} s"
        return (f"a request body must arrive at {SMALL_BODY} bytes per {self.small_body_timeout:g} s at least "
                "(the server's request_head_timeout)")

    async def _too_much(self, send: Send, tenant: str) -> None:
        await self._answer(send, 429, "resource_limit",
                           f"tenant {tenant}'s requests under way hold over the server's {self.max_per_tenant} "
                           "bytes of bodies per tenant: send fewer at once")



async def _receive_by(receive: Receive, deadline: float) -> Message:
    """``receive()``, or TimeoutError once the monotonic clock passes ``deadline``: what
    ``asyncio.wait_for(receive(), ...)`` answered, without wait_for's task (Python 3.11), which
    read a body that had come with its head (a client writes a small one so) one or two turns
    of the event loop later."""
    left = deadline - time.monotonic()
    if left <= 0:
        return await asyncio.wait_for(receive(), 0)  # TimeoutError, receive() never run: as before
    async with asyncio.timeout(left):
        return await receive()


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app ``body`` (already read from ``receive``) as one message,
    then whatever ``receive`` says next (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class TenantRequests:
    """Requests and WebSockets one tenant has under way at once, bounded (a server with API keys).

    Each holds a connection of the server's ``max_connections``; without a bound one tenant's
    WebSockets (an attached command costs little) or requests waiting for its share of the threads
    could hold them all, and every other tenant would be answered 503.  Past ``max_per_tenant`` a
    request is answered 429 and a WebSocket is closed before it is accepted (HTTP 403).  A request
    whose key names no tenant is the app's to refuse (401).
    """

    def __init__(self, app: ASGIApp, tenant_of: Callable[[str | None], str], max_per_tenant: int) -> None:
        self.app = app
        self.tenant_of = tenant_of
        self.max_per_tenant = max_per_tenant
        self.under_way = TenantTally(max_per_tenant)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        authorization = dict(scope.get("headers") or []).get(b"authorization")
        try:
            tenant = self.tenant_of(authorization.decode("latin-1") if authorization is not None else None)
        except SandboxError:
            await self.app(scope, receive, send)
            return
        if not self.under_way.take(tenant, 1):
            message = (f"tenant {tenant} has {self.under_way.held.get(tenant, 0)} requests and WebSockets under way, "
                       f"the server's max_requests_per_tenant: finish or close some first")
            if scope["type"] == "websocket":
                await receive()  # websocket.connect
                await send({"type": "websocket.close", "code": 4429, "reason": message[:120]})
            else:
                await BodySizeLimit._answer(send, 429, "resource_limit", message)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.under_way.give(tenant, 1)
