"""The server's sandboxes: ownership by tenant, quotas, lifetimes, persistence.

Every sandbox the server creates is recorded in the library's registry (SQLite in
the state directory), which the janitor uses to release its resources when the
owning process is gone.  Tenants and deadlines live in memory only: after a
``kill -9`` the sandboxes' processes die with the server (bubblewrap's
``--die-with-parent``) and on the next start :meth:`recover` runs the janitor, so
nothing of the previous run is left to own (sandboxes paused to disk keep their
tenant and deadlines in their parked record and are taken back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import parked
from ..egress.tunnel import OWNER_TUNNELS
from ..errors import ConnectionLost, InvalidSpec, ResourceLimit, SandboxClosed, SandboxError, SandboxNotFound
from ..pool import PoolSet
from ..registry import gc, state_dir
from ..sandbox import Sandbox
from ..snapshots import end_parked
from ..spec import SandboxSpec, format_size
from .config import ServerConfig
from .metrics import Metrics

_log = logging.getLogger("corral.server")

REAP_INTERVAL = 0.5
DESTROY_THREADS = 32
REAP_CHECK_THREADS = 16
MAX_OUTPUT_CAP = 64 << 20
#: one tenant's CPU weight (``cpu.weight``'s scale), split among its sandboxes: a default group's,
#: so that a tenant's sandboxes together weigh as much as one sandbox of a library or daemon beside
#: the server under the same parent (10,000 made one tenant's sandbox outweigh those 100 to 1)
TENANT_CPU_WEIGHT = 100.0


class Lifetime(NamedTuple):
    """A sandbox's deadline and the moment its ``max_lifetime`` is counted from."""

    expires_at: float
    start: float


@dataclass
class Entry:
    sandbox: Sandbox
    tenant: str
    created: float
    expires_at: float
    idle_timeout: float
    from_pool: bool
    last_used: float = field(default_factory=time.time)
    active_execs: int = 0
    #: egress refusals already counted in the metrics
    refused_seen: int = 0
    #: the creator's labels (``Sandbox.list(metadata=)``)
    metadata: dict[str, str] = field(default_factory=dict)
    #: background commands by pid: their output so far, for clients that attach (command_routes)
    background: dict[int, Any] = field(default_factory=dict)
    #: when its ``max_lifetime`` began (None: at ``created``); a fork's is its parent's
    lifetime_start: float | None = None

    def __post_init__(self) -> None:
        if self.lifetime_start is None:
            self.lifetime_start = self.created

    @property
    def lifetime(self) -> Lifetime:
        """Its deadline and when its max lifetime began, which its forks keep."""
        assert self.lifetime_start is not None
        return Lifetime(self.expires_at, self.lifetime_start)

    @property
    def spec(self) -> SandboxSpec:
        return self.sandbox.spec

    def to_dict(self, env: bool = True) -> dict[str, Any]:
        """The sandbox as the API describes it; without ``env``, its spec names its variables
        (``env_names``) without their values: a listing of every sandbox of a tenant carried each
        one's env whole (450 MiB rendered on the event loop in 4.7 s, before env was bounded)."""
        spec = self.spec.to_dict()
        spec.pop("workspace", None)
        if not env:
            spec["env_names"] = sorted(spec.pop("env"))
        try:
            state = ("paused" if self.sandbox.paused else "running") if self.sandbox.is_running() else "stopped"
        except ConnectionLost:  # a cluster node that did not answer in time: the rest is known
            state = "unknown"
        return {
            "id": self.sandbox.id,
            "state": state,
            "spec": spec,
            "created_at": self.created,
            "expires_at": self.expires_at,
            "idle_timeout": self.idle_timeout,
            "last_used_at": self.last_used,
            "from_pool": self.from_pool,
            "metadata": self.metadata,
        }


#: runs blocking work for a tenant: ``run_for(tenant, fn, *args, **kwargs)``
RunFor = Callable[..., Awaitable[Any]]


async def _on_default_threads(_tenant: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs)


