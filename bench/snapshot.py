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
p50, and ``fork(1)`` -> first command p50 (snapshot + create + ``true``).  The microVM's live snapshot is not here (not built: QEMU refuses to migrate a guest
with the 9p workspace mounted).

Usage: python bench/snapshot.py [--iterations 200] [--snapshots 7] [--tiers process,gvisor,microvm]
"""

from __future__ import annotations

import argparse
import os
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
    os.environ.setdefault("CORRAL_STATE_DIR", tempfile.mkdtemp(prefix="corral-bench-"))

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
        if tier_class(tier).capabilities.snapshot and tier_class(tier).probe(state_dir()).available:
            bench_snapshots(tier, args.snapshots)
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


if __name__ == "__main__":
    raise SystemExit(main())
