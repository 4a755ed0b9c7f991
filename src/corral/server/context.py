"""The one object every route works through: configuration, metrics, the sandbox manager,
the thread pool for blocking sandbox work, and who the caller is.

``create_app`` makes one :class:`ServerContext` and keeps it at ``app.state.context``;
routes ask for it with the :data:`Context` dependency and for the caller's tenant with
:data:`Tenant`.  The manager exists only between the app's startup and shutdown.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection
from starlette.responses import Response

from ..errors import ResourceLimit, Unauthorized
from . import trace
from .config import ANONYMOUS_TENANT, ServerConfig
from .limits import TenantTally, once
from .manager import Entry, SandboxManager
from .metrics import Metrics
from .output_shares import OutputShares, Release, Rendering, answer_of
from .snapshot_quota import SnapshotQuota

T = TypeVar("T")


#: shared threads one tenant's control calls may hold at once (:meth:`ServerContext.run_control`)
CONTROL_THREADS_PER_TENANT = 8


class ServerContext:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        #: threads for blocking sandbox work (commands, code cells, file transfers)
        self.blocking = ThreadPoolExecutor(max_workers=config.blocking_threads, thread_name_prefix="corral-api")
        #: each tenant's share of those threads (made on the loop, on first use)
        self._shares: dict[str, asyncio.Semaphore] = {}
        self._control_shares: dict[str, asyncio.Semaphore] = {}
        #: bytes of downloads each tenant has in flight
        self._downloads = TenantTally(config.max_download_bytes_per_tenant)
        #: output each tenant's running commands may hold here (each counted at 2 x max_output)
        self.output_shares = OutputShares(config.max_output_bytes_per_tenant)
        #: output of each tenant's ended background commands kept for clients that attach
        self.kept_output = TenantTally(config.max_kept_output_per_tenant)
        #: bytes of each tenant's WebSocket messages held here: being received or not yet handled
        #: (stdin a command has not taken), bounded like request bodies (see .ws_protocol)
        self.ws_messages = TenantTally(config.max_request_bytes_per_tenant)
        #: WebSockets each tenant has open through the port proxy
        self.proxied_websockets = TenantTally(config.max_proxied_websockets_per_tenant)
        #: HTTP requests each tenant has under way through the port proxy
        self.proxied_requests = TenantTally(config.max_proxied_requests_per_tenant)
        #: each tenant's snapshots in flight, held against its snapshot quotas until they are stored
        self.snapshot_quota = SnapshotQuota(config.max_snapshots_per_tenant, config.max_snapshot_bytes_per_tenant)
        self._manager: SandboxManager | None = None
        #: fast-path responses carry a Server-Timing header (CORRAL_SERVER_TIMING=1; see .trace)
        self.timing = trace.enabled()

    @property
    def manager(self) -> SandboxManager:
        if self._manager is None:
            raise RuntimeError("the server has not started (its lifespan makes the manager)")
        return self._manager

    def start(self) -> None:
        self._manager = SandboxManager(self.config, self.metrics, self.run_for)
        self._manager.start()

    async def shutdown(self) -> None:
        try:
            if self._manager is not None:
                await self._manager.shutdown()
        finally:
            self.blocking.shutdown(wait=False, cancel_futures=True)

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        call = functools.partial(fn, *args, **kwargs)
        marks = trace.current()
        if marks is None:
            return await asyncio.get_running_loop().run_in_executor(self.blocking, call)
        trace.mark("handler", marks)

        def traced() -> T:
            trace.mark("to_thread", marks)
            try:
                return call()
            finally:
                trace.mark("work", marks)

        try:
            return await asyncio.get_running_loop().run_in_executor(self.blocking, traced)
        finally:
            trace.mark("to_loop", marks)

    async def run_for(self, tenant: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """:meth:`run_blocking` within ``tenant``'s share of the threads: past it, the tenant's own
        work waits (without a thread), never another tenant's."""
        return await self._run_within(self._shares, self.config.max_threads_per_tenant, tenant, fn, *args, **kwargs)

    async def run_control(self, tenant: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """:meth:`run_blocking` for a call that acts on what runs (a kill, a signal, pause, resume,
        a stream's stdin and controls, the audit): not behind the tenant's own long commands (it
        may be what ends them), but within ``CONTROL_THREADS_PER_TENANT`` of the shared threads.
        They took shared threads without a bound: one tenant's 140 signals to its paused sandbox
        (each waiting for its agent) held all 128, and every tenant's exec, listing and create waited."""
        return await self._run_within(self._control_shares, CONTROL_THREADS_PER_TENANT, tenant, fn, *args, **kwargs)

    async def describe(self, tenant: str, entries: Sequence[Entry], env: bool = True) -> list[dict[str, Any]]:
        """``entries`` as the API describes them.  A cluster's sandbox's state is a question to its
        node (two, each up to ``STATE_TIMEOUT``): asked on the event loop, a listing of one sandbox
        on a stopped node held every tenant's requests ~6 s.  So there they are asked within the
        tenant's control share of the threads; a local sandbox's is a read of memory, on the loop."""
        if self.config.cluster is None:
            return [entry.to_dict(env=env) for entry in entries]
        return await self.run_control(tenant, lambda: [entry.to_dict(env=env) for entry in entries])

    async def _run_within(self, shares: dict[str, asyncio.Semaphore], size: int, tenant: str,
                          fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """:meth:`run_blocking` holding one of ``tenant``'s ``size`` places in ``shares``."""
        share = shares.get(tenant)
        if share is None:
            share = shares[tenant] = asyncio.Semaphore(size)
        async with share:
            return await self.run_blocking(fn, *args, **kwargs)

    def answer(self, tenant: str, rendering: Rendering, hold: Release) -> Response:
        """The response for an answer rendered on ``tenant``'s thread, taking over ``hold`` (what
        its work was counted at): :func:`.output_shares.answer_of`, its rest rendered there too."""
        return answer_of(rendering, self.output_shares, tenant, hold, functools.partial(self.run_for, tenant))

    async def hold_output(self, tenant: str, max_output: int) -> Release:
        """Count a command that may print ``max_output`` per stream against ``tenant``'s
        ``max_output_bytes_per_tenant``, waiting (without a thread) until it fits; returns what
        gives it back when the command has ended and its output left the server."""
        return await self.output_shares.hold(tenant, 2 * max_output)

    def hold_download(self, tenant: str, size: int) -> Callable[[], None]:
        """Count ``size`` bytes against ``tenant``'s downloads in flight; returns what gives them back.
        Raises :class:`ResourceLimit` (429) past ``max_download_bytes_per_tenant``."""
        if not self._downloads.take(tenant, size):
            raise ResourceLimit(f"tenant {tenant} has {self._downloads.held.get(tenant, 0)} bytes of downloads in flight; "
                                f"{size} more is over the server's {self._downloads.limit} per tenant: read the ones "
                                "under way first")
        return once(functools.partial(self._downloads.give, tenant, size))

    def tenant_of(self, authorization: str | None) -> str:
        """The tenant an ``Authorization`` header names; raises :class:`Unauthorized` when it names none."""
        if not self.config.auth_required:
            return ANONYMOUS_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        tenant = self.config.tenant_for(key.strip()) if scheme.lower() == "bearer" and key.strip() else None
        if tenant is None:
            raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer KEY'")
        return tenant


def context_of(connection: HTTPConnection) -> ServerContext:
    """The context of the app serving ``connection`` (a request or a WebSocket)."""
    return connection.app.state.context  # type: ignore[no-any-return]


async def _context(request: Request) -> ServerContext:
    return context_of(request)


_bearer = HTTPBearer(auto_error=False)


async def _tenant(request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str:
    """The caller's tenant (declared through HTTPBearer so the OpenAPI document shows the scheme)."""
    return context_of(request).tenant_of(request.headers.get("authorization"))


Context = Annotated[ServerContext, Depends(_context)]
Tenant = Annotated[str, Depends(_tenant)]
