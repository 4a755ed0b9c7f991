"""Pause and resume figures (issue 18): freezing a live sandbox and letting it run on.

Prints, per tier, p50/p95/p99 over N iterations of ``pause()`` + ``resume()`` of a
sandbox with a busy loop running in it (so the freeze has a runnable task to
stop), and the ratio of the p50 to the issue's target (<= 5 ms on the process
and gVisor tiers).  For scale, E2B's docs give about 4 s per GiB of memory for
its pause (it writes memory out; this pause keeps memory resident).

Filesystem snapshots (process and gVisor tiers): a sandbox that wrote ~50 MB (one 48 MiB file
and 500 small files in a package-like tree); printed: the first snapshot's time (sandbox paused
while its files are hashed and copied) and bytes written, as seconds per GiB against E2B's ~4 s
per GiB for its pause; then ``--snapshots`` more: their time p50 and bytes written (the store is
content-addressed: unchanged contents are linked), create from a stored snapshot -> first command
p50, and ``fork(1)`` -> first command p50 (snapshot + create + ``true``).

MicroVM live snapshots (memory, devices, processes): a guest whose Python process holds 256 MiB
of random bytes (nothing for zero-page compaction to skip); printed: the snapshot's time (target
<= 1 s: until ``snapshot()`` returns, the VM running on and the snapshot usable; its memory image
is written to disk after that, in the background) split into its steps (the VM is stopped only
for the migration), the time until it is whole on disk,
bytes written and seconds per GiB of guest memory against E2B's ~4 s per GiB; create from the
snapshot -> first command p50 (target <= 250 ms under TCG) and where a restore's time goes;
``fork(1)`` -> first command p50 (target <= 250 ms under TCG) with its steps (the parent frozen,
its workspace copied, stopped while migrated; the fork's QEMU up, loaded and given its identity,
its workspace mounted; then the first command); ``pause(to_disk=True)`` and ``resume()``.

Usage: python bench/snapshot.py [--iterations 200] [--snapshots 7] [--tiers process,gvisor,microvm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

TARGET_MS = 5.0
E2B_SECONDS_PER_GIB = 4.0
#: ~50 MB: one big file and a package-like tree of small ones
WRITE_50MB = ("head -c 48M /dev/urandom > /home/user/data.bin && mkdir -p /home/user/.local/lib/pkg && "
              "for i in $(seq 500); do head -c 4096 /dev/urandom > /home/user/.local/lib/pkg/m$i.py; done")


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return statistics.median(ordered), pick(0.95), pick(0.99)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--snapshots", type=int, default=7, help="snapshot iterations per tier")
    parser.add_argument("--tiers", default="process,gvisor,microvm")
    args = parser.parse_args()
    made = None
    if "CORRAL_STATE_DIR" not in os.environ:
        made = os.environ["CORRAL_STATE_DIR"] = tempfile.mkdtemp(prefix="corral-bench-")
    try:
        return run(args)
    finally:
        if made is not None:  # (every sandbox of it is gone: each was closed above)
            shutil.rmtree(made, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    from corral import Sandbox
    from corral.registry import state_dir
    from corral.tiers import tier_class

    print(f"load average at start: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    for tier in args.tiers.split(","):
        availability = tier_class(tier).probe(state_dir())
        if not availability.available:
            print(f"{tier:8s} skipped: {availability.reason}")
            continue
        with Sandbox.create(tier=tier, memory="256M") as sb:
            busy = sb.commands.start("while :; do :; done", timeout=3600)
            samples = []
            for _ in range(args.iterations):
                start = time.perf_counter()
                sb.pause()
                sb.resume()
                samples.append((time.perf_counter() - start) * 1000)
            busy.kill()
            busy.wait()
        p50, p95, p99 = percentiles(samples)
        print(f"{tier:8s} pause+resume p50 {p50:6.2f} ms  p95 {p95:6.2f}  p99 {p99:6.2f}  "
              f"(p50 / target {TARGET_MS:g} ms = {p50 / TARGET_MS:.2f})")
    for tier in args.tiers.split(","):
        kind = tier_class(tier).capabilities.snapshot
        if kind and tier_class(tier).probe(state_dir()).available:
            (bench_live if kind == "live" else bench_snapshots)(tier, args.snapshots)
    print(f"load average at end:   {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    return 0


def bench_snapshots(tier: str, iterations: int) -> None:
    from corral import Sandbox

    with Sandbox.create(tier=tier, memory="256M", disk="512M") as sb:
        assert sb.commands.run(WRITE_50MB, timeout=600).exit_code == 0
        start = time.perf_counter()
        first = sb.snapshot()  # every content new to the store: copied and hashed
        first_s = time.perf_counter() - start
        taken, written, creates, forks = [], [], [], []
        for _ in range(iterations):
            start = time.perf_counter()
            snap = sb.snapshot()  # the same contents: hashed, linked, not written
            taken.append(time.perf_counter() - start)
            written.append(snap.written)
            start = time.perf_counter()
            with Sandbox.create(snapshot=snap.id, memory="256M", disk="512M") as child:
                child.commands.run("true")
                creates.append(time.perf_counter() - start)
            Sandbox.delete_snapshot(snap.id)
            start = time.perf_counter()
            [child] = sb.fork(1)
            child.commands.run("true")
            forks.append(time.perf_counter() - start)
            child.kill()
        Sandbox.delete_snapshot(first.id)
    per_gib = first_s / (first.size / (1 << 30))
    print(f"{tier:8s} first snapshot of ~50 MB written: {first_s * 1000:7.1f} ms, {first.written / 1e6:.1f} MB written "
          f"({per_gib:.2f} s per GiB; E2B's pause ~{E2B_SECONDS_PER_GIB:g} s per GiB: ratio "
          f"{per_gib / E2B_SECONDS_PER_GIB:.2f})")
    print(f"{tier:8s} later snapshots (contents shared): p50 {statistics.median(taken) * 1000:7.1f} ms, "
          f"{statistics.median(written) / 1e3:.1f} kB written")
    print(f"{tier:8s} create from snapshot -> first command p50 {statistics.median(creates) * 1000:7.1f} ms; "
          f"fork(1) -> first command p50 {statistics.median(forks) * 1000:7.1f} ms  (n={iterations})")


#: a Python process holding 256 MiB of random bytes (cwd /tmp: /workspace is unmounted while a
#: live snapshot is taken)
HOLD_256M = ("import os, sys, time\nheld = bytearray(os.urandom(1 << 20)) * 256\n"
             "for i in range(0, len(held), 4096): held[i] = i % 251\nprint('held', flush=True)\ntime.sleep(86400)")


def bench_live(tier: str, iterations: int) -> None:
    from corral import Sandbox
    from corral.registry import state_dir
    from corral.snapshots import SnapshotStore

    store = SnapshotStore(state_dir())

    with Sandbox.create(tier=tier, memory="512M") as sb:
        ready: list[str] = []
        holder = sb.commands.start(["python3", "-c", HOLD_256M], cwd="/tmp", timeout=86400,
                                   on_stdout=lambda data: ready.append(data))
        deadline = time.monotonic() + 600
        while "held" not in "".join(ready) and time.monotonic() < deadline:
            time.sleep(0.1)
        timings: dict[str, float] = getattr(sb._inner, "timings", {})  # the tier's VM: its step timings
        taken, whole, written, steps = [], [], [], []
        snaps = []
        for _ in range(iterations):
            start = time.perf_counter()
            snap = sb.snapshot()  # returns once the VM runs on: its memory image is written after
            taken.append(time.perf_counter() - start)
            snap = store.whole(snap.id)  # (waits for it: the next snapshot would wait for it too)
            whole.append(time.perf_counter() - start)
            written.append(snap.written)
            steps.append({k: v for k, v in timings.items() if k.startswith("snapshot_")})
            snaps.append(snap)
        creates, restores = [], []
        for snap in snaps:
            start = time.perf_counter()
            with Sandbox.create(snapshot=snap.id) as child:
                child.commands.run("true")
                creates.append(time.perf_counter() - start)
                restores.append(dict(getattr(child._inner, "timings", {})))
        for snap in snaps:
            Sandbox.delete_snapshot(snap.id)
        forks, fork_steps = [], []
        for _ in range(iterations):
            start = time.perf_counter()
            [child] = sb.fork(1)
            made = time.perf_counter()
            child.commands.run("true")
            forks.append(time.perf_counter() - start)
            fork_steps.append({"fork() returned": made - start, "first command": time.perf_counter() - made,
                               **{k: v for k, v in timings.items() if k.startswith("fork_")},
                               **{f"fork's {k}": v for k, v in getattr(child._inner, "timings", {}).items()}})
            child.kill()
        parks, resumes = [], []
        for _ in range(max(1, iterations // 2)):
            start = time.perf_counter()
            sb.pause(to_disk=True)
            parks.append(time.perf_counter() - start)
            start = time.perf_counter()
            sb.resume()
            sb.commands.run("true")
            resumes.append(time.perf_counter() - start)
        holder.kill()
    p50 = statistics.median(taken)
    gib = 256 / 1024
    print(f"{tier:8s} live snapshot of a guest holding 256 MiB: p50 {p50 * 1000:7.1f} ms (target 1000 ms: ratio "
          f"{p50:.2f}), {statistics.median(written) / 1e6:.1f} MB written; {p50 / gib:.2f} s per GiB held "
          f"(E2B's pause ~{E2B_SECONDS_PER_GIB:g} s per GiB: ratio {p50 / gib / E2B_SECONDS_PER_GIB:.2f})")
    for name in ("snapshot_quiesce", "snapshot_workspace", "snapshot_converter", "snapshot_stopped",
                 "snapshot_convert", "snapshot_write_ram"):
        print(f"{tier:8s}   {name:18s} p50 {statistics.median(s.get(name, 0.0) for s in steps) * 1000:7.1f} ms"
              + ("  (after snapshot() returned)" if name in ("snapshot_convert", "snapshot_write_ram") else ""))
    print(f"{tier:8s}   whole on disk      p50 {statistics.median(whole) * 1000:7.1f} ms after snapshot() was called")
    print(f"{tier:8s} create from live snapshot -> first command p50 {statistics.median(creates) * 1000:7.1f} ms "
          f"(target 250 ms: ratio {statistics.median(creates) / 0.25:.2f}); restore steps p50: "
          + ", ".join(f"{k} {statistics.median(r.get(k, 0.0) for r in restores) * 1000:.0f} ms"
                      for k in ("files", "qemu_start", "identity", "workspace", "total")))
    fork_p50 = statistics.median(forks)
    print(f"{tier:8s} fork(1) -> first command p50 {fork_p50 * 1000:7.1f} ms (target 250 ms: ratio "
          f"{fork_p50 / 0.25:.2f}; load {os.getloadavg()[0]:.2f}); steps p50 (ms since fork() was called; the "
          f"parent's are durations):")
    names = ("fork_quiesce", "fork_workspace", "fork_children_up", "fork_stopped", "fork's qemu_up", "fork's files", "fork's identity",
             "fork's workspace", "fork() returned", "first command")
    print(f"{tier:8s}   " + ", ".join(f"{name} {statistics.median(s.get(name, 0.0) for s in fork_steps) * 1000:.0f}"
                                      for name in names if any(name in s for s in fork_steps)))
    print(f"{tier:8s} pause(to_disk=True) p50 {statistics.median(parks) * 1000:7.1f} ms; resume -> first command p50 "
          f"{statistics.median(resumes) * 1000:7.1f} ms  (n={iterations})")


if __name__ == "__main__":
    raise SystemExit(main())
