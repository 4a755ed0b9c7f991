"""The HTTP API (FastAPI): REST under ``/v1``, a WebSocket for streaming exec,
``/openapi.json`` and ``/metrics``.

Every error is a JSON object ``{"error": code, "message": text}`` whose code is
a :mod:`corral.errors` code, so the remote SDK raises the same exception the
embedded library would.  Blocking sandbox work runs on a dedicated thread
pool; sandbox creation runs on the long-lived launcher threads (see
:mod:`corral.pool`).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Query, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (
    FileError,
    FileNotFoundInSandbox,
    HostNotSupported,
    InvalidSpec,
    ResourceLimit,
    SandboxClosed,
    SandboxError,
    SandboxNotFound,
    Unauthorized,
)
from ..spec import SandboxSpec
from .config import ANONYMOUS_TENANT, ServerConfig
from .limits import BodySizeLimit
from .manager import SandboxManager
from .metrics import Metrics

if TYPE_CHECKING:
    from ..tiers.base import ExecResult

T = TypeVar("T")
BLOCKING_THREADS = 128
MAX_DOWNLOAD = 64 << 20


def status_for(exc: SandboxError) -> int:
    for cls, status in ((Unauthorized, 401), (SandboxNotFound, 404), (FileNotFoundInSandbox, 404),
                        (InvalidSpec, 400), (ResourceLimit, 429), (SandboxClosed, 410), (FileError, 400),
                        (HostNotSupported, 503)):
        if isinstance(exc, cls):
            return status
    return 500


def error_response(status: int, code: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": code, "message": message}, status_code=status, headers=headers)


# -- request bodies (unknown fields are refused by name) -----------------------
class CreateSandbox(BaseModel):
    """A sandbox spec (as ``SandboxSpec.from_dict``) plus its lifetimes."""

    model_config = ConfigDict(extra="allow")
    image: str | None = None
    tier: str | None = None
    limits: dict[str, int | float | str] | None = None
    env: dict[str, str] | None = None
    network: Any = None
    cwd: str | None = None
    idle_timeout: float | None = Field(None, description="seconds without use before the sandbox is destroyed")
    lifetime: float | None = Field(None, description="seconds from creation before the sandbox is destroyed")


class ExecBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cmd: str | list[str]
    timeout: float | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    stdin: str | None = None


class StreamExecBody(ExecBody):
    """The exec stream's first frame: an exec request, optionally on a terminal of ``pty=[rows, cols]``."""

    pty: tuple[int, int] | None = None


class TimeoutBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(description="seconds from now until the sandbox is destroyed")


_bearer = HTTPBearer(auto_error=False)


