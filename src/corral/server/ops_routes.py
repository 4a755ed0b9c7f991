"""``/healthz`` and ``/metrics`` (Prometheus)."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Response

from .context import Context, Tenant
from .wire import error_response

router = APIRouter()


@router.get("/healthz", summary="Liveness")
async def healthz() -> dict[str, Any]:
    return {"ok": True, "pid": os.getpid()}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
async def prometheus(who: Tenant, ctx: Context) -> Response:
    if ctx.config.auth_required and who not in ctx.config.metrics_tenants:
        # the whole server's numbers: not one tenant's to read unless the operator says so
        return error_response(403, "forbidden", f"tenant {who} may not read /metrics: the server's "
                              "operator lists who may in metrics_tenants")
    ctx.metrics.pool_idle.set(sum(pool.idle_count() for pool in ctx.manager.pools.pools()))
    return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
