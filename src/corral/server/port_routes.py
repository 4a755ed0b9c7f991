"""``/v1/sandboxes/{id}/ports/{port}/…``: an HTTP and WebSocket reverse proxy into a port the
sandbox listens on (a dev server, Chromium's DevTools endpoint), for the owning tenant only.

Each sandbox port is reached through one forward the server keeps (``sandbox.ports.expose(port,
unix_socket=True)``: a 0600 Unix socket in the sandbox's run directory, through Corral's host
side, whatever the sandbox's network mode); it closes with the sandbox.  Requests go to the
sandbox as ``Host: 127.0.0.1:PORT`` (what a server listening on its loopback expects; Chromium's
DevTools refuses other hosts), without the caller's ``Authorization`` (the API key never
reaches the sandbox) and without hop-by-hop headers.  Another tenant's sandbox, like a missing
one, is a 404 (a WebSocket is closed with 4404).

What comes back is the sandbox's, on the server's own origin: a page a browser shows from here
would otherwise be same-origin with the API (read the sandbox list, run commands in the user's
other sandboxes, read their files) and could register a service worker over the whole origin.
So every answer is served as a sandboxed page (``Content-Security-Policy: sandbox``, without
``allow-same-origin``: an opaque origin, whose requests say ``Origin: null`` and are refused by a
keyless server's guard and unreadable to it), beside any policy the sandbox sent, and the headers
that act on the whole origin (``Service-Worker-Allowed``, ``Clear-Site-Data``) are dropped.

Cookies ignore ports: a browser sends every ``127.0.0.1`` cookie of every local app (a Jupyter
server's login among them) with a request here, and a cookie set here would reach them all. So
on this path the sandbox's cookies are its own: one it sets is renamed
``corral-PORT-ID-NAME``, scoped to this port's path and stripped of any ``Domain``, and of
the cookies a request carries only those go to the sandbox, under their own names.

For a browser, each sandbox port also has an origin of its own: ``http://PORT-ID.localhost:
SERVERPORT/`` (browsers resolve every ``*.localhost`` name to the loopback themselves, RFC 6761)
is the same proxy (:class:`PortOrigins`), served as the sandbox sent it -- an app that needs its
origin (its own ``fetch``es, module scripts, ``localStorage``, a dev server's WebSocket) works
there, and that origin is neither the API's nor another sandbox's nor another port's: a keyless
server's guard refuses its requests anywhere but on itself, and every path under it is the
sandbox's (the API is not reachable under that name).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..errors import InvalidSpec, ResourceLimit, SandboxError
from .context import Context, ServerContext, Tenant, context_of
from .limits import once
from .wire import status_for

if TYPE_CHECKING:
    from ..ports import ExposedPort
    from .manager import Entry

router = APIRouter()
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
#: headers that belong to one hop (RFC 9110 7.6.1), the caller's credentials, and what httpx sets
_DROP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
         "transfer-encoding", "upgrade", "host", "authorization", "content-length"}
#: what a sandbox's answer may not do to the server's origin
_ORIGIN_WIDE = {"service-worker-allowed", "clear-site-data"}
#: scripts, forms and pop-ups work; the page's origin is opaque (no ``allow-same-origin``)
SANDBOXED_PAGE = (b"sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads "
                  b"allow-pointer-lock allow-presentation")
_WS_DROP = _DROP | {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                    "sec-websocket-protocol", "origin"}

@dataclass
class _Forward:
    """One port the server forwards into a sandbox, and the proxy's HTTP transport into it."""

    exposed: ExposedPort
    #: made once per forward: an httpx client made per request spent ~40 ms of the event loop in
    #: TLS setup (its CA bundle) and kept ~1 MB that was never given back (1,000 requests: +1 GB).
    #: No TLS (it reaches a Unix socket) and no kept-alive connections: each open one holds two
    #: relay threads of the forward
    transport: httpx.AsyncHTTPTransport


_forwards: dict[tuple[str, int], _Forward] = {}
_lock = threading.Lock()
#: how long the sandbox's server may take to answer, or to send the next piece of its answer
UPSTREAM_TIMEOUT = httpx.Timeout(60).as_dict()
#: forwards the server keeps into one sandbox (each holds a listening socket and a thread until the
#: sandbox is destroyed: asking for 500 ports held 500 threads, and nothing bounded them)
MAX_FORWARDS_PER_SANDBOX = 16


