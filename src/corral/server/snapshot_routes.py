"""Snapshots through the server: take one of a sandbox, list and remove yours, fork a sandbox.

A snapshot belongs to the tenant that took it: another tenant's id is answered like a missing one
(404).  The bytes a tenant's snapshots take in the store count against
``max_snapshot_bytes_per_tenant``, and their number against ``max_snapshots_per_tenant``; a
snapshot that would pass either is refused (429, ``resource_limit``) and nothing of it is kept,
also when many are requested at once (:mod:`.snapshot_quota`).  ``POST /v1/sandboxes`` with ``"snapshot": ID``
starts a sandbox from one (:mod:`.sandbox_routes`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from ..errors import InvalidSpec, ResourceLimit, SnapshotNotFound
from ..snapshots import Snapshot, SnapshotStore, bytes_at_most, fork_spec
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


def park(ctx: ServerContext, tenant: str, sandbox_id: str) -> None:
    """Pause the tenant's sandbox to disk (its state counts as a snapshot of the tenant's), with
    what the server needs to take it back after a restart (manager.recover)."""
    entry = ctx.manager.get(tenant, sandbox_id)
    with ctx.snapshot_quota.hold(store(ctx), tenant, bytes_at_most(entry.spec, store(ctx).dir)):
        entry.sandbox._local().pause(to_disk=True, tenant=tenant, server={
            "tenant": tenant, "created": entry.created, "expires_at": entry.expires_at,
            "lifetime_start": entry.lifetime.start,
            "idle_timeout": entry.idle_timeout, "metadata": entry.metadata})


def take(ctx: ServerContext, tenant: str, sandbox_id: str, kept: bool = True) -> Snapshot:
    """Snapshot the tenant's sandbox, within its snapshot quota (blocking: call on a worker thread).
    A snapshot that is not ``kept`` (a fork's, removed before the fork returns) needs room in
    bytes only, not a place in the tenant's count.  The room is held before the snapshot is
    taken (:mod:`.snapshot_quota`): concurrent requests cannot all pass one check."""
    entry = ctx.manager.get(tenant, sandbox_id)
    snapshots = store(ctx)
    cap = ctx.config.max_snapshot_bytes_per_tenant
    entry.sandbox._local().tier_sandbox()  # paused to disk: 409 sandbox_paused, before any quota's 429
    with ctx.snapshot_quota.hold(snapshots, tenant, bytes_at_most(entry.spec, snapshots.dir), kept) as held:

        def refuse(size: int) -> ResourceLimit:
            return ResourceLimit(f"quota: a snapshot of {format_size(size)} does not fit in tenant {tenant!r}'s "
                                 f"{format_size(max(0, held.left))} left of {format_size(cap)} for snapshots")

        def check(size: int) -> None:  # before it is stored: one that does not fit is never listed
            if not held.fits(size):
                raise refuse(size)

        snapshot = entry.sandbox._local().snapshot(tenant, check)
        # a live one is stored before its memory image is written, with an upper bound for its size
        if not held.fits(snapshot.size, snapshot.id):
            snapshot = snapshots.whole(snapshot.id, tenant)  # its real size
            if not held.fits(snapshot.size, snapshot.id):
                snapshots.delete(snapshot.id, tenant)
                raise refuse(snapshot.size)
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
        return {"sandboxes": await ctx.describe(who, await ctx.manager.fork(who, parent, body.count))}
    # a fork lives out its parent's lifetime (read before the snapshot: the parent may end meanwhile)
    parents_lifetime = parent.lifetime
    # the snapshot lives only until the forks are made: a tenant holding its most snapshots may fork
    snapshot = await ctx.run_for(who, take, ctx, who, sandbox_id, False)
    made = []
    try:
        for _ in range(body.count):
            made.append(await ctx.manager.create(who, fork_spec(parent.spec), snapshot=snapshot.id,
                                                 parents_lifetime=parents_lifetime))
    except BaseException:
        for entry in made:
            await ctx.manager.destroy(who, entry.sandbox.id)
        raise
    finally:
        await ctx.run_for(who, store(ctx).delete, snapshot.id, who)
    return {"sandboxes": await ctx.describe(who, made)}
