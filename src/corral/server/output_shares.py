"""What one tenant's commands may make the server hold of their output, bounded per tenant.

A command's output passes through the server: a blocking exec's result is built here (the
bytes, their text, the JSON answer), a streamed exec's chunks queue for a client that may not
read, a background command's output is kept for clients that attach.  Each command is bounded
by its sandbox's ``max_output`` per stream, and how many run at once by the tenant's thread
share -- which still let one tenant's 16 execs printing 2 x 64 MiB grow the server to 6.3 GB
(and two tenants could take the host's memory).  So each running command of a tenant is counted
at what it may print (2 x ``max_output``) against ``max_output_bytes_per_tenant``: past it the
next command waits its turn (FIFO per tenant, holding no thread), and a background start, which
could wait for a command that never ends, is refused.

A blocking exec's or code cell's answer is counted too, at its size, until its client has taken
it (:class:`HeldUntilSent`): a client that asks and never reads once made the server hold every
answer in full (16 unread answers of 2 x 16 MiB of output: 2.3 GB).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, Protocol, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .limits import TenantTally, once

Release = Callable[[], None]
T = TypeVar("T")


class RunOnThread(Protocol):
    """Runs a blocking call on the tenant's share of the threads (``ServerContext.run_for``)."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


class OutputShares:
    """Bytes of output each tenant's running commands may hold, against one bound per tenant.
    Holding is done on the event loop; a release may come from any thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._tally = TenantTally(limit)
        #: what each tenant holds now
        self.held = self._tally.held
        self._waiting: dict[str, deque[tuple[int, asyncio.Future[None]]]] = {}
        self._lock = threading.Lock()

    def try_hold(self, tenant: str, amount: int) -> Release | None:
        """Count ``amount`` for ``tenant`` now and return what gives it back; None if it must wait."""
        amount = min(amount, self.limit)  # one that may print more than all of it runs alone
        with self._lock:
            if self._waiting.get(tenant) or not self._tally.take(tenant, amount):
                return None
        return self._releaser(tenant, amount)

    async def hold(self, tenant: str, amount: int) -> Release:
        """Count ``amount`` for ``tenant``, waiting behind its earlier commands until it fits."""
        release = self.try_hold(tenant, amount)
        if release is not None:
            return release
        amount = min(amount, self.limit)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiting.setdefault(tenant, deque()).append((amount, waiter))
        self._wake(tenant)  # what it waits for may have been given back in between
        try:
            await waiter
        except asyncio.CancelledError:  # the client went away while it waited
            with self._lock:
                queue = self._waiting.get(tenant)
                if queue is not None and (amount, waiter) in queue:
                    queue.remove((amount, waiter))
                    if not queue:
                        del self._waiting[tenant]
                    granted = False
                else:
                    granted = waiter.done() and not waiter.cancelled()
            if granted:
                self._give(tenant, amount)
            else:
                self._wake(tenant)  # those it held back may fit now
            raise
        return self._releaser(tenant, amount)

    def keep(self, tenant: str, amount: int) -> Release:
        """Count ``amount`` for ``tenant`` now, past the bound if need be: an answer already made,
        held until its client has taken it (its later commands wait meanwhile)."""
        self.add(tenant, amount)
        return self._releaser(tenant, amount)

    def add(self, tenant: str, amount: int) -> None:
        """:meth:`keep` for a count that changes piece by piece; :meth:`give` gives it back."""
        with self._lock:
            self._tally.add(tenant, amount)

    def give(self, tenant: str, amount: int) -> None:
        self._give(tenant, amount)

    def _releaser(self, tenant: str, amount: int) -> Release:
        return once(functools.partial(self._give, tenant, amount))

    def _give(self, tenant: str, amount: int) -> None:
        with self._lock:
            self._tally.give(tenant, amount)
        self._wake(tenant)

    def _wake(self, tenant: str) -> None:
        granted: list[tuple[int, asyncio.Future[None]]] = []
        with self._lock:
            queue = self._waiting.get(tenant)
            while queue and self._tally.take(tenant, queue[0][0]):
                granted.append(queue.popleft())
            if queue is not None and not queue:
                del self._waiting[tenant]
        for amount, waiter in granted:
            waiter.get_loop().call_soon_threadsafe(self._grant, tenant, amount, waiter)

    def _grant(self, tenant: str, amount: int, waiter: asyncio.Future[None]) -> None:
        if waiter.done():  # cancelled after it was granted: nobody will release it
            self._give(tenant, amount)
        else:
            waiter.set_result(None)


#: an answer is handed to the server this much at a time
SEND_PIECE = 1 << 20


async def send_in_pieces(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes | list[bytes]) -> None:
    """Send an answer so that it returns only once the client has taken (nearly) all of it:
    uvicorn's ``send`` queues what it is given in the socket's buffer at once and waits for that
    buffer to drain only at the next ``send``; so the body goes in pieces (``body`` may come in
    pieces already: :func:`render_json`)."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    pieces = body if isinstance(body, list) else _slices(body)
    pieces = [piece for piece in pieces if piece]
    for i, piece in enumerate(pieces):
        await send({"type": "http.response.body", "body": piece, "more_body": i + 1 < len(pieces)})
    if not pieces:
        await send({"type": "http.response.body", "body": b""})