#: ``PORT-ID.localhost`` (a trailing dot and any port after it allowed; matched lower-cased)
_PORT_ORIGIN = re.compile(r"(\d{1,5})-(sb-[0-9a-f]{16})\.localhost\.?(?::\d+)?")
#: set in the scope of a request that came through a port's own origin
OWN_ORIGIN = "corral.port_origin"


class PortOrigins:
    """ASGI middleware: a request whose ``Host`` is ``PORT-ID.localhost`` is the port proxy's,
    whatever its path (``/x`` there is ``/v1/sandboxes/ID/ports/PORT/x``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((value for name, value in scope["headers"] if name == b"host"), b"")
            match = _PORT_ORIGIN.fullmatch(host.decode("latin-1").lower())
            if match is not None:
                prefix = f"/v1/sandboxes/{match[2]}/ports/{int(match[1])}"
                scope = {**scope, "path": prefix + scope["path"], OWN_ORIGIN: True,
                         "raw_path": prefix.encode() + (scope.get("raw_path") or scope["path"].encode())}
        await self.app(scope, receive, send)


def _sandbox_cookie(value: bytes, prefix: str, path: str | None) -> bytes:
    """A ``Set-Cookie`` of the sandbox's: without ``Domain``; with ``path`` (this port's path on
    the server), its name gets ``prefix`` and its ``Path`` goes below that path."""
    first, *attributes = value.split(b";")
    kept = []
    for attribute in attributes:
        name, _, rest = attribute.strip().partition(b"=")
        if name.lower() == b"domain":
            continue  # host-only: never a parent domain's, never another port's host
        if name.lower() == b"path" and path is not None:
            attribute = b" Path=" + path.rstrip("/").encode() + (rest if rest.startswith(b"/") else b"/")
        kept.append(attribute)
    if path is not None:
        first = prefix.encode() + first.lstrip()
        if not any(a.strip().lower().startswith(b"path=") for a in kept):
            kept.append(b" Path=" + path.encode())
    return b";".join([first, *kept])


def cookie_prefix(sandbox_id: str, port: int) -> str:
    """What the path form puts before the name of each cookie a sandbox's port sets."""
    return f"corral-{port}-{sandbox_id}-"


def _own_cookies(values: list[bytes], prefix: str) -> bytes | None:
    """Of the cookies a request carries on the path form, the sandbox's own (``prefix`` removed)."""
    own = [c.strip()[len(prefix):] for v in values for c in v.split(b";")
           if c.strip().startswith(prefix.encode())]
    return b"; ".join(own) if own else None


def _check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise InvalidSpec(f"port {port} must be 1-65535")


def _forward(entry: Entry, port: int) -> tuple[_Forward, list[httpx.AsyncHTTPTransport]]:
    """This server's forward into ``port`` of ``entry``'s sandbox (made once), and the transports of
    forwards whose sandboxes have gone since (for the caller to close on the event loop)."""
    import os

    key = (entry.sandbox.id, port)
    with _lock:
        # their sandbox was destroyed (the forward closed with it)
        stale = [k for k, v in _forwards.items() if v.exposed.unix_socket and not os.path.exists(v.exposed.unix_socket)]
        gone = [_forwards.pop(k).transport for k in stale]
        forward = _forwards.get(key)
        if forward is None:
            if sum(k[0] == key[0] for k in _forwards) >= MAX_FORWARDS_PER_SANDBOX:
                raise ResourceLimit(f"sandbox {key[0]} already has {MAX_FORWARDS_PER_SANDBOX} ports forwarded "
                                    f"(the server's most per sandbox); use one of those ports")
            exposed = entry.sandbox.ports.expose(port, unix_socket=True)
            assert exposed.unix_socket is not None
            transport = httpx.AsyncHTTPTransport(uds=exposed.unix_socket, verify=False, trust_env=False,
                                                 limits=httpx.Limits(max_keepalive_connections=0))
            forward = _forwards[key] = _Forward(exposed, transport)
    return forward, gone


