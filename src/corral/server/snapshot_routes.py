"""Snapshots through the server: take one of a sandbox, list and remove yours, fork a sandbox.

A snapshot belongs to the tenant that took it: another tenant's id is answered like a missing one
(404).  The bytes a tenant's snapshots take in the store count against
``max_snapshot_bytes_per_tenant``; a snapshot that would pass it is refused (429,
``resource_limit``) and nothing of it is kept.  ``POST /v1/sandboxes`` with ``"snapshot": ID``
starts a sandbox from one (:mod:`.sandbox_routes`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from ..errors import InvalidSpec, ResourceLimit, SnapshotNotFound
from ..snapshots import Snapshot, SnapshotStore, fork_spec
from ..spec import format_size
from ..tiers import tier_class
from .context import Context, ServerContext, Tenant
from .wire import ForkBody

router = APIRouter()


def store(ctx: ServerContext) -> SnapshotStore:
    return SnapshotStore(ctx.manager.root)


def spec_fields(ctx: ServerContext, tenant: str, snapshot_id: str, data: dict[str, Any]) -> dict[str, Any]:
    """The spec fields a create from ``snapshot_id`` takes from it (after checking it is the tenant's)."""
    snapshot = store(ctx).get(snapshot_id, tenant)
    fixed = sorted(name for name in ("tier", "image") if data.get(name) not in (None, getattr(snapshot, name)))
    if fixed:
        raise InvalidSpec(f"{', '.join(fixed)}: a sandbox made from a snapshot has the snapshot's tier and image")
    return {"tier": snapshot.tier, "image": snapshot.image}


def _room(ctx: ServerContext, tenant: str, kept: bool = True) -> int:
    """Bytes the tenant's snapshots use (429 if there is no room left, in bytes or in number:
    snapshots share their contents, so a tenant's thousands of small ones stayed far below the
    bytes cap while each added its own directory and records to the host's disk).  A snapshot
    that is not ``kept`` (a fork's, removed before the fork returns) needs room in bytes only."""
    most = ctx.config.max_snapshots_per_tenant
    count = len(store(ctx).list(tenant)) + len(store(ctx).list(tenant, parked=True))
    if kept and count >= most:
        raise ResourceLimit(f"quota: tenant {tenant!r} holds {count} snapshots (max {most}); remove one first")
    cap = ctx.config.max_snapshot_bytes_per_tenant
    used = store(ctx).bytes_of(tenant)
    if used >= cap:
        raise ResourceLimit(f"quota: tenant {tenant!r} holds {format_size(used)} of snapshots "
                            f"(max {format_size(cap)}); remove one first")
    return used


def park(ctx: ServerContext, tenant: str, sandbox_id: str) -> None:
    """Pause the tenant's sandbox to disk (its state counts as a snapshot of the tenant's), with
    what the server needs to take it back after a restart (manager.recover)."""
    entry = ctx.manager.get(tenant, sandbox_id)
    _room(ctx, tenant)
    entry.sandbox._local().pause(to_disk=True, tenant=tenant, server={
        "tenant": tenant, "created": entry.created, "expires_at": entry.expires_at,
        "idle_timeout": entry.idle_timeout, "metadata": entry.metadata})


def take(ctx: ServerContext, tenant: str, sandbox_id: str, kept: bool = True) -> Snapshot:
    """Snapshot the tenant's sandbox, within its snapshot quota (blocking: call on a worker thread;
    ``kept`` as for ``_room``)."""
    entry = ctx.manager.get(tenant, sandbox_id)
    snapshots = store(ctx)
    cap = ctx.config.max_snapshot_bytes_per_tenant
    entry.sandbox._local().tier_sandbox()  # paused to disk: 409 sandbox_paused, before any quota's 429
    used = _room(ctx, tenant, kept)
    snapshot = entry.sandbox._local().snapshot(tenant)
    if used + snapshot.size > cap:  # (an upper bound while a live snapshot's memory image is written)
        snapshot = snapshots.whole(snapshot.id, tenant)  # its real size
    if used + snapshot.size > cap:
        snapshots.delete(snapshot.id, tenant)
        raise ResourceLimit(f"quota: a snapshot of {format_size(snapshot.size)} does not fit in tenant "
                            f"{tenant!r}'s {format_size(cap - used)} left of {format_size(cap)} for snapshots")
    return snapshot


@router.post("/v1/sandboxes/{sandbox_id}/snapshot", status_code=201,
             summary="Snapshot a sandbox (its files on process and gVisor, its live state on microvm; 409 on wasm)")
async def snapshot_sandbox(sandbox_id: str, who: Tenant, ctx: Context) -> dict[str, Any]:
    return (await ctx.run_for(who, take, ctx, who, sandbox_id)).to_dict()


@router.get("/v1/snapshots", summary="List your snapshots")
async def list_snapshots(who: Tenant, ctx: Context) -> dict[str, Any]:
    return {"snapshots": [s.to_dict() for s in await ctx.run_for(who, store(ctx).list, who)]}


@router.delete("/v1/snapshots/{snapshot_id}", status_code=204, summary="Remove a snapshot of yours")
async def delete_snapshot(snapshot_id: str, who: Tenant, ctx: Context) -> Response:
    if not await ctx.run_for(who, store(ctx).delete, snapshot_id, who):
        raise SnapshotNotFound(f"no snapshot {snapshot_id!r}")
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201,
             summary="New sandboxes from a sandbox's files as they are now (fresh processes and identity)")
async def fork_sandbox(sandbox_id: str, body: ForkBody, who: Tenant, ctx: Context) -> dict[str, Any]:
    parent = ctx.manager.get(who, sandbox_id)
    if ctx.config.cluster is None and body.count <= tier_class(parent.spec.tier).direct_forks:
        # (a microVM: straight from the running VM, no snapshot; tiers/microvm/livefork.py)
        return {"sandboxes": [entry.to_dict() for entry in await ctx.manager.fork(who, parent, body.count)]}
    # the snapshot lives only until the forks are made: a tenant holding its most snapshots may fork
    snapshot = await ctx.run_for(who, take, ctx, who, sandbox_id, False)
    made = []
    try:
        for _ in range(body.count):
            made.append(await ctx.manager.create(who, fork_spec(parent.spec), snapshot=snapshot.id))
    except BaseException:
        for entry in made:
            await ctx.manager.destroy(who, entry.sandbox.id)
        raise
    finally:
        await ctx.run_for(who, store(ctx).delete, snapshot.id, who)
    return {"sandboxes": [entry.to_dict() for entry in made]}
