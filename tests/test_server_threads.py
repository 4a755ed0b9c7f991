"""A tenant's slow work runs within its share of the server's threads.

Creates and forks ran on asyncio's default threads (cpus + 4: six here), outside every tenant's
share (``max_threads_per_tenant`` of ``blocking_threads``): one tenant's slow creates made every
other tenant's creates wait (4.8 s, measured by the red-team pass that found it).  Now they go
through the share (``SandboxManager(run_for=ServerContext.run_for)``), as snapshots and
pauses to disk do.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from corral.server.config import ServerConfig
from corral.server.manager import SandboxManager
from corral.server.metrics import Metrics
from corral.spec import SandboxSpec


def test_creates_and_forks_run_within_the_tenants_share(state_dir: Path) -> None:
    seen: list[tuple[str, str]] = []

    async def run_for(tenant: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((tenant, getattr(fn, "__name__", "")))
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def session() -> None:
        manager = SandboxManager(ServerConfig(state_dir=str(state_dir)), Metrics(), run_for)
        try:
            parent = await manager.create("alice", SandboxSpec.from_dict({}))
            kids = await manager.fork("alice", parent, 1)
            assert len(kids) == 1 and kids[0].tenant == "alice"
            assert await asyncio.to_thread(kids[0].sandbox.commands.run, "echo forked") is not None
        finally:
            await manager.shutdown()

    asyncio.run(session())
    assert ("alice", "create") in seen and ("alice", "fork") in seen, seen


def test_the_servers_manager_runs_them_with_the_tenants_share(state_dir: Path) -> None:
    from corral.server.context import ServerContext

    async def session() -> None:
        ctx = ServerContext(ServerConfig(state_dir=str(state_dir)))
        ctx.start()
        try:
            assert ctx.manager._run_for == ctx.run_for
        finally:
            await ctx.shutdown()

    asyncio.run(session())
