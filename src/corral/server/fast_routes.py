"""The hot requests of a sandbox's life, served without FastAPI's routing and dependency injection.

``POST /v1/sandboxes``, ``POST /v1/sandboxes/{id}/exec``, ``DELETE /v1/sandboxes/{id}`` and
``GET /healthz`` are what every pooled lifecycle pays for; through FastAPI each spent ~0.5 ms of
the event loop's time in route matching (linear over every route), dependency solving and
response validation before and after the handler (``bench/server.py --profile``).  This ASGI
middleware sits inside the request-size limit and calls the *same* route functions
(:mod:`.sandbox_routes`, :mod:`.ops_routes`) with the same checks in the same order:

* the caller's tenant (:meth:`.ServerContext.tenant_of`, the API key check) first;
* then the body, exactly as FastAPI reads it (``json.loads`` and the route's pydantic model);
* errors answered by the app's own handlers (:data:`.app.ERROR_HANDLERS`), so their status,
  body and headers are the same.

Anything else -- another route, another content type, a body that is not valid JSON or does
not validate -- goes to the FastAPI app untouched (with the body replayed), which answers it
as before (e.g. the 422 naming the bad field).  ``ServerConfig.fast_routes = False`` routes
these requests through FastAPI too (``bench/server.py --compare-routes``).

With ``CORRAL_SERVER_TIMING=1`` in the server's environment, a fast-path response carries a
``Server-Timing`` header of its phases (see :mod:`.trace`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import SandboxError
from . import ops_routes, sandbox_routes, trace
from .context import context_of
from .limits import replay_body
from .wire import CreateSandbox, ExecBody

PREFIX = "/v1/sandboxes"
Handler = Callable[[Request, str, str, Any], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


async def _create(request: Request, who: str, _: str, body: Any) -> Response:
    result = await sandbox_routes.create_sandbox(body, who, context_of(request), request)
    return JSONResponse(result, status_code=201)


async def _exec(request: Request, who: str, sandbox_id: str, body: Any) -> Response:
    return await sandbox_routes.exec_command(sandbox_id, body, who, context_of(request), request)


async def _destroy(request: Request, who: str, sandbox_id: str, _: Any) -> Response:
    return await sandbox_routes.delete_sandbox(sandbox_id, who, context_of(request))


def _route(method: str, path: str) -> tuple[Handler, type[BaseModel] | None, str] | None:
    """The fast handler for ``method path``, its body's model and the sandbox id in the path."""
    if not path.startswith(PREFIX):
        return None
    rest = path[len(PREFIX):]
    if rest == "":
        return (_create, CreateSandbox, "") if method == "POST" else None
    if rest[0] != "/":
        return None
    sandbox_id, _, tail = rest[1:].partition("/")
    if not sandbox_id:
        return None
    if method == "POST" and tail == "exec" and rest.count("/") == 2:
        return _exec, ExecBody, sandbox_id
    if method == "DELETE" and "/" not in rest[1:]:
        return _destroy, None, sandbox_id
    return None


def _is_json(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bool(value.lower() == b"application/json")
    return False


class FastRoutes:
    def __init__(self, app: ASGIApp, error_handlers: tuple[tuple[type[Exception], ErrorHandler], ...]) -> None:
        self.app = app
        self.error_handlers = error_handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = context_of(Request(scope)) if scope["type"] == "http" else None
        if ctx is None or not ctx.config.fast_routes:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "GET" and scope["path"] == "/healthz":  # the floor: no body, no caller
            await JSONResponse(await ops_routes.healthz())(scope, receive, send)
            return
        route = _route(scope["method"], scope["path"])
        if route is None:
            await self.app(scope, receive, send)
            return
        marks = trace.begin() if ctx.timing else None
        handler, model, sandbox_id = route
        body = await _read_body(receive)
        request = Request(scope, replay_body(body, receive))
        trace.mark("read")
        try:
            who = ctx.tenant_of(request.headers.get("authorization"))
            trace.mark("auth")
            parsed = None
            if model is not None:
                parsed = _parse(model, body) if _is_json(scope) else None
                if parsed is None:  # FastAPI says what is wrong with it, as before
                    trace.end()
                    await self.app(scope, replay_body(body, receive), send)
                    return
                trace.mark("parse")
            response = await handler(request, who, sandbox_id, parsed)
        except (SandboxError, UnicodeError) as exc:
            response = await self._error(request, exc)
        trace.mark("handler")
        if marks is not None:
            response.headers["server-timing"] = trace.header(trace.end())
        await response(scope, receive, send)

    async def _error(self, request: Request, exc: Exception) -> Response:
        for handled, handler in self.error_handlers:
            if isinstance(exc, handled):
                return await handler(request, exc)
        raise exc  # pragma: no cover - every caught class has a handler


def _parse(model: type[BaseModel], body: bytes) -> Any:
    """The body as FastAPI would have validated it, or None where FastAPI would refuse it."""
    try:
        return model.model_validate(json.loads(body))
    except (ValueError, ValidationError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    except RecursionError:  # nested too deep to parse: FastAPI's 400 (a RecursionError here was a 500)
        return None


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)
