"""What a command flooding its output costs the owner's CPU, past ``max_output``.

A command runs ``yes`` for a few seconds in a sandbox (default ``max_output``, 16 MiB):

- *no consumer* (``commands.run`` without a callback): the agent forwards what is kept and one
  byte more, then reads and drops the rest on the sandbox's side;
- *streaming consumer* (``on_output``): every byte reaches the owner, as every byte did before
  for both (the baseline).

Printed per row: the owner's CPU seconds (its own process time, all threads) per wall second of
the command, and the no-consumer row's ratio to the baseline.

Usage: python bench/flood_cpu.py [--seconds 5] [--tier process]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--tier", default="process")
    args = parser.parse_args()
    if "CORRAL_STATE_DIR" not in os.environ:
        os.environ["CORRAL_STATE_DIR"] = tempfile.mkdtemp(prefix="corral-bench-")
        atexit.register(shutil.rmtree, os.environ["CORRAL_STATE_DIR"], True)

    from corral import Sandbox

    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus; tier {args.tier}; "
          f"`yes` for {args.seconds:g} s")
    cmd = f"timeout {args.seconds:g} yes"
    rows: dict[str, float] = {}
    with Sandbox.create(tier=args.tier) as sb:
        received = [0]

        def count(_: str, chunk: bytes) -> None:
            received[0] += len(chunk)

        for name, callback in (("no consumer", None), ("streaming consumer (baseline)", count)):
            cpu, wall = time.process_time(), time.monotonic()
            result = sb.commands.run(cmd, on_output=callback, timeout=args.seconds + 30)
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            rows[name] = cpu / wall
            print(f"{name:<32} owner CPU {cpu:6.2f} s over {wall:5.2f} s = {100 * cpu / wall:5.1f} % of a core; "
                  f"kept {len(result.stdout)} bytes, truncated={result.truncated}"
                  + (f", streamed {received[0] / (1 << 20):.0f} MiB" if callback else ""))
    base = rows["streaming consumer (baseline)"]
    print(f"no consumer / baseline: {rows['no consumer'] / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
