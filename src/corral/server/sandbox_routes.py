"""``/v1/sandboxes``: create, list, describe, destroy, extend, pause, resume; run a command, a
code cell; read the egress audit."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response

from ..commands import check_call
from ..errors import SandboxClosed
from ..lifecycle import check_metadata
from ..spec import SandboxSpec, validate_env
from . import snapshot_routes
from .context import Context, Tenant
from .output_shares import Rendering, client_left, render_json
from .wire import CodeBody, ContextBody, CreateSandbox, ExecBody, PauseBody, TimeoutBody, require_unicode

if TYPE_CHECKING:
    from ..tiers.base import ExecResult
    from ..transport import CommandProcess

router = APIRouter()


@router.post("/v1/sandboxes", status_code=201, summary="Create a sandbox")
async def create_sandbox(body: CreateSandbox, who: Tenant, ctx: Context, request: Request) -> dict[str, Any]:
    data = body.model_dump(exclude_unset=True)
    require_unicode(data)
    idle, life = data.pop("idle_timeout", None), data.pop("lifetime", None)
    metadata = check_metadata(data.pop("metadata", None))
    snapshot = data.pop("snapshot", None)
    if snapshot is not None:  # the tenant's own snapshot (another's is a 404), its tier and image
        data.update(snapshot_routes.spec_fields(ctx, who, snapshot, data))
    spec = SandboxSpec.from_dict(data)
    left = asyncio.ensure_future(client_left(request.receive))
    try:
        entry = await ctx.manager.create(who, spec, idle, life, snapshot)
        await asyncio.sleep(0)  # a disconnect already received is seen
        if left.done():
            # nobody will learn its id: it lived until its idle timeout, counted against the quota
            await ctx.manager.destroy(who, entry.sandbox.id)
            raise SandboxClosed("the client left while its sandbox was made: destroyed")
    finally:
        left.cancel()
    entry.metadata = metadata
    if entry.from_pool:
        ctx.metrics.pool_hits.inc()
    return (await ctx.describe(who, [entry]))[0]


@router.get("/v1/sandboxes", summary="List your sandboxes")
async def list_sandboxes(who: Tenant, ctx: Context) -> dict[str, Any]:
    return {"sandboxes": await ctx.describe(who, list(ctx.manager.owned_by(who)), env=False)}


@router.get("/v1/sandboxes/{sandbox_id}", summary="Describe a sandbox")
async def get_sandbox(sandbox_id: str, who: Tenant, ctx: Context) -> dict[str, Any]:
    return (await ctx.describe(who, [ctx.manager.get(who, sandbox_id)]))[0]


@router.delete("/v1/sandboxes/{sandbox_id}", status_code=204, summary="Destroy a sandbox")
async def delete_sandbox(sandbox_id: str, who: Tenant, ctx: Context) -> Response:
    await ctx.manager.destroy(who, sandbox_id)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/timeout", summary="Set the time left before the sandbox is destroyed")
async def set_timeout(sandbox_id: str, body: TimeoutBody, who: Tenant, ctx: Context) -> dict[str, Any]:
    entry = ctx.manager.get(who, sandbox_id)
    ctx.manager.extend(entry, body.timeout)
    return (await ctx.describe(who, [entry]))[0]


@router.post("/v1/sandboxes/{sandbox_id}/pause", summary="Freeze a sandbox until it is resumed (409 if already paused)")
async def pause_sandbox(sandbox_id: str, who: Tenant, ctx: Context, body: PauseBody | None = None) -> dict[str, Any]:
    entry = ctx.manager.get(who, sandbox_id)
    if body is not None and body.to_disk:  # the state goes to the snapshot store, within the tenant's quota
        # slow (a microVM's memory written out): within the tenant's share, as snapshots are
        await ctx.run_for(who, snapshot_routes.park, ctx, who, sandbox_id)
    else:
        await ctx.run_control(who, entry.sandbox.pause)
    return (await ctx.describe(who, [entry]))[0]


@router.post("/v1/sandboxes/{sandbox_id}/resume", summary="Let a paused sandbox run on (409 if not paused)")
async def resume_sandbox(sandbox_id: str, who: Tenant, ctx: Context) -> dict[str, Any]:
    entry = ctx.manager.get(who, sandbox_id)
    await ctx.run_control(who, entry.sandbox.resume)
    ctx.manager.share_cpu(who, entry)  # a resume from disk is in a new group
    entry.last_used = time.time()
    return (await ctx.describe(who, [entry]))[0]


@router.post("/v1/sandboxes/{sandbox_id}/exec", summary="Run a command to completion")
async def exec_command(sandbox_id: str, body: ExecBody, who: Tenant, ctx: Context, request: Request) -> Response:
    manager = ctx.manager
    entry = manager.get(who, sandbox_id)
    require_unicode(body.model_dump())
    sandbox = entry.sandbox
    call = check_call(body.cmd, body.timeout, body.env, body.cwd or sandbox.cwd, user=body.user)
    running: list[CommandProcess] = []

    def run_and_audit() -> tuple[ExecResult, Rendering]:
        # one trip to a worker thread, not two: each hop costs a thread wake-up on the exec path
        with manager.exec_slot(entry):
            result = sandbox._backend.run(call, body.stdin_bytes(), None, running.append)
        manager.count_refused(entry)
        return result, render_json({"sandbox_id": sandbox_id, **result.to_dict()})  # (not on the loop)

    hold = await ctx.hold_output(who, entry.spec.limits.max_output)
    # a client that leaves takes its command with it: it would otherwise run on to its timeout
    # (up to days), holding one of the sandbox's exec slots and a thread of the tenant's share
    watch = asyncio.ensure_future(_kill_when_the_client_leaves(request, running, ctx, who))
    try:
        result, answer = await ctx.run_for(who, run_and_audit)
    except BaseException:
        hold()
        raise
    finally:
        watch.cancel()
    ctx.metrics.record_exec(result.timed_out, result.oom_killed)
    # the output stays counted until its client has it
    return ctx.answer(who, answer, hold)


async def _kill_when_the_client_leaves(request: Request, running: list[CommandProcess], ctx: Context,
                                       tenant: str) -> None:
    await client_left(request.receive)
    for process in running:
        await ctx.run_control(tenant, process.kill)


async def _set_when_the_client_leaves(request: Request, cancel: threading.Event) -> None:
    await client_left(request.receive)
    cancel.set()


@router.get("/v1/sandboxes/{sandbox_id}/network/audit", summary="Egress refusals and withheld secrets so far")
async def network_audit(sandbox_id: str, who: Tenant, ctx: Context) -> dict[str, Any]:
    entry = ctx.manager.get(who, sandbox_id)
    return {"events": await ctx.run_control(who, ctx.manager.audit, entry)}


# the code interpreter (corral.interpreter): one cell per call
@router.post("/v1/sandboxes/{sandbox_id}/code", summary="Run code in the sandbox's interpreter (if available)")
async def run_code(sandbox_id: str, body: CodeBody, who: Tenant, ctx: Context, request: Request) -> Response:
    entry = ctx.manager.get(who, sandbox_id)
    require_unicode(body.model_dump())
    sandbox = entry.sandbox
    envs = validate_env(body.envs) if body.envs else None
    # a client that leaves ends its cell as its timeout would (interrupted): it held the
    # interpreter, an exec slot and a thread of the tenant's share for up to the kernel's lifetime
    cancel = threading.Event()
    hold = await ctx.hold_output(who, entry.spec.limits.max_output)
    watch = asyncio.ensure_future(_set_when_the_client_leaves(request, cancel))

    def run_and_render() -> Rendering:
        result = sandbox._backend.run_code(sandbox, body.code, language=body.language, timeout=body.timeout,
                                           context=body.context, envs=envs, callbacks={"cancel": cancel})
        return render_json(result.to_dict())

    try:
        with ctx.manager.exec_slot(entry):
            answer = await ctx.run_for(who, run_and_render)
    except BaseException:
        hold()
        raise
    finally:
        watch.cancel()
    return ctx.answer(who, answer, hold)


@router.post("/v1/sandboxes/{sandbox_id}/contexts", status_code=201,
             summary="Make a code context: an interpreter with its own variables")
async def create_context(sandbox_id: str, body: ContextBody, who: Tenant, ctx: Context) -> dict[str, Any]:
    entry = ctx.manager.get(who, sandbox_id)
    require_unicode(body.model_dump())
    # a cluster sandbox answers from its node: never on the event loop
    made = await ctx.run_for(who, entry.sandbox.create_code_context, body.language, body.cwd)
    return {"id": made.id, "language": made.language, "cwd": made.cwd}


@router.get("/v1/sandboxes/{sandbox_id}/contexts", summary="List the sandbox's code contexts")
async def list_contexts(sandbox_id: str, who: Tenant, ctx: Context) -> dict[str, Any]:
    entry = ctx.manager.get(who, sandbox_id)
    contexts = await ctx.run_for(who, entry.sandbox.list_code_contexts)
    return {"contexts": [{"id": c.id, "language": c.language, "cwd": c.cwd} for c in contexts]}


@router.delete("/v1/sandboxes/{sandbox_id}/contexts/{context_id}", status_code=204,
               summary="End a code context's interpreter")
async def remove_context(sandbox_id: str, context_id: str, who: Tenant, ctx: Context) -> Response:
    entry = ctx.manager.get(who, sandbox_id)
    # its kernel's end is waited for; no such context: 400 invalid_spec, as run_code answers for one
    await ctx.run_for(who, entry.sandbox.remove_code_context, context_id)
    return Response(status_code=204)
