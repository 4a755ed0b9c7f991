"""What a network mode adds to a sandbox's cold start, per tier (issue 6: gVisor ``open``).

Interleaved rounds (none, allow, open, none, allow, open, ...) so a busy
neighbour on this shared host slows every mode alike.  Each sample is
create -> ``true`` -> destroy through the Python API, with create (until the
sandbox is ready) and destroy also reported on their own.  Also timed alone: the
open mode's host side (:class:`OpenNetwork`: namespace, veth, table, NFLOG
listener; made and closed), which both tiers share.

``open`` needs IPv4 forwarding: switched on for the run and put back as it was.
Nothing is sent anywhere; the sandboxes only run ``true``.

Usage: python bench/network_modes.py [--tiers gvisor,process] [--rounds 5] [--per-round 4]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


def pcts(samples: list[float]) -> str:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"p50 {statistics.median(ordered):7.1f}  p95 {p95:7.1f}  (n={len(ordered)})"


def cold(tier: str, network: str) -> tuple[float, float, float]:
    """(create, destroy, create -> true -> destroy) in ms."""
    from corral import Sandbox

    start = time.perf_counter()
    sb = Sandbox.create(tier=tier, network=network)
    created = time.perf_counter()
    try:
        sb.commands.run(["true"])
    finally:
        ran = time.perf_counter()
        sb.kill()
    end = time.perf_counter()
    return (created - start) * 1000, (end - ran) * 1000, (end - start) * 1000


def open_network_alone(n: int) -> tuple[list[float], list[float]]:
    from corral.egress.audit import AuditLog
    from corral.egress.open_net import OpenNetwork

    made, closed = [], []
    for i in range(n):
        start = time.perf_counter()
        net = OpenNetwork(f"sb-bench{os.getpid():06x}{i:04x}", [], AuditLog())
        middle = time.perf_counter()
        net.close()
        made.append((middle - start) * 1000)
        closed.append((time.perf_counter() - middle) * 1000)
    return made, closed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiers", default="gvisor,process")
    parser.add_argument("--modes", default="none,allow,open")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=4)
    args = parser.parse_args()
    if "CORRAL_STATE_DIR" not in os.environ:
        os.environ["CORRAL_STATE_DIR"] = tempfile.mkdtemp(prefix="corral-bench-")
        atexit.register(shutil.rmtree, os.environ["CORRAL_STATE_DIR"], True)
    before = IP_FORWARD.read_text().strip()
    IP_FORWARD.write_text("1")
    try:
        tiers, modes = args.tiers.split(","), args.modes.split(",")
        for tier in tiers:  # warm-up: the platform probe, images, first imports
            for mode in modes:
                cold(tier, mode)
        samples: dict[tuple[str, str], list[tuple[float, float, float]]] = {(t, m): [] for t in tiers for m in modes}
        loads = [os.getloadavg()[0]]
        for _ in range(args.rounds):
            for tier in tiers:
                for mode in modes:
                    samples[tier, mode] += [cold(tier, mode) for _ in range(args.per_round)]
            loads.append(os.getloadavg()[0])
        made, closed = open_network_alone(args.rounds * args.per_round)
    finally:
        IP_FORWARD.write_text(before)
    print(f"load average (1 min) during the run: {min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} cpus")
    for column, what in enumerate(("create (until ready)", "destroy", "create -> true -> destroy")):
        print(f"{what}, ms")
        for tier in tiers:
            base = statistics.median(s[column] for s in samples[tier, "none"]) if "none" in modes else None
            for mode in modes:
                values = [s[column] for s in samples[tier, mode]]
                added = "" if base is None or mode == "none" else f"  added p50 {statistics.median(values) - base:+.1f}"
                print(f"  {tier:<8} {mode:<6} {pcts(values)}{added}")
    print("open mode's host side alone (OpenNetwork), ms")
    print(f"  create {pcts(made)}")
    print(f"  close  {pcts(closed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
