"""Warm pools: sandboxes created ahead of time, handed out once each.

A :class:`SandboxPool` keeps between ``min_idle`` and ``max_idle`` fresh
sandboxes of one template (image + tier + limits + network + env + cwd).
:meth:`SandboxPool.acquire` pops one in microseconds; the caller owns it from
then on and no other caller ever sees it (a pool never takes a sandbox back).
When the pool is empty, acquire falls back to a cold create.  A background
thread refills the pool, and replaces members that died while waiting.

Members are created on the refill thread (or the caller's, for a cold
create): a tier keeps the threads its sandboxes depend on itself (the process
tier forks bubblewrap from a launcher thread of its own), so a sandbox does
not die with the thread that created it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import InvalidSpec
from .host.procs import host_memory as host_memory  # the cluster's node reads it here too
from .sandbox import Sandbox
from .spec import SandboxSpec
from .spec import template_key as template_key  # defined beside the spec (the cluster's placement uses it too)

#: no single pool may hold more idle sandboxes than this
MAX_POOL_SIZE = 64
#: idle pool members together may not claim more than this share of host memory (their cgroup limits)
MAX_POOL_MEMORY_SHARE = 0.5
#: after an acquire, a refill waits this long while the pool still has members: a create takes a
#: core for ~20 ms, and started at once it would compete with the new owner's first command
REFILL_SETTLE = 0.1

class SandboxPool:
    """Fresh sandboxes of one template, refilled in the background.

    Usable from the library directly::

        with SandboxPool(SandboxSpec(), min_idle=2, max_idle=4) as pool:
            sb = pool.acquire()      # yours alone; kill() it when done
    """

    def __init__(self, spec: SandboxSpec, min_idle: int = 1, max_idle: int | None = None, *,
                 state: str | Path | None = None, on_create: Callable[[float], None] | None = None) -> None:
        max_idle = max(min_idle, 1) if max_idle is None else max_idle
        if isinstance(min_idle, bool) or not isinstance(min_idle, int) or min_idle < 0:
            raise InvalidSpec(f"pool min_idle: {min_idle!r} must be a whole number >= 0")
        if isinstance(max_idle, bool) or not isinstance(max_idle, int) or not min_idle <= max_idle <= MAX_POOL_SIZE:
            raise InvalidSpec(f"pool max_idle: {max_idle!r} must be from min_idle ({min_idle}) to {MAX_POOL_SIZE}")
        if spec.workspace is not None:
            raise InvalidSpec("pool templates cannot have a workspace: the copy would be stale when handed out")
        if max_idle * spec.limits.memory > MAX_POOL_MEMORY_SHARE * host_memory():
            raise InvalidSpec(
                f"pool of {max_idle} x {spec.limits.memory >> 20} MiB would claim more than "
                f"{MAX_POOL_MEMORY_SHARE:.0%} of host memory; lower max_idle or the memory limit"
            )
        self.spec = spec
        self.key = template_key(spec)
        self.min_idle = min_idle
        self.max_idle = max_idle
        self._state = state
        self._on_create = on_create
        self._idle: deque[Sandbox] = deque()
        self._creating = 0
        self._filling = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._last_acquire = 0.0
        self.stats = {"hits": 0, "misses": 0, "created": 0, "replaced": 0, "failed": 0}
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> SandboxPool:
        if self._thread is None:
            self._thread = threading.Thread(target=self._refill_loop, name="corral-pool", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop refilling and destroy every idle member (handed-out sandboxes are their owners')."""
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle), deque()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for sb in idle:
            sb.kill()
        # members whose create was in flight when we closed are killed by the loop itself

    def __enter__(self) -> SandboxPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- use -----------------------------------------------------------------
    def idle_count(self) -> int:
        return len(self._idle)

    def try_acquire(self) -> Sandbox | None:
        """A fresh, never-used, live member, or None when the pool is empty. Never blocks."""
        while True:
            with self._lock:
                if not self._idle:
                    self.stats["misses"] += 1
                    self._wake.set()
                    return None
                sb = self._idle.popleft()
                self._last_acquire = time.monotonic()
            self._wake.set()
            if sb.is_running():
                self.stats["hits"] += 1
                return sb
            self.stats["replaced"] += 1
            sb.kill()

    def acquire(self) -> Sandbox:
        """A fresh sandbox: from the pool when one is ready, else created now (cold)."""
        sb = self.try_acquire()
        if sb is not None:
            return sb
        return self._create()

    # -- refill --------------------------------------------------------------
    def _create(self) -> Sandbox:
        t0 = time.perf_counter()
        sb = Sandbox.create(self.spec, state=self._state)
        if self._on_create is not None:
            self._on_create(time.perf_counter() - t0)
        return sb

    def _deficit(self) -> int:
        with self._lock:
            if self._closed:
                return 0
            have = len(self._idle) + self._creating
            # hysteresis: once below min_idle, fill all the way to max_idle
            if have < self.min_idle:
                self._filling = True
            if not self._filling or have >= self.max_idle:
                self._filling = False
                return 0
            return self.max_idle - have

    def _settle_left(self) -> float:
        """Seconds to hold a refill back so it does not slow a just-acquired sandbox (0 if empty)."""
        with self._lock:
            if not self._idle:
                return 0.0
            return max(0.0, self._last_acquire + REFILL_SETTLE - time.monotonic())

    def _refill_loop(self) -> None:
        # this thread creates every member itself (the members' own threads are their tier's)
        while True:
            self._replace_dead()
            missing = self._deficit()
            if missing == 0:
                with self._lock:
                    if self._closed:
                        return
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            settle = self._settle_left()
            if settle > 0:
                time.sleep(settle)
                continue
            with self._lock:
                self._creating += 1
            try:
                sb = Sandbox.create(self.spec, state=self._state)
                if not _healthy(sb):
                    sb.kill()
                    raise RuntimeError("a new pool member failed its health check")
                _settled(sb)
            except Exception:  # a failed create is counted and retried after a pause
                self.stats["failed"] += 1
                time.sleep(min(5.0, 0.2 * self.stats["failed"]))
                continue
            finally:
                with self._lock:
                    self._creating -= 1
            self.stats["created"] += 1
            with self._lock:
                if not self._closed and len(self._idle) < self.max_idle:
                    self._idle.append(sb)
                    sb = None  # type: ignore[assignment]
            if sb is not None:
                sb.kill()

    def _replace_dead(self) -> None:
        with self._lock:
            dead = [sb for sb in self._idle if not sb.is_running()]
            for sb in dead:
                self._idle.remove(sb)
        for sb in dead:
            self.stats["replaced"] += 1
            sb.kill()