#: characters of a string, or items of a list, JSON-encoded in one call: the encoder holds the
#: interpreter's lock for a whole call, so a worker thread encoding 2 x 64 MiB of output in one
#: call stalled the event loop as much as doing it there
ENCODE_PIECE = 1 << 18

#: an answer up to this size is rendered whole on its worker thread and sent with its length; a
#: larger one is rendered as it is sent (:class:`SentAsRendered`)
WHOLE_ANSWER = 4 << 20


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _encode(value: Any) -> Iterator[bytes]:
    if isinstance(value, str) and len(value) > ENCODE_PIECE:
        yield b'"'
        for at in range(0, len(value), ENCODE_PIECE):
            yield encode_basestring(value[at:at + ENCODE_PIECE])[1:-1].encode()
        yield b'"'
    elif isinstance(value, list) and len(value) > 1024:
        yield b"["
        for at in range(0, len(value), 1024):
            yield (b"," if at else b"") + _dumps(value[at:at + 1024])[1:-1].encode()
        yield b"]"
    else:
        yield _dumps(value).encode()


def json_pieces(content: dict[str, Any]) -> Iterator[bytes]:
    """``content`` as a JSON answer's body (as Starlette renders one), a piece per encoder call."""
    yield b"{"
    for i, (key, value) in enumerate(content.items()):
        yield (b"," if i else b"") + _dumps(key).encode() + b":"
        yield from _encode(value)
    yield b"}"


@dataclass
class Rendering:
    """An answer rendered up to :data:`WHOLE_ANSWER`: ``head`` is all of it when ``rest`` is None,
    else ``rest`` renders the remainder, a piece per call."""

    head: list[bytes]
    rest: Iterator[bytes] | None
    #: what is rendered, while ``rest`` is left (an HTTP/1.0 client's answer is counted first)
    content: dict[str, Any] | None = None


def render_json(content: dict[str, Any]) -> Rendering:
    """Begin rendering ``content`` for an answer that may be large (a command's output, a
    listing), on a worker thread: rendered on the event loop, one tenant's 2 x 64 MiB of output
    (768 MiB of JSON) or listings of 90,000 entries stalled every other tenant's requests for up
    to 3.6 s.  Whole up to :data:`WHOLE_ANSWER`; past it the rest is left for
    :class:`SentAsRendered`: rendered whole, the JSON of output made of control characters (six
    bytes each, ``\\u0001``) held 1 GiB of the server for an exec counted at 128 MiB."""
    pieces = json_pieces(content)
    head: list[bytes] = []
    size = 0
    for piece in pieces:
        head.append(piece)
        size += len(piece)
        if size > WHOLE_ANSWER:
            return Rendering(head, pieces, content)
    return Rendering(head, None)


