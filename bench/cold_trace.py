"""Where a process-tier cold lifecycle's time goes (issue 16, target 4), phase by phase.

Wraps the phases of create -> ``true`` -> destroy (in this process, not in the library's code)
with timers and prints, per phase, the p50 of wall time and of this process's CPU
(every thread; ``time.process_time``), with the count of calls per lifecycle.  Phases nest
(``create`` holds ``setup``, which holds ``cgroup``, ...): an inner phase's time is part of its
outer one's.  Also printed: the whole lifecycle's wall, CPU of this process, and CPU of reaped
child processes (``os.times``: bwrap, the holder, ...), and the load average.

``--gap S`` sleeps S seconds before each lifecycle (outside its timing): a create that follows
an idle spell is what a user meets, and some kernel paths cost more then (a cgroup move after
idle waits for an RCU grace period).

Usage: python bench/cold_trace.py [--iterations 40] [--user root] [--gap 0.5]
For two checkouts, interleave runs: ``PYTHONPATH=OTHER/src python bench/cold_trace.py``.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

#: (module, owner (class name or "" for a module function), attribute, phase name)
PHASES = [
    ("corral.local_transport", "LocalTransport", "create", "create (API, whole)"),
    ("corral.tiers.linux.sandbox", "LinuxSandbox", "_reserve_range", "  uid range reserve"),
    ("corral.tiers.process.tier", "ProcessSandbox", "_setup", "  tier setup (whole)"),
    ("corral.host.mountns", "MountNamespace", "__init__", "    mount-ns holder start"),
    ("corral.tiers.linux.sandbox", "LinuxSandbox", "_make_cgroup", "    cgroup create"),
    ("corral.tiers.linux.sandbox", "LinuxSandbox", "_make_network", "    network (none)"),
    ("corral.tiers.linux.sandbox", "LinuxSandbox", "_build_root", "    root build (overlay, files)"),
    ("corral.tiers.linux.sandbox", "LinuxSandbox", "_userns", "      userns finish (maps)"),
    ("corral.tiers.process.tier", "ProcessSandbox", "_launch", "    launch (whole)"),
    ("corral.host.cgroups", "SandboxCgroup", "leaf", "      cgroup leaf (agent)"),
    ("corral.tiers.linux.rootfs", "", "sandbox_dev", "      /dev (nodes, pts, shm)"),
    ("corral.tiers.linux.rootfs", "", "shm_dir", "        shm dir"),
    ("corral.tiers.linux.rootfs", "", "proc_masks", "      /proc masks"),
    ("corral.tiers.linux.rootfs", "", "boot_id_file", "      boot id"),
    ("corral.host.mountns", "MountNamespace", "bind_all", "      agent + workspace binds"),
    ("corral.tiers.linux.sandbox", "LinuxSandbox", "_drop_userns", "      drop userns"),
    ("corral.tiers.linux.agent", "AgentChannel", "__init__", "      agent channel"),
    ("corral.host.mountns", "MountNamespace", "exec", "      holder exec bwrap"),
    ("corral.host.cgroups", "", "join", "      cgroup join (bwrap)"),
    ("corral.tiers.linux.agent", "AgentChannel", "wait_ready", "      agent handshake"),
    ("corral.host.procs", "", "descendants", "      descendants"),
    ("corral.host.cgroups", "SandboxCgroup", "contain", "      contain (per pid)"),
    ("corral.local_transport", "LocalBackend", "run", "first command (run)"),
    ("corral.local_transport", "LocalBackend", "close", "destroy (API, whole)"),
    ("corral.tiers.linux.sandbox", "LinuxSandbox", "close", "  tier close (whole)"),
    ("corral.tiers.process.tier", "ProcessSandbox", "_stop", "    stop agent/bwrap"),
    ("corral.host.cgroups", "SandboxCgroup", "destroy", "    cgroup destroy"),
    ("corral.host.mountns", "MountNamespace", "close", "    mount-ns holder close"),
    ("corral.host.mounts", "", "unmount_all", "    unmount run dir"),
    ("corral.host.uids", "", "release_range", "    uid range release"),
]


class Timers:
    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = defaultdict(list)
        self.cpu: dict[str, list[float]] = defaultdict(list)
        self.calls: dict[str, int] = defaultdict(int)
        self.current: dict[str, list[float]] = {}

    def begin(self) -> None:
        self.current = {}

    def end(self) -> None:
        for name, (wall, cpu, count) in self.current.items():
            self.wall[name].append(wall)
            self.cpu[name].append(cpu)
            self.calls[name] += int(count)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                row = self.current.setdefault(name, [0.0, 0.0, 0])
                row[0] += (time.perf_counter() - w) * 1000
                row[1] += (time.process_time() - c) * 1000
                row[2] += 1
        return timed


def install(timers: Timers) -> list[str]:
    import importlib

    order = []
    for module, owner, attr, name in PHASES:
        mod = importlib.import_module(module)
        target = getattr(mod, owner) if owner else mod
        if not hasattr(target, attr):  # another checkout (interleaved runs) may not have this phase
            continue
        original: Callable[..., Any] = getattr(target, attr)
        setattr(target, attr, timers.wrap(name, original))
        if not owner:  # a module function imported by name elsewhere: patch those names too
            for user in ("corral.tiers.process.tier", "corral.tiers.linux.sandbox"):
                umod = importlib.import_module(user)
                if umod.__dict__.get(attr) is original:
                    setattr(umod, attr, timers.wrap(name, original))
        order.append(name)
    return order


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--user", default=None)
    parser.add_argument("--gap", type=float, default=0.0, help="seconds idle before each lifecycle")
    args = parser.parse_args()
    if "CORRAL_STATE_DIR" not in os.environ:
        os.environ["CORRAL_STATE_DIR"] = tempfile.mkdtemp(prefix="corral-bench-")
        atexit.register(shutil.rmtree, os.environ["CORRAL_STATE_DIR"], True)
    from corral import Sandbox

    timers = Timers()
    order = install(timers)
    kwargs = {"user": args.user} if args.user else {}

    def cycle() -> None:
        with Sandbox.create(**kwargs) as sb:
            sb.commands.run(["true"])

    for _ in range(3):
        cycle()
    total_wall, total_cpu, child_cpu = [], [], []
    for _ in range(args.iterations):
        time.sleep(args.gap)
        timers.begin()
        t0, c0 = time.perf_counter(), time.process_time()
        k0 = os.times()
        cycle()
        k1 = os.times()
        total_wall.append((time.perf_counter() - t0) * 1000)
        total_cpu.append((time.process_time() - c0) * 1000)
        child_cpu.append(((k1.children_user - k0.children_user) + (k1.children_system - k0.children_system)) * 1000)
        timers.end()
    import corral

    n = args.iterations
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; iterations {n}; "
          f"user {args.user or 'default'}; gap {args.gap} s; corral from {os.path.dirname(corral.__file__)}")
    print(f"{'phase':<40} {'wall p50':>9} {'cpu p50':>8} {'calls':>6}")
    for name in order:
        if name in timers.wall:
            print(f"{name:<40} {statistics.median(timers.wall[name]):9.2f} "
                  f"{statistics.median(timers.cpu[name]):8.2f} {timers.calls[name] / n:6.1f}")
    print(f"{'lifecycle (wall)':<40} {statistics.median(total_wall):9.2f}")
    print(f"{'lifecycle CPU, this process':<40} {statistics.median(total_cpu):9.2f}")
    print(f"{'lifecycle CPU, reaped children':<40} {statistics.median(child_cpu):9.2f} "
          f"(os.times, 10 ms ticks: mean {statistics.fmean(child_cpu):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
