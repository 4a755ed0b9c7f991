"""Wasm tier figures: cold create -> first command -> destroy, exec round trip, memory.

    .venv/bin/python bench/wasm.py [--runs 20] [--pace 0.5]

"Cold" is measured with the compiled module cached and a warm idle worker
ready (``--pace`` seconds between sandboxes let the pool refill, which is what
a host creating sandboxes at a lower rate than one per spawn time sees);
"back-to-back" creates them with no pause, so it is bounded by how fast the
pool spawns workers.  Each figure is printed with the worker's own CPU time,
which does not depend on how busy the (shared) machine is.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from corral.sandbox import Sandbox

PRINT = ["python3", "-c", "print(1)"]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def show(label: str, values: list[float], unit: str = "ms") -> None:
    print(f"{label:<44} p50 {pct(values, .5):8.1f} {unit}  p95 {pct(values, .95):8.1f} {unit}  (n={len(values)})")


def rss_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB."""
    rss = pss = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1])
        elif line.startswith("Pss:"):
            pss = int(line.split()[1])
    return rss, pss


def worker_cpu(handle: object) -> float:
    process = handle._process  # type: ignore[attr-defined]
    while not hasattr(process, "outcome"):  # the sandbox's wrappers (LocalProcess redacts) around the tier's
        process = process._process
    return float(process.outcome.get("cpu_ms", 0.0))


def bare_wasmtime(runs: int, module: Path) -> tuple[list[float], list[float]]:
    """Reference: the same compiled module running print(1) in this process, no Corral at all."""
    import wasmtime

    from corral.tiers.wasm.worker import make_engine

    engine = make_engine()
    compiled = wasmtime.Module.deserialize_file(engine, str(module))
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(runs):
        store = wasmtime.Store(engine)
        wasi = wasmtime.WasiConfig()
        wasi.argv = ["python", "-c", "print(1)"]
        store.set_wasi(wasi)
        store.set_fuel(10**12)
        store.set_epoch_deadline(1)
        before, start = os.times(), time.perf_counter()
        instance = linker.instantiate(store, compiled)
        entry = instance.exports(store)["_start"]
        assert isinstance(entry, wasmtime.Func)
        try:
            entry(store)
        except wasmtime.ExitTrap:
            pass
        after = os.times()
        wall.append((time.perf_counter() - start) * 1000)
        cpu.append((after.user + after.system - before.user - before.system) * 1000)
    return wall, cpu


def clean_up(state: Path, parent: str) -> None:
    """Remove this run's state dir and cgroup parent (the library keeps both for its next use)."""
    from corral.host import cgroup_tree, cgroups, mounts
    from corral.tiers import get_tier

    get_tier("wasm", state).close()  # type: ignore[attr-defined]
    mounts.unmount_all(state)
    shutil.rmtree(state, ignore_errors=True)
    if parent != cgroups.PARENT:
        return  # cgroups was imported before this run chose its parent: that parent is not ours
    layout = cgroups.detect()
    for root in {*layout.controllers.values(), layout.kill_root}:
        try:
            cgroup_tree.remove_tree(root / parent)
        except OSError as exc:
            print(f"left {root / parent}: {exc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--pace", type=float, default=0.5, help="seconds between cold sandboxes")
    args = parser.parse_args()
    if "CORRAL_STATE_DIR" not in os.environ and "CORRAL_CGROUP_PARENT" not in os.environ:
        os.environ["CORRAL_STATE_DIR"] = tempfile.mkdtemp(prefix="corral-bench-wasm-")
        os.environ["CORRAL_CGROUP_PARENT"] = f"corral-bench-{os.getpid()}"
        # registered first, so it runs last: after the tier's worker pool and standby guests are closed
        atexit.register(clean_up, Path(os.environ["CORRAL_STATE_DIR"]), os.environ["CORRAL_CGROUP_PARENT"])

    # warm-up: module compiled/cached, pool started
    with Sandbox.create(tier="wasm") as sb:
        sb.commands.run(PRINT)
    time.sleep(1.0)
    from corral.tiers.wasm.runtime import cached_module_path, default_runtime

    ref_wall, ref_cpu = bare_wasmtime(args.runs, cached_module_path(default_runtime()))

    cold: list[float] = []
    cold_cpu: list[float] = []
    for _ in range(args.runs):
        time.sleep(args.pace)
        start = time.perf_counter()
        sb = Sandbox.create(tier="wasm")
        handle = sb.commands.start(PRINT)
        handle.close_stdin()
        result = handle.wait()
        sb.kill()
        cold.append((time.perf_counter() - start) * 1000)
        cold_cpu.append(worker_cpu(handle))
        assert result.stdout == "1\n", result

    burst: list[float] = []
    for _ in range(args.runs):
        start = time.perf_counter()
        with Sandbox.create(tier="wasm") as sb:
            sb.commands.run(PRINT)
        burst.append((time.perf_counter() - start) * 1000)

    round_trip: list[float] = []
    rt_cpu: list[float] = []
    with Sandbox.create(tier="wasm") as sb:
        for _ in range(args.runs):
            time.sleep(args.pace)
            start = time.perf_counter()
            handle = sb.commands.start(PRINT)
            handle.close_stdin()
            handle.wait()
            round_trip.append((time.perf_counter() - start) * 1000)
            rt_cpu.append(worker_cpu(handle))

        inner = sb._tier_sandbox()
        deadline = time.monotonic() + 10
        while not inner.worker_pids() and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.05)  # the next command's guest is being pre-started
        time.sleep(args.pace)
        idle_pids = inner.worker_pids()  # type: ignore[attr-defined]
        run_dir = Path(inner._run_dir)  # type: ignore[attr-defined]
        disk = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
        idle = [rss_kib(pid) for pid in idle_pids]
        pool = inner._tier.pool  # type: ignore[attr-defined]
        idle_workers = [rss_kib(pid) for pid in pool.pids()]

    load = os.getloadavg()[0]
    print(f"wasm tier, {os.cpu_count()} CPUs, 1-min load average {load:.1f} at the end (shared machine)")
    show("reference: bare wasmtime start-up, print(1)", ref_wall)
    show("  its CPU time", ref_cpu)
    show("cold create -> first command -> destroy", cold)
    show("  worker CPU time in it", cold_cpu)
    show("cold, back-to-back (pool-spawn bound)", burst)
    show("exec round trip (python3 -c 'print(1)')", round_trip)
    show("  worker CPU time in it", rt_cpu)
    idle_rss = sum(r for r, _ in idle) / 1024
    idle_pss = sum(p for _, p in idle) / 1024
    print(f"{'memory per idle sandbox':<44} {len(idle_pids)} process(es) (the pre-started guest): "
          f"RSS {idle_rss:.1f} MiB, PSS {idle_pss:.1f} MiB; {disk} bytes of files")
    print(f"{'cold p50 / bare wasmtime p50':<44} {pct(cold, .5) / pct(ref_wall, .5):.2f}x; "
          f"exec round trip p50 / bare {pct(round_trip, .5) / pct(ref_wall, .5):.2f}x")
    if idle_workers:
        rss = statistics.mean(r for r, _ in idle_workers) / 1024
        pss = statistics.mean(p for _, p in idle_workers) / 1024
        label = "idle worker (shared by all sandboxes)"
        print(f"{label:<44} {len(idle_workers)} x RSS {rss:.1f} MiB (PSS {pss:.1f} MiB)")


if __name__ == "__main__":
    main()
