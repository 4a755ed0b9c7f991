"""Warm pools in the library, without a server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from corral.errors import InvalidSpec
from corral.pool import MAX_POOL_SIZE, PoolSet, SandboxPool
from corral.spec import SandboxSpec, Workspace

SPEC = SandboxSpec.from_dict({"limits": {"memory": "64M"}})


def _wait_idle(pool: SandboxPool, count: int) -> None:
    deadline = time.monotonic() + 30
    while pool.idle_count() < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.idle_count() >= count


def test_acquire_hands_out_distinct_fresh_sandboxes_and_replaces_dead_ones() -> None:
    with SandboxPool(SPEC, min_idle=2, max_idle=2) as pool:
        _wait_idle(pool, 2)
        first, second = pool.acquire(), pool.acquire()
        try:
            assert first.id != second.id
            assert first.commands.run("ls -A /workspace").stdout == ""
            first.files.write("mine.txt", "used")
            _wait_idle(pool, 2)
            # an idle member that died is never handed out: it is replaced
            dead = pool._idle[0]
            assert dead._inner is not None
            dead._inner.close()
            third = pool.acquire()
            assert third.id not in (first.id, second.id, dead.id) and third.is_running()
            assert not third.files.exists("mine.txt")
            third.kill()
            assert pool.stats["replaced"] >= 1
        finally:
            first.kill()
            second.kill()
        _wait_idle(pool, 2)
        idle = list(pool._idle)
    # closing the pool destroys its idle members; handed-out ones were their owners' to kill
    assert idle and not any(sb.is_running() for sb in idle)


def test_empty_pool_falls_back_to_a_cold_create() -> None:
    with SandboxPool(SPEC, min_idle=0, max_idle=0) as pool:
        sb = pool.acquire()
        try:
            assert sb.commands.run("echo cold").stdout == "cold\n"
            assert pool.stats["misses"] == 1
        finally:
            sb.kill()


def test_pools_are_capped(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match="max_idle"):
        SandboxPool(SPEC, min_idle=1, max_idle=MAX_POOL_SIZE + 1)
    with pytest.raises(InvalidSpec, match="host memory"):
        SandboxPool(SandboxSpec.from_dict({"limits": {"memory": "512G"}}), min_idle=1, max_idle=2)
    with pytest.raises(InvalidSpec, match="workspace"):
        SandboxPool(SandboxSpec(workspace=Workspace(tmp_path)), min_idle=1)


def test_a_pool_is_found_for_an_equal_template_and_only_for_it(tmp_path: Path) -> None:
    pools = PoolSet(state=tmp_path)
    try:
        mine = pools.add(SPEC, min_idle=0, max_idle=1)  # min_idle 0: nothing is created
        other = pools.add(SandboxSpec.from_dict({"limits": {"memory": "96M"}, "env": {"A": "1"}}), 0, 1)
        assert pools.get(SandboxSpec.from_dict({"limits": {"memory": "64M"}})) is mine
        assert pools.get(SandboxSpec.from_dict({"env": {"A": "1"}, "limits": {"memory": "96M"}})) is other
        for spec in ({"limits": {"memory": "96M"}}, {"limits": {"memory": "96M"}, "env": {"A": "2"}},
                     {"limits": {"memory": "64M"}, "user": "root"}, {"limits": {"memory": "64M"}, "cwd": "/tmp"}):
            assert pools.get(SandboxSpec.from_dict(spec)) is None, spec
    finally:
        pools.close()


def test_a_member_is_pooled_with_its_first_command_ready() -> None:
    """On the process tier the health check's spare is placed before the member is handed out,
    so the owner's first command finds it (taken the moment the pool has a member)."""
    from corral.tiers.process import ProcessSandbox

    with SandboxPool(SPEC, min_idle=1, max_idle=1) as pool:
        for _ in range(2):
            _wait_idle(pool, 1)
            sb = pool.acquire()
            try:
                inner = sb._inner
                assert isinstance(inner, ProcessSandbox)
                assert inner.spare_placed.is_set()
                assert sb.commands.run(["true"]).exit_code == 0
            finally:
                sb.kill()


@pytest.mark.parametrize("tier", ["process", "wasm"])
def test_a_pool_of_each_tier_fills_and_hands_out_warm_members(tier: str, state_dir: Path) -> None:
    """Every new member runs a health check before it is pooled; it was ``true``, which the wasm
    tier (Python only) refuses with 127: its pools never filled (17 failed creates in 30 s,
    every acquire a cold create)."""
    from .tier_probe import skip_unless_tier

    skip_unless_tier(tier, state_dir)
    spec = SandboxSpec.from_dict({"tier": tier, "limits": {"memory": "64M"}})
    with SandboxPool(spec, min_idle=1, max_idle=1) as pool:
        _wait_idle(pool, 1)
        sb = pool.acquire()
        try:
            assert pool.stats["hits"] == 1 and pool.stats["failed"] == 0, pool.stats
            assert sb.commands.run(["python3", "-c", "print('warm')"]).stdout == "warm\n"
        finally:
            sb.kill()