class _Relayed(StreamingResponse):
    """A sandbox's answer, streamed on; what it holds (its connection into the sandbox, the tenant's
    place among its proxied requests) is given back once it is sent, or its caller has gone."""

    def __init__(self, upstream: httpx.Response, done: Callable[[], None]) -> None:
        self._upstream, self._done = upstream, done
        super().__init__(self._relay(), status_code=upstream.status_code)

    async def _relay(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._upstream.aiter_raw():
                yield chunk
        finally:  # before the answer's end is sent: its client may ask again as soon as it has it
            await self._release()

    async def _release(self) -> None:
        try:
            await self._upstream.aclose()
        finally:
            self._done()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # (a caller that left before all of it was sent)
            await self._release()


def _target(path: str, query: str) -> str:
    """The request target inside the sandbox: the path re-quoted (it arrives decoded), the query as sent."""
    return "/" + quote(path, safe="/:@!$&'()*+,;=-._~") + (f"?{query}" if query else "")


@router.api_route("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}", methods=METHODS,
                  summary="Proxy an HTTP request to a port the sandbox listens on")
async def proxy_http(sandbox_id: str, port: int, path: str, request: Request, who: Tenant,
                     ctx: Context) -> Response:
    _check_port(port)
    entry = ctx.manager.get(who, sandbox_id)  # another tenant's: 404 before any count
    if not ctx.proxied_requests.take(who, 1):
        raise ResourceLimit(f"tenant {who} has {ctx.config.max_proxied_requests_per_tenant} requests under way "
                            "through the port proxy (the server's max_proxied_requests_per_tenant): "
                            "wait for one to end")
    done = once(functools.partial(ctx.proxied_requests.give, who, 1))
    try:
        return await _relay(entry, port, path, request, who, ctx, done)
    except BaseException:
        done()
        raise


async def _relay(entry: Entry, port: int, path: str, request: Request, who: str, ctx: ServerContext,
                 done: Callable[[], None]) -> Response:
    """Pass ``request`` on to the sandbox's ``port``; the answer streamed back calls ``done`` when it ends."""
    sandbox_id = entry.sandbox.id
    forward, gone = await ctx.run_for(who, _forward, entry, port)
    for transport in gone:
        await transport.aclose()
    own_origin = bool(request.scope.get(OWN_ORIGIN))
    prefix, cookie_path = cookie_prefix(sandbox_id, port), f"/v1/sandboxes/{sandbox_id}/ports/{port}/"
    # raw bytes both ways: a header is passed on as it came (Latin-1 and all), never re-encoded
    headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _DROP
               and (own_origin or k.lower() != b"cookie")]
    if not own_origin and (own := _own_cookies([v for k, v in request.headers.raw if k.lower() == b"cookie"],
                                               prefix)):
        headers.append((b"cookie", own))
    headers.append((b"host", f"127.0.0.1:{port}".encode()))
    url = f"http://127.0.0.1:{port}" + _target(path, request.url.query)
    try:
        # straight to the transport, not through a client: a client shared by the forward's callers
        # would keep the cookies one caller's answer set and send them with the next caller's requests
        upstream = httpx.Request(request.method, url, headers=headers, content=await request.body(),
                                 extensions={"timeout": UPSTREAM_TIMEOUT})
    except (httpx.InvalidURL, ValueError) as exc:
        raise InvalidSpec(f"cannot pass this request on: {exc}") from None
    try:
        response = await forward.transport.handle_async_request(upstream)
    except httpx.HTTPError as exc:
        done()
        return Response(f"nothing answered on port {port} of sandbox {sandbox_id}: {exc}\n", status_code=502,
                        media_type="text/plain")
    answer = _Relayed(response, done)
    # raw, not a dict: headers sent more than once (Set-Cookie) stay apart, as sent
    answer.raw_headers = [(k, _sandbox_cookie(v, prefix, None if own_origin else cookie_path)
                           if k.lower() == b"set-cookie" else v) for k, v in response.headers.raw
                          if k.decode("latin-1").lower() not in (_DROP - {"content-length"}) | _ORIGIN_WIDE]
    if not own_origin:  # on the API's origin: a sandboxed page
        answer.raw_headers.append((b"content-security-policy", SANDBOXED_PAGE))
    return answer