async def _tenant(request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str:
    """The caller's tenant (declared through HTTPBearer so the OpenAPI document shows the scheme)."""
    tenant_of: Callable[[str | None], str] = request.app.state.tenant_of
    return tenant_of(request.headers.get("authorization"))


Tenant = Annotated[str, Depends(_tenant)]


def require_unicode(value: Any, where: str = "body") -> None:
    """JSON may carry lone surrogates ("\\ud800"); no argv, environment, path or answer can hold them."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise InvalidSpec(f"{where}: text is not valid Unicode (a lone surrogate)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            require_unicode(key, where)
            require_unicode(item, f"{where}.{key}" if isinstance(key, str) and key.isprintable() else where)
    elif isinstance(value, (list, tuple)):
        for item in value:
            require_unicode(item, where)


def checked_path(path: str) -> str:
    """A sandbox path from a request: no NUL, no '..' component (nothing may walk out of where it names)."""
    if not path or "\0" in path:
        raise InvalidSpec("path: must be a non-empty path without NUL bytes")
    require_unicode(path, "path")
    if ".." in path.split("/"):
        raise InvalidSpec(f"path {path!r}: '..' components are not allowed")
    if len(path.encode()) > 4000:
        raise InvalidSpec("path: longer than 4000 bytes")
    return path


def create_app(config: ServerConfig) -> FastAPI:
    metrics = Metrics()
    state: dict[str, Any] = {}
    blocking = ThreadPoolExecutor(max_workers=BLOCKING_THREADS, thread_name_prefix="corral-api")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        manager = SandboxManager(config, metrics)
        state["manager"] = manager
        manager.start()
        try:
            yield
        finally:
            await manager.shutdown()
            blocking.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Corral", version="1", lifespan=lifespan,
                  description="Isolated, ephemeral, resource-limited sandboxes for AI agents.")
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    app.state.metrics = metrics
    app.state.state = state

    async def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(blocking, functools.partial(fn, *args, **kwargs))

    app.state.run_blocking = run_blocking

    def manager() -> SandboxManager:
        return state["manager"]  # type: ignore[no-any-return]

    def tenant_of(authorization: str | None) -> str:
        if not config.auth_required:
            return ANONYMOUS_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        tenant = config.tenant_for(key.strip()) if scheme.lower() == "bearer" and key.strip() else None
        if tenant is None:
            raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer KEY'")
        return tenant

    app.state.tenant_of = tenant_of
    app.state.manager = manager

    # -- errors ------------------------------------------------------------------
    @app.exception_handler(SandboxError)
    async def sandbox_error(_: Request, exc: SandboxError) -> JSONResponse:
        status = status_for(exc)
        if status == 429:
            metrics.quota_refusals.inc()
        return error_response(status, exc.code, str(exc))

    @app.exception_handler(UnicodeError)
    async def unicode_error(_: Request, exc: UnicodeError) -> JSONResponse:
        # JSON may carry lone surrogates ("\ud800"): no argv, path or file can hold them
        return error_response(400, InvalidSpec.code, f"text is not valid Unicode (lone surrogate?): {exc}")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: {err.get('msg')}"
            for err in exc.errors()[:5]
        )
        return error_response(422, InvalidSpec.code, f"invalid request: {problems}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "resource_limit"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail))

    # -- sandboxes ---------------------------------------------------------------
    @app.post("/v1/sandboxes", status_code=201, summary="Create a sandbox")
    async def create_sandbox(body: CreateSandbox, who: Tenant) -> dict[str, Any]:
        data = body.model_dump(exclude_unset=True)
        require_unicode(data)
        idle, life = data.pop("idle_timeout", None), data.pop("lifetime", None)
        spec = SandboxSpec.from_dict(data)
        entry = await manager().create(who, spec, idle, life)
        if entry.from_pool:
            metrics.pool_hits.inc()
        return entry.to_dict()

    @app.get("/v1/sandboxes", summary="List your sandboxes")
    async def list_sandboxes(who: Tenant) -> dict[str, Any]:
        return {"sandboxes": [e.to_dict() for e in manager().owned_by(who)]}

    @app.get("/v1/sandboxes/{sandbox_id}", summary="Describe a sandbox")
    async def get_sandbox(sandbox_id: str, who: Tenant) -> dict[str, Any]:
        return manager().get(who, sandbox_id).to_dict()

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204, summary="Destroy a sandbox")
    async def delete_sandbox(sandbox_id: str, who: Tenant) -> Response:
        await manager().destroy(who, sandbox_id)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/timeout", summary="Set the time left before the sandbox is destroyed")
    async def set_timeout(sandbox_id: str, body: TimeoutBody, who: Tenant) -> dict[str, Any]:
        entry = manager().get(who, sandbox_id)
        manager().extend(entry, body.timeout)
        return entry.to_dict()

    @app.post("/v1/sandboxes/{sandbox_id}/exec", summary="Run a command to completion")
    async def exec_command(sandbox_id: str, body: ExecBody, who: Tenant) -> dict[str, Any]:
        entry = manager().get(who, sandbox_id)
        require_unicode(body.model_dump())

        def run_and_audit() -> ExecResult:
            # one trip to a worker thread, not two: each hop costs a thread wake-up on the exec path
            with manager().exec_slot(entry):
                result = entry.sandbox.commands.run(body.cmd, timeout=body.timeout, env=body.env,
                                                    cwd=body.cwd, stdin=body.stdin)
            manager().audit(entry)  # counts new egress refusals
            return result

        result = await run_blocking(run_and_audit)
        metrics.record_exec(result.timed_out, result.oom_killed)
        return {"sandbox_id": sandbox_id, **result.to_dict()}

    @app.get("/v1/sandboxes/{sandbox_id}/network/audit", summary="Egress refusals and withheld secrets so far")
    async def network_audit(sandbox_id: str, who: Tenant) -> dict[str, Any]:
        entry = manager().get(who, sandbox_id)
        return {"events": await run_blocking(manager().audit, entry)}

    # the code interpreter (corral.interpreter): one cell per call
    @app.post("/v1/sandboxes/{sandbox_id}/code", summary="Run code in the sandbox's interpreter (if available)")
    async def run_code(sandbox_id: str, body: dict[str, Any], who: Tenant) -> dict[str, Any]:
        entry = manager().get(who, sandbox_id)
        run = getattr(entry.sandbox, "run_code", None)
        if run is None:
            raise InvalidSpec("run_code is not available in this build of Corral")
        with manager().exec_slot(entry):
            try:
                result = await run_blocking(run, **body)
            except TypeError as exc:
                raise InvalidSpec(f"run_code: {exc}") from None
        return result.to_dict() if hasattr(result, "to_dict") else {"result": result}

    # -- files -------------------------------------------------------------------
    files = "/v1/sandboxes/{sandbox_id}/files"

    @app.get(files, summary="List a directory")
    async def list_files(sandbox_id: str, who: Tenant, path: str = "/workspace") -> dict[str, Any]:
        entry = manager().get(who, sandbox_id)
        entries = await run_blocking(entry.sandbox.files.list, checked_path(path))
        return {"path": path, "entries": [e.to_dict() for e in entries]}

    @app.get(files + "/stat", summary="Describe one file")
    async def stat_file(sandbox_id: str, who: Tenant, path: Annotated[str, Query()]) -> dict[str, Any]:
        entry = manager().get(who, sandbox_id)
        return (await run_blocking(entry.sandbox.files.stat, checked_path(path))).to_dict()

    @app.get(files + "/content", summary="Download a file", response_class=Response,
             responses={200: {"content": {"application/octet-stream": {}}}})
    async def download(sandbox_id: str, who: Tenant, path: Annotated[str, Query()]) -> Response:
        entry = manager().get(who, sandbox_id)
        data = await run_blocking(entry.sandbox.files.read, checked_path(path), format="bytes", max_bytes=MAX_DOWNLOAD)
        return Response(data, media_type="application/octet-stream")

    @app.put(files + "/content", status_code=204, summary="Upload a file (raw body)",
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
    async def upload(sandbox_id: str, request: Request, who: Tenant, path: Annotated[str, Query()],
                     mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644) -> Response:
        entry = manager().get(who, sandbox_id)
        data = await request.body()
        await run_blocking(entry.sandbox.files.write, checked_path(path), data, mode)
        return Response(status_code=204)

    @app.delete(files, status_code=204, summary="Remove a file or directory")
    async def remove_file(sandbox_id: str, who: Tenant, path: Annotated[str, Query()],
                          recursive: bool = False) -> Response:
        entry = manager().get(who, sandbox_id)
        await run_blocking(entry.sandbox.files.remove, checked_path(path), recursive)
        return Response(status_code=204)

    @app.post(files + "/dir", status_code=204, summary="Make a directory (and its parents)")
    async def make_dir(sandbox_id: str, who: Tenant, path: Annotated[str, Query()]) -> Response:
        entry = manager().get(who, sandbox_id)
        await run_blocking(entry.sandbox.files.make_dir, checked_path(path))
        return Response(status_code=204)

    # -- streaming, health, metrics ---------------------------------------------
    @app.websocket("/v1/sandboxes/{sandbox_id}/exec/stream")
    async def exec_stream(websocket: WebSocket, sandbox_id: str) -> None:
        from .stream import serve_exec_stream

        await serve_exec_stream(app, websocket, sandbox_id)

    @app.get("/healthz", summary="Liveness")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "pid": os.getpid()}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}}})
    async def prometheus(_: Tenant) -> Response:
        metrics.pool_idle.set(sum(pool.idle_count() for pool in manager().pools.pools()))
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