class SandboxManager:
    def __init__(self, config: ServerConfig, metrics: Metrics, run_for: RunFor = _on_default_threads) -> None:
        self.config = config
        self.metrics = metrics
        #: creates and forks run within the tenant's share of the server's threads
        #: (ServerContext.run_for): on asyncio's few default threads, one tenant's slow creates
        #: made every other tenant's wait
        self._run_for = run_for
        self.root = state_dir(config.state_dir)
        self._entries: dict[str, Entry] = {}
        #: quota reservations for creates in flight: tenant -> [count, memory]
        self._pending: dict[str, list[int]] = {}
        #: what each tenant's live sandboxes hold: tenant -> [count, memory] (kept with _entries, under
        #: _lock, so a quota check does not walk every sandbox of every tenant)
        self._usage: dict[str, list[int]] = {}
        #: in how many parts each tenant's CPU weight is split now (share_cpu)
        self._cpu_parts: dict[str, int] = {}
        self._lock = threading.Lock()
        self.recover()
        self.pools = PoolSet.from_config(config.pools, self.root, on_create=metrics.create_seconds.observe)
        self._reaper: asyncio.Task[None] | None = None
        # destroying waits (for processes to die, cgroups to empty): many may overlap
        self._destroyers = ThreadPoolExecutor(max_workers=DESTROY_THREADS, thread_name_prefix="corral-destroy")
        # the reaper's pass and its checks of the sandboxes (on a cluster, one per sandbox at once)
        self._checks = ThreadPoolExecutor(max_workers=REAP_CHECK_THREADS, thread_name_prefix="corral-reap")

    # -- persistence -----------------------------------------------------------
    def recover(self) -> None:
        """Release everything a previous run of the server left (it was killed, or crashed).

        No table of the server's own is needed for it (nor written on the request path): the
        registry knows every sandbox's resources and its owner, and reaps those whose owner is dead."""
        gc(self.root)  # the registry janitor: reaps every sandbox whose owning process is dead
        for record in parked.every(self.root):  # paused to disk: they hold nothing live, and stay
            facts = record.server
            if not facts:
                continue
            if parked.over(record, time.time()):  # its lifetime ended while the server was down: it ends
                end_parked(self.root, record.sandbox_id)
                continue
            sandbox = Sandbox.connect(record.sandbox_id, state=self.root)
            entry = Entry(sandbox, str(facts["tenant"]), float(facts["created"]), float(facts["expires_at"]),
                          float(facts["idle_timeout"]), False, metadata=dict(facts.get("metadata") or {}),
                          lifetime_start=float(facts.get("lifetime_start", facts["created"])))
            self._add(entry)

    def share_cpu(self, tenant: str, added: Entry | None = None) -> None:
        """Split one tenant's CPU weight among ``tenant``'s sandboxes, so that under contention a
        tenant's sandboxes together weigh about as much as another tenant's one: weights were per
        sandbox, and one tenant's 8 busy sandboxes made another's command 5.4x slower (32, the
        default count bound, would leave it ~1/33 of the CPU).

        The weight is split in a power of two of parts, at least the count, and the parts change
        only when the count passes them or falls to a quarter of them: each change rewrites every
        sandbox of the tenant, and a change needs as many creates or destroys as there are
        sandboxes since the last, so a create costs one write however many the tenant runs (a
        burst of 1,000 would otherwise write a million files). A tenant's sandboxes together weigh
        a quarter to all of one tenant's weight."""
        with self._lock:
            count = self._usage.get(tenant, [0, 0])[0]
            parts = self._cpu_parts.get(tenant, 1)
            if count > parts:
                fresh = 1 << (count - 1).bit_length()
            elif count * 4 <= parts:
                fresh = 1 << count.bit_length()
            else:
                fresh = parts
            if count == 0:
                self._cpu_parts.pop(tenant, None)
            else:
                self._cpu_parts[tenant] = fresh
            if fresh != parts:
                mine = [e for e in self._entries.values() if e.tenant == tenant]
            else:
                mine = [added] if added is not None else []
        for entry in mine:
            try:
                entry.sandbox._backend.share_cpu(TENANT_CPU_WEIGHT / fresh)
            except SandboxError:
                pass  # ending meanwhile: its group goes with it

    def _add(self, entry: Entry) -> None:
        # the egress tunnels of all of a tenant's sandboxes (in this process) are one share of the
        # server's budget, not one share each: egress/tunnel.py
        OWNER_TUNNELS.assign(entry.sandbox.id, f"tenant:{entry.tenant}")
        with self._lock:
            self._entries[entry.sandbox.id] = entry
            usage = self._usage.setdefault(entry.tenant, [0, 0])
            usage[0] += 1
            usage[1] += entry.spec.limits.memory
        self.share_cpu(entry.tenant, entry)

    def _remove(self, sandbox_id: str) -> Entry | None:
        with self._lock:
            entry = self._entries.pop(sandbox_id, None)
            if entry is not None:
                usage = self._usage[entry.tenant]
                usage[0] -= 1
                usage[1] -= entry.spec.limits.memory
                if usage[0] == 0:
                    del self._usage[entry.tenant]
        if entry is not None:
            self.share_cpu(entry.tenant)
            OWNER_TUNNELS.assign(sandbox_id, None)
            for recorded in list(entry.background.values()):
                recorded.release()  # its kept output no longer counts for the tenant
        return entry

    # -- lookup ----------------------------------------------------------------
    def get(self, tenant: str, sandbox_id: str) -> Entry:
        entry = self._entries.get(sandbox_id)
        if entry is None or entry.tenant != tenant:
            # another tenant's sandbox is answered exactly like a missing one
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        entry.last_used = time.time()
        return entry

    def owned_by(self, tenant: str) -> list[Entry]:
        return sorted((e for e in self._entries.values() if e.tenant == tenant), key=lambda e: e.created)

    # -- create / destroy ------------------------------------------------------
    def _reserve(self, tenant: str, memory: int) -> None:
        with self._lock:
            live = self._usage.get(tenant, [0, 0])
            pending = self._pending.setdefault(tenant, [0, 0])
            count = live[0] + pending[0]
            used = live[1] + pending[1]
            if count + 1 > self.config.max_sandboxes_per_tenant:
                raise ResourceLimit(f"quota: tenant {tenant!r} already has {count} live sandboxes "
                                    f"(max {self.config.max_sandboxes_per_tenant}); destroy one first")
            if used + memory > self.config.max_memory_per_tenant:
                raise ResourceLimit(f"quota: tenant {tenant!r} uses {format_size(used)} of "
                                    f"{format_size(self.config.max_memory_per_tenant)} memory; "
                                    f"{format_size(memory)} more does not fit")
            pending[0] += 1
            pending[1] += memory

    def _release(self, tenant: str, memory: int) -> None:
        with self._lock:
            pending = self._pending[tenant]
            pending[0] -= 1
            pending[1] -= memory

    def deadlines(self, idle_timeout: float | None, lifetime: float | None) -> tuple[float, float]:
        cap = self.config.max_lifetime
        for value, what in ((idle_timeout, "idle_timeout"), (lifetime, "lifetime")):
            if value is not None and not 0 < value <= cap:
                raise InvalidSpec(f"{what}: {value!r} must be seconds in (0, {cap:g}] (the server's max lifetime)")
        return (idle_timeout or min(self.config.idle_timeout, cap)), (lifetime or cap)

    async def create(self, tenant: str, spec: SandboxSpec, idle_timeout: float | None = None,
                     lifetime: float | None = None, snapshot: str | None = None,
                     parents_lifetime: Lifetime | None = None) -> Entry:
        """A sandbox for ``tenant`` (from its ``snapshot`` if given: see .snapshot_routes); a fork
        made so lives out ``parents_lifetime``, not one of its own."""
        if spec.workspace is not None:
            raise InvalidSpec("workspace: host directories cannot be mounted through the server; "
                              "upload files with the files API instead")
        if spec.secrets:
            # secret values are read from the creating process's environment or secrets file:
            # through the server that would be the server's own, handed to whichever host a tenant names
            raise InvalidSpec("secrets: brokered secrets are not available through the server "
                              "(their values would come from the server's environment)")
        if spec.unsafe_allow_ranges:
            raise InvalidSpec("unsafe_allow_ranges: private and local ranges cannot be opened through the "
                              "server (they are the server's own networks)")
        self.config.check_reach(spec)
        if spec.limits.max_output > MAX_OUTPUT_CAP:
            # the server holds a command's output in memory until it answers: bound it
            raise InvalidSpec(f"max_output: {format_size(spec.limits.max_output)} is over the server's "
                              f"{format_size(MAX_OUTPUT_CAP)} per stream")
        idle, life = self.deadlines(idle_timeout, lifetime)
        self._reserve(tenant, spec.limits.memory)
        try:
            pool = self.pools.get(spec) if snapshot is None else None
            sandbox = pool.try_acquire() if pool is not None else None
            from_pool = sandbox is not None
            if sandbox is None:
                t0 = time.perf_counter()
                if self.config.cluster is not None:  # on a node; the node destroys it too if this server dies
                    if snapshot is not None:
                        raise InvalidSpec("snapshot: a cluster's sandboxes cannot start from a snapshot of this host")
                    # the node ends it at its lifetime too: a killed server's sandboxes, paused or
                    # busy, outlived it (the node's idle reaper skips those)
                    sandbox = await self._run_for(tenant, Sandbox.create, spec, cluster=self.config.cluster,
                                                  idle_timeout=idle, lifetime=life)
                else:
                    sandbox = await self._run_for(tenant, Sandbox.create, spec, state=self.root, snapshot=snapshot)
                self.metrics.create_seconds.observe(time.perf_counter() - t0)
            now = time.time()
            expires_at, start = parents_lifetime or Lifetime(now + life, now)
            entry = Entry(sandbox, tenant, now, expires_at, idle, from_pool, lifetime_start=start)
            self._add(entry)
        finally:
            self._release(tenant, spec.limits.memory)
        self.metrics.live.set(len(self._entries))
        return entry

    async def fork(self, tenant: str, parent: Entry, count: int) -> list[Entry]:
        """``count`` forks of ``parent`` straight from its live state (``Sandbox.fork``: a microVM's
        stream, no snapshot), each counted against the tenant's sandbox and memory quotas.  A fork
        lives out its parent's lifetime: it carries the parent's running processes, and a fork with
        a fresh ``max_lifetime`` made before each deadline ran them past it for ever."""
        parents_lifetime = parent.lifetime  # before the fork: the parent may end meanwhile
        reserved = 0
        try:
            for _ in range(count):
                self._reserve(tenant, parent.spec.limits.memory)
                reserved += 1
            idle, _ = self.deadlines(None, None)
            kids = await self._run_for(tenant, parent.sandbox.fork, count)
            now = time.time()
            made = [Entry(kid, tenant, now, parents_lifetime.expires_at, idle, False,
                          lifetime_start=parents_lifetime.start) for kid in kids]
            for entry in made:
                self._add(entry)  # counted in the tenant's usage, as every entry is
        finally:
            for _ in range(reserved):
                self._release(tenant, parent.spec.limits.memory)
        self.metrics.live.set(len(self._entries))
        return made

    def audit(self, entry: Entry) -> list[dict[str, Any]]:
        """The sandbox's egress refusals so far (the events, built only when asked for)."""
        try:
            events = [e.to_dict() for e in entry.sandbox.network.audit()]
        except SandboxClosed:  # a tier without a network side
            return []
        self.count_refused(entry)
        return events

    def count_refused(self, entry: Entry) -> None:
        """Feed the refused-egress counter with the sandbox's refusals since the last look: a
        count the egress keeps, read after every command.  (Building every event to count them
        took 79 ms of the server's CPU a command once a sandbox's log was full, and slowed
        other tenants' commands 2 -> 27 ms.)"""
        try:
            refused = entry.sandbox._backend.refused_count()
        except SandboxClosed:
            return
        with self._lock:
            new, entry.refused_seen = refused - entry.refused_seen, max(refused, entry.refused_seen)
        if new > 0:
            self.metrics.egress_refused.inc(new)

    def extend(self, entry: Entry, seconds: float) -> None:
        cap = entry.lifetime.start + self.config.max_lifetime
        wanted = time.time() + seconds
        if not (seconds > 0 and math.isfinite(seconds)):  # (-5 and NaN were said to "outlive" the lifetime)
            raise InvalidSpec(f"timeout: {seconds!r} must be a positive number of seconds")
        if wanted > cap + 1e-3:
            left = max(0.0, cap - time.time())
            raise InvalidSpec(f"timeout: {seconds!r} s would outlive the server's max lifetime of "
                              f"{self.config.max_lifetime:g} s from creation (a fork's: its first parent's; "
                              f"{left:.0f} s left)")
        entry.expires_at = wanted
        backend = getattr(entry.sandbox, "_backend", None)
        if getattr(backend, "parked", None) is not None:  # paused to disk: its record's deadline too (gc reads it)
            parked.set_deadline(self.root, entry.sandbox.id, wanted)

    def destroy_now(self, sandbox_id: str) -> None:
        entry = self._remove(sandbox_id)
        if entry is None:
            return
        try:
            entry.sandbox.kill()
        finally:
            self.metrics.live.set(len(self._entries))

    async def destroy(self, tenant: str, sandbox_id: str) -> None:
        self.get(tenant, sandbox_id)
        await asyncio.get_running_loop().run_in_executor(self._destroyers, self.destroy_now, sandbox_id)

    # -- exec admission --------------------------------------------------------
    @contextlib.contextmanager
    def exec_slot(self, entry: Entry) -> Iterator[None]:
        with self._lock:
            if entry.active_execs >= self.config.max_concurrent_execs:
                raise ResourceLimit(f"sandbox {entry.sandbox.id} already runs {entry.active_execs} commands "
                                    f"(max {self.config.max_concurrent_execs} at once); wait for one to finish")
            entry.active_execs += 1
        try:
            yield
        finally:
            with self._lock:
                entry.active_execs -= 1
            entry.last_used = time.time()

    # -- lifetimes -------------------------------------------------------------
    def expired(self, now: float) -> list[str]:
        """The sandboxes whose lifetime or idle timeout is over, or that died.  Blocking: on a
        cluster each check is a round trip to the sandbox's node (run it on a thread, as
        :meth:`_reap_loop` does); no lock is held across them, and a sandbox whose node does not
        answer in time (STATE_TIMEOUT) is left for the next pass, not reaped nor waited on."""
        with self._lock:
            entries = list(self._entries.values())
        if self.config.cluster is not None and len(entries) > 1:  # one slow node delays no other's checks
            ended = list(self._checks.map(lambda e: self._ended(e, now), entries))
        else:
            ended = [self._ended(e, now) for e in entries]
        return [e.sandbox.id for e, over in zip(entries, ended, strict=True) if over]

    @staticmethod
    def _ended(e: Entry, now: float) -> bool:
        if now >= e.expires_at:
            return True
        try:
            # a paused sandbox waits for resume(): only its lifetime ends it
            # a running command is not idle: a background one (a job, a dev server) neither
            if (e.active_execs == 0 and not any(not r.finished for r in list(e.background.values()))
                    and now - e.last_used >= e.idle_timeout and not e.sandbox.paused):
                return True
            return not e.sandbox.is_running()
        except Exception:  # not known this time (its node did not answer): asked again next pass
            return False

    async def _reap_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            try:
                # off the event loop: a check may wait on a node (cluster) or an owner process
                expired = await loop.run_in_executor(self._checks, self.expired, time.time())
                self.metrics.expired.inc(len(expired))
                ended = await asyncio.gather(*(loop.run_in_executor(self._destroyers, self.destroy_now, sandbox_id)
                                               for sandbox_id in expired), return_exceptions=True)
            except Exception:  # one pass's failure: the reaper goes on (it was the only one, and ended)
                _log.exception("corral: a pass of the sandbox reaper failed")
                continue
            for sandbox_id, outcome in zip(expired, ended, strict=True):
                if isinstance(outcome, Exception):  # (removed from the server all the same)
                    _log.error("corral: destroying expired sandbox %s failed: %r", sandbox_id, outcome)

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.to_thread(self._destroy_all)

    def _destroy_all(self) -> None:
        # a sandbox paused to disk holds nothing live: it waits for the next start (recover)
        live = [sid for sid, entry in self._entries.items() if not getattr(entry.sandbox._backend, "parked", None)]
        list(self._destroyers.map(self.destroy_now, live))
        self._destroyers.shutdown()
        self._checks.shutdown(wait=False, cancel_futures=True)
        self.pools.close()