#: the command a new member runs before it is pooled, where ``true`` is not one (the wasm tier
#: runs Python only: its members all failed the check, so its pools never filled)
HEALTH_CHECKS = {"wasm": ["python3", "-c", "pass"]}


def _healthy(sb: Sandbox) -> bool:
    """Run ``true`` once before pooling: proves the agent answers and can start a command, so a
    member that came up broken is replaced instead of handed out.  Nothing of it stays behind: no
    file is written and the process is gone before anyone can acquire the sandbox."""
    try:
        return sb.commands.run(HEALTH_CHECKS.get(sb.spec.tier, ["true"]), timeout=10).exit_code == 0
    except Exception:
        return False


#: seconds a new member may take to get its tier ready for the next command before it is pooled anyway
SETTLE_TIMEOUT = 1.0


def _settled(sb: Sandbox) -> None:
    """Wait (bounded) until the member is as ready as it will get: on the process tier, until the
    spare the health check made the agent fork sits in its own cgroup leaf.  Pooled before that,
    a member taken at once would run its owner's first command the slow way (fork, then a cgroup
    move that may wait for an RCU grace period), and the placement would run on the host while
    that command does."""
    inner = sb._inner
    placed = getattr(inner, "spare_placed", None) if inner is not None else None
    if isinstance(placed, threading.Event):
        placed.wait(SETTLE_TIMEOUT)


class PoolSet:
    """Several pools, looked up by template; what the server and MCP use."""

    def __init__(self, state: str | Path | None = None, on_create: Callable[[float], None] | None = None) -> None:
        self._pools: dict[str, SandboxPool] = {}
        self._state = state
        self._on_create = on_create

    def add(self, spec: SandboxSpec, min_idle: int, max_idle: int | None = None) -> SandboxPool:
        pool = SandboxPool(spec, min_idle, max_idle, state=self._state, on_create=self._on_create)
        total = sum(p.max_idle * p.spec.limits.memory for p in self._pools.values())
        if total + pool.max_idle * spec.limits.memory > MAX_POOL_MEMORY_SHARE * host_memory():
            raise InvalidSpec("pools together would claim more than half of host memory; lower max_idle")
        if pool.key in self._pools:
            raise InvalidSpec("two pools have the same template")
        self._pools[pool.key] = pool.start()
        return pool

    def get(self, spec: SandboxSpec) -> SandboxPool | None:
        # an equal spec has an equal key: comparing the fields first spares a pool hit the key's
        # JSON (~40 us on the request path); anything else is looked up by key as before
        for pool in self._pools.values():
            if pool.spec == spec:
                return pool
        return self._pools.get(template_key(spec))

    def pools(self) -> list[SandboxPool]:
        return list(self._pools.values())

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    @staticmethod
    def from_config(entries: list[dict[str, Any]], state: str | Path | None = None,
                    on_create: Callable[[float], None] | None = None) -> PoolSet:
        """``[{"spec": {...}, "min_idle": 2, "max_idle": 4}, ...]`` (spec as in SandboxSpec.from_dict)."""
        pools = PoolSet(state, on_create)
        for entry in entries:
            if not isinstance(entry, dict) or set(entry) - {"spec", "min_idle", "max_idle"}:
                raise InvalidSpec("pool entry: expected {spec, min_idle, max_idle}")
            pools.add(SandboxSpec.from_dict(entry.get("spec") or {}), entry.get("min_idle", 1), entry.get("max_idle"))
        return pools
