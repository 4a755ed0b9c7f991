"""Every isolation tier side by side (issue 6).

For each tier whose probe passes on this machine, prints p50/p95 of:
  - cold create -> first command -> destroy, through the Python API
  - exec round trip of the tier's trivial command in a live sandbox
  - memory per idle sandbox: RSS (and PSS, which counts shared pages once) of
    every host process the sandbox owns, and its memory cgroup's usage
plus an optional per-tier floor (the bare runtime doing the same, e.g.
``runsc do true``) and the p50's ratio to it.  The machine is shared: the load
average is printed with the figures.

Targets: gVisor cold <= 300 ms; microVM restore-from-snapshot <= 250 ms (TCG);
wasm cold <= 60 ms with the cached module.

Adding a tier: append a :class:`TierBench` to ``BENCHES`` (its trivial command,
targets, and, if its sandbox's processes are not in the sandbox's cgroups, its
own ``memory`` function).

Usage: python bench/tiers.py [--iterations 20] [--tiers process,gvisor] [--idle 5]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def measure(fn: Callable[[], object], n: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


@dataclass(frozen=True)
class Memory:
    rss: int
    pss: int
    cgroup: int
    processes: int


def cgroup_memory(sandbox_id: str) -> Memory | None:
    """RSS/PSS of every process in the sandbox's cgroups, and the memory group's usage."""
    from corral.host import cgroup_tree, cgroups

    layout = cgroups.detect()
    groups = {root / cgroups.PARENT / sandbox_id for root in (*layout.controllers.values(), layout.kill_root)}
    pids: set[int] = set()
    for group in groups:
        if group.is_dir():
            for sub in (group, *(p for p in group.rglob("*") if p.is_dir())):
                pids.update(cgroup_tree.read_pids(sub))
    if not pids:
        return None
    rss = pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    memory_group = layout.controllers["memory"] / cgroups.PARENT / sandbox_id
    usage_file = "memory.current" if layout.version == 2 else "memory.usage_in_bytes"
    try:
        usage = int((memory_group / usage_file).read_text())
    except (OSError, ValueError):
        usage = 0
    return Memory(rss, pss, usage, len(pids))


def runsc_floor() -> list[str] | None:
    runsc = shutil.which("runsc")
    if runsc is None:
        return None
    root = tempfile.mkdtemp(prefix="bench-runsc-")
    atexit.register(shutil.rmtree, root, True)
    return [runsc, "--root", root, "--network=none", "--ignore-cgroups", "do", "true"]


@dataclass(frozen=True)
class TierBench:
    tier: str
    #: the trivial command of the tier (the wasm tier has only Python)
    command: list[str]
    targets: dict[str, str] = field(default_factory=dict)
    #: argv of the bare runtime doing the same (the floor), or None
    floor: Callable[[], list[str] | None] = lambda: None
    memory: Callable[[str], Memory | None] = cgroup_memory
    create_kwargs: dict[str, Any] = field(default_factory=dict)


BENCHES = [
    TierBench("process", ["true"], {"cold": "p50 <= 30"}),
    TierBench("gvisor", ["true"], {"cold": "p50 <= 300"}, floor=runsc_floor),
    TierBench("microvm", ["true"], {"cold": "restore p50 <= 250"}),
    TierBench("wasm", ["python", "-c", "pass"], {"cold": "p50 <= 60"}),
]


def bench_tier(bench: TierBench, iterations: int, idle: int) -> list[tuple[str, str, str, str]]:
    from corral import Sandbox

    rows: list[tuple[str, str, str, str]] = []

    def cold() -> None:
        with Sandbox.create(tier=bench.tier, **bench.create_kwargs) as sb:
            sb.commands.run(bench.command)

    floor_p50 = 0.0
    argv = bench.floor()
    if argv is not None:
        floor = measure(lambda: subprocess.run(argv, check=True, capture_output=True), max(5, iterations // 2))
        floor_p50 = percentiles(floor)[0]
        label = f"floor: {Path(argv[0]).name} {' '.join(argv[-2:])}"
        rows.append((label, f"{floor_p50:.1f}", f"{percentiles(floor)[1]:.1f}", ""))
    cold_samples = measure(cold, iterations)
    p50, p95 = percentiles(cold_samples)
    ratio = f"  ({p50 / floor_p50:.2f}x floor)" if floor_p50 else ""
    rows.append(("cold create -> command -> destroy", f"{p50:.1f}", f"{p95:.1f}", bench.targets.get("cold", "") + ratio))
    with Sandbox.create(tier=bench.tier, **bench.create_kwargs) as sb:
        exec_samples = measure(lambda: sb.commands.run(bench.command), iterations)
        p50, p95 = percentiles(exec_samples)
        rows.append(("exec round trip", f"{p50:.1f}", f"{p95:.1f}", bench.targets.get("exec", "")))
    sandboxes = [Sandbox.create(tier=bench.tier, **bench.create_kwargs) for _ in range(idle)]
    try:
        for sb in sandboxes:
            sb.commands.run(bench.command)
        time.sleep(0.5)
        measured = [m for m in (bench.memory(sb.id) for sb in sandboxes) if m is not None]
    finally:
        for sb in sandboxes:
            sb.kill()
    if measured:
        rss = statistics.median(m.rss for m in measured) / MiB
        pss = statistics.median(m.pss for m in measured) / MiB
        usage = statistics.median(m.cgroup for m in measured) / MiB
        procs = statistics.median(m.processes for m in measured)
        rows.append((f"idle memory (median of {len(measured)})", f"RSS {rss:.1f} MiB", f"PSS {pss:.1f} MiB",
                     f"cgroup {usage:.1f} MiB, {procs:.0f} host processes"))
    else:
        rows.append(("idle memory", "n/a", "", "no host processes in the sandbox's cgroups"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--idle", type=int, default=5, help="idle sandboxes measured for memory")
    parser.add_argument("--tiers", default="", help="comma-separated tiers (default: every tier whose probe passes)")
    args = parser.parse_args()
    if "CORRAL_STATE_DIR" not in os.environ:
        os.environ["CORRAL_STATE_DIR"] = tempfile.mkdtemp(prefix="corral-bench-")
        atexit.register(shutil.rmtree, os.environ["CORRAL_STATE_DIR"], True)
    state = Path(os.environ["CORRAL_STATE_DIR"])

    from corral.tiers import tier_class

    wanted = {t for t in args.tiers.split(",") if t}
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus; iterations {args.iterations}")
    print(f"{'tier':<8} {'what':<36} {'p50 ms':>16} {'p95 ms':>16}  target / notes")
    for bench in BENCHES:
        if wanted and bench.tier not in wanted:
            continue
        try:
            availability = tier_class(bench.tier).probe(state)
        except Exception as exc:
            print(f"{bench.tier:<8} skipped: {exc}")
            continue
        if not availability.available:
            print(f"{bench.tier:<8} skipped: {availability.reason}")
            continue
        for what, p50, p95, note in bench_tier(bench, args.iterations, args.idle):
            print(f"{bench.tier:<8} {what:<36} {p50:>16} {p95:>16}  {note}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
