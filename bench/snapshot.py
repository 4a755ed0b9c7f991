"""Pause and resume figures (issue 18): freezing a live sandbox and letting it run on.

Prints, per tier, p50/p95/p99 over N iterations of ``pause()`` + ``resume()`` of a
sandbox with a busy loop running in it (so the freeze has a runnable task to
stop), and the ratio of the p50 to the issue's target (<= 5 ms on the process
and gVisor tiers).  For scale, E2B's docs give about 4 s per GiB of memory for
its pause (it writes memory out; this pause keeps memory resident).

Snapshots and forks (the rest of issue 18) are not built yet; this script is where
their figures will go.

Usage: python bench/snapshot.py [--iterations 200] [--tiers process,gvisor,microvm]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

TARGET_MS = 5.0


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return statistics.median(ordered), pick(0.95), pick(0.99)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=200)
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
    print(f"load average at end:   {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