def answer_of(rendering: Rendering, shares: OutputShares, tenant: str, hold: Release,
              run: RunOnThread) -> Response:
    """The response for ``rendering``, taking ``hold`` (what its work was counted at) over: an
    answer rendered whole is counted at its size (:class:`HeldUntilSent`) and ``hold`` is given
    back; a larger one keeps ``hold`` until it is sent, its rest rendered by ``run`` (on the
    tenant's thread)."""
    if rendering.rest is not None:
        return SentAsRendered(rendering, hold, run)
    try:
        return HeldUntilSent(rendering.head, shares, tenant)
    finally:
        hold()


async def client_left(receive: Receive) -> None:
    """Returns once the request's client has disconnected (its body is read: what ``receive``
    says next is that).  A caller cancels it once its work is done."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _slices(body: bytes) -> list[bytes]:
    return [body[offset:offset + SEND_PIECE] for offset in range(0, len(body), SEND_PIECE)]


class SentAsRendered(Response):
    """A JSON answer larger than :data:`WHOLE_ANSWER`, rendered a piece at a time as its client
    takes it (chunked: its length is not known before it is all made), so that the server holds
    the output's text and a piece of its JSON, never the JSON whole.  What its work was counted
    at (``hold``: a command's 2 x ``max_output``, a listing's ``LISTING_HOLD``) stays counted
    until the last piece is sent, or the client is gone."""

    media_type = "application/json"

    def __init__(self, rendering: Rendering, hold: Release, run: RunOnThread,
                 status_code: int = 200) -> None:
        super().__init__(b"", status_code=status_code)
        self.raw_headers = [(name, value) for name, value in self.raw_headers if name != b"content-length"]
        self._head = rendering.head
        self._rest = rendering.rest
        self._content = rendering.content
        self._hold = hold
        self._run = run

    def _length(self) -> int:
        """The answer's length, from a rendering of it thrown away a piece at a time: HTTP/1.0 has
        no chunked encoding (uvicorn sent one anyway, which a 1.0 client cannot read)."""
        return sum(len(piece) for piece in json_pieces(self._content or {}))

    def _next_piece(self) -> bytes:
        """The next ~:data:`SEND_PIECE` bytes of the answer (b"" once it is all sent)."""
        batch: list[bytes] = []
        size = 0
        for piece in self._rest or ():
            batch.append(piece)
            size += len(piece)
            if size >= SEND_PIECE:
                break
        return b"".join(batch)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # a client gone is not rendered for: uvicorn's send does nothing once it has left
        gone = asyncio.ensure_future(client_left(receive))
        try:
            headers = self.raw_headers
            if scope.get("http_version") == "1.0":
                headers = [*headers, (b"content-length", str(await self._run(self._length)).encode())]
            await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
            pieces = _slices(b"".join(self._head))
            self._head = []
            while pieces and not gone.done():
                for piece in pieces:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                pieces = _slices(await self._run(self._next_piece))
            await send({"type": "http.response.body", "body": b""})
        finally:
            gone.cancel()
            self._rest = self._content = None
            self._hold()

    def __del__(self) -> None:  # never sent (an error on the way out): not counted for ever
        self._hold()


class HeldUntilSent(Response):
    """A JSON answer, its body rendered in ``pieces`` (:func:`render_json`), counted against its
    tenant's output bound until its client has taken it (or is gone)."""

    media_type = "application/json"

    def __init__(self, pieces: list[bytes], shares: OutputShares, tenant: str, status_code: int = 200) -> None:
        self._pieces = pieces
        size = sum(len(piece) for piece in pieces)
        super().__init__(b"", status_code=status_code)
        self.raw_headers = [(name, value) for name, value in self.raw_headers if name != b"content-length"]
        self.raw_headers.append((b"content-length", str(size).encode()))
        self._release = shares.keep(tenant, size)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send_in_pieces(send, self.status_code, self.raw_headers, self._pieces)
        finally:
            self._pieces = []
            self._release()

    def __del__(self) -> None:  # never sent (an error on the way out): not counted for ever
        self._release()