@router.websocket("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}")
async def proxy_websocket(websocket: WebSocket, sandbox_id: str, port: int, path: str) -> None:
    ctx = context_of(websocket)
    try:
        _check_port(port)
        tenant = ctx.tenant_of(websocket.headers.get("authorization"))
        entry = ctx.manager.get(tenant, sandbox_id)
        forward, gone = await ctx.run_for(tenant, _forward, entry, port)
    except SandboxError as exc:  # as the exec stream does: accepted, then closed with 4000 + the HTTP status
        await websocket.accept()
        await websocket.close(code=4000 + status_for(exc), reason=str(exc)[:120])
        return
    for transport in gone:
        await transport.aclose()
    socket_path = forward.exposed.unix_socket
    assert socket_path is not None
    # what a proxied WebSocket holds of the sandbox's messages is bounded per tenant: 4 of them
    # that never read held 1 GB of the server (each up to 4 messages of 64 MiB), and nothing but
    # max_requests_per_tenant (1024) bounded how many a tenant opened
    if not ctx.proxied_websockets.take(tenant, 1):  # accepted and closed, as the exec stream refuses: the caller learns why
        await websocket.accept()
        await websocket.close(code=1013, reason=f"{ctx.config.max_proxied_websockets_per_tenant} WebSockets "
                                                "through the port proxy are open already")
        return
    try:
        await _proxy_websocket(websocket, ctx, tenant, sandbox_id, port, path, socket_path)
    finally:
        ctx.proxied_websockets.give(tenant, 1)


async def _proxy_websocket(websocket: WebSocket, ctx: ServerContext, tenant: str, sandbox_id: str, port: int, path: str,
                           socket_path: str) -> None:
    from websockets.asyncio.client import unix_connect
    from websockets.exceptions import ConnectionClosed

    own_origin = bool(websocket.scope.get(OWN_ORIGIN))
    headers = [(k, v) for k, v in websocket.headers.items() if k.lower() not in _WS_DROP
               and (own_origin or k.lower() != "cookie")]
    if not own_origin and (own := _own_cookies([v for k, v in websocket.headers.raw if k.lower() == b"cookie"],
                                               cookie_prefix(sandbox_id, port))):
        headers.append(("cookie", own.decode("latin-1")))
    protocols = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    uri = f"ws://127.0.0.1:{port}" + _target(path, websocket.url.query)
    try:
        # what the sandbox sends is bounded: one message at most max_proxied_message_bytes, and at
        # most one more waiting while one is sent on (websockets holds a message whole)
        upstream = await unix_connect(socket_path, uri, additional_headers=headers,
                                      max_size=ctx.config.max_proxied_message_bytes, max_queue=1,
                                      subprotocols=protocols or None, open_timeout=30)  # type: ignore[arg-type]
    except Exception as exc:  # any handshake failure: refused, timed out, not a WebSocket
        await websocket.close(code=1011, reason=f"port {port}: {exc}"[:120])
        return
    await websocket.accept(subprotocol=upstream.subprotocol)

    closing: list[tuple[int, str]] = []

    async def down() -> None:  # sandbox -> caller
        try:
            async for message in upstream:
                # held until the caller's side has taken it: counted with the tenant's messages
                size = len(message) if isinstance(message, bytes) else 4 * len(message)  # (text: at most 4 bytes a character)
                if not ctx.ws_messages.take(tenant, size):
                    closing.append((1009, "the tenant's WebSocket messages held by the server are past "
                                          f"{ctx.config.max_request_bytes_per_tenant} bytes"))
                    return
                try:
                    if isinstance(message, bytes):
                        await websocket.send_bytes(message)
                    else:
                        await websocket.send_text(message)
                finally:
                    del message
                    ctx.ws_messages.give(tenant, size)
        except ConnectionClosed as exc:
            if exc.sent is not None and exc.sent.code == 1009:  # the caller learns why, as the sandbox did
                closing.append((1009, f"a message from port {port} was over the server's "
                                      f"{ctx.config.max_proxied_message_bytes} bytes"))
            raise

    async def up() -> None:  # caller -> sandbox
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("bytes") is not None:
                await upstream.send(message["bytes"])
            elif message.get("text") is not None:
                await upstream.send(message["text"])

    tasks = [asyncio.create_task(down()), asyncio.create_task(up())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosed, WebSocketDisconnect, Exception):
                await task
        await upstream.close()
        with contextlib.suppress(Exception):
            code, reason = closing[0] if closing else (1000, "")
            await websocket.close(code=code, reason=reason[:120])
