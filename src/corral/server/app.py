"""The HTTP API (FastAPI): REST under ``/v1``, a WebSocket for streaming exec,
``/openapi.json`` and ``/metrics``.

The routes are routers (:mod:`.sandbox_routes`, :mod:`.file_routes`,
:mod:`.stream`, :mod:`.ops_routes`) over one :class:`~.context.ServerContext`;
what travels on the wire is in :mod:`.wire`.
Blocking sandbox work runs on the context's thread pool (creation too: each
tier owns the thread its sandboxes' processes hang on, so any thread may create).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InvalidSpec, SandboxError
from . import command_routes, file_routes, ops_routes, port_routes, sandbox_routes, snapshot_routes, stream
from .config import ServerConfig
from .context import ServerContext, context_of
from .fast_routes import FastRoutes
from .host_guard import LoopbackCallersOnly
from .limits import BodySizeLimit, TenantRequests
from .wire import JSON_TOO_DEEP, error_response, status_for


def create_app(config: ServerConfig) -> FastAPI:
    context = ServerContext(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        context.start()
        try:
            yield
        finally:
            await context.shutdown()

    # no /docs or /redoc page: FastAPI's load their scripts from a CDN, and a page of the server's
    # own origin may drive the API (host_guard lets it), so a script from elsewhere would have
    # had every sandbox of a keyless server (and the key typed into the page of one with keys)
    app = FastAPI(title="Corral", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Isolated, ephemeral, resource-limited sandboxes for AI agents.")
    app.state.context = context
    # the fast routes run inside the size limit: the last middleware added is the outermost
    app.add_middleware(FastRoutes, error_handlers=ERROR_HANDLERS)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes, tenant_of=context.tenant_of,
                       max_per_tenant=config.max_request_bytes_per_tenant, small_body_timeout=config.request_head_timeout)
    if config.auth_required:  # tenants to keep apart (without keys, every request is the one local tenant's)
        app.add_middleware(TenantRequests, tenant_of=context.tenant_of, max_per_tenant=config.max_requests_per_tenant)
    app.add_middleware(port_routes.PortOrigins)  # PORT-ID.localhost: the port proxy, whatever the path
    if not config.auth_required:  # outermost: a web page's request goes no further (host_guard)
        app.add_middleware(LoopbackCallersOnly, also=[int(uid) for uid in config.local_users])
    for handled, handler in ERROR_HANDLERS:
        app.add_exception_handler(handled, handler)
    for module in (sandbox_routes, command_routes, file_routes, stream, ops_routes, port_routes, snapshot_routes):
        app.include_router(module.router)
    return app


# -- every error is {"error": code, "message": text} -------------------------------------
async def _sandbox_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SandboxError)
    status = status_for(exc)
    if status == 429:
        context_of(request).metrics.quota_refusals.inc()
    return error_response(status, exc.code, str(exc))


async def _unicode_error(_: Request, exc: Exception) -> JSONResponse:
    # JSON may carry lone surrogates ("\ud800"): no argv, path or file can hold them
    return error_response(400, InvalidSpec.code, f"text is not valid Unicode (lone surrogate?): {exc}")


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: {err.get('msg')}"
        for err in exc.errors()[:5]
    )
    return error_response(422, InvalidSpec.code, f"invalid request: {problems}")


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    # FastAPI's 400 is a body it could not parse: the SDK raises InvalidSpec for it
    code = {400: InvalidSpec.code, 404: "not_found", 405: "method_not_allowed",
            413: "resource_limit"}.get(exc.status_code, "http_error")
    message = str(exc.detail)
    if isinstance(exc.__cause__, RecursionError):
        message = f"body: {JSON_TOO_DEEP}"
    return error_response(exc.status_code, code, message)


ERROR_HANDLERS = ((SandboxError, _sandbox_error), (UnicodeError, _unicode_error),
                  (RequestValidationError, _validation_error), (StarletteHTTPException, _http_error))
