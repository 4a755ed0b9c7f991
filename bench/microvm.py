"""microVM tier figures: restore-from-snapshot vs boot-from-scratch, exec round
trip, memory per idle VM.

    .venv/bin/python bench/microvm.py [--cold N] [--exec N]

Prints p50/p95 of: cold create -> first command -> destroy (restored from the
template snapshot), the restore itself (QEMU start -> VM running -> agent
ready), exec round trip of ``true`` in a warm VM, a boot from scratch to the
guest's ready marker, and RSS of the QEMU process of an idle VM.  Target:
restore <= 250 ms under TCG.  Counts are small on purpose: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from corral import Sandbox
from corral.tiers.microvm import MicroVMSandbox
from corral.tiers.microvm import template as templates
from corral.tiers.microvm.guest import assets


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def line(name: str, values_ms: list[float]) -> None:
    print(f"{name:<44} p50 {pct(values_ms, 0.5):8.1f} ms   p95 {pct(values_ms, 0.95):8.1f} ms   (n={len(values_ms)})")


def rss_kib(pid: int) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cold", type=int, default=5)
    parser.add_argument("--exec", type=int, default=10, dest="execs")
    parser.add_argument("--boots", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("CORRAL_STATE_DIR", tempfile.mkdtemp(prefix="corral-bench-"))

    # warm the template cache (first use on a machine boots and saves it)
    with Sandbox.create(tier="microvm", memory="256M") as sb:
        inner = sb._inner
        assert isinstance(inner, MicroVMSandbox)
        accel = inner._tier.accel
        sb.commands.run(["true"])
    print(f"microvm tier, accelerator {accel}, load average {os.getloadavg()[0]:.1f}")

    cold, to_running, to_ready = [], [], []
    for _ in range(args.cold):
        start = time.monotonic()
        sb = Sandbox.create(tier="microvm", memory="256M")
        inner = sb._inner
        assert isinstance(inner, MicroVMSandbox)
        sb.commands.run(["true"])
        sb.kill()
        cold.append((time.monotonic() - start) * 1000)
        to_running.append(inner.timings["restore"] * 1000)
        to_ready.append((inner.timings["total"] - inner.timings["template"]) * 1000)
    line("cold create -> first command -> destroy", cold)
    line("restore: QEMU start -> VM running", to_running)
    line("restore: QEMU start -> agent ready", to_ready)

    with Sandbox.create(tier="microvm", memory="256M") as sb:
        inner = sb._inner
        assert isinstance(inner, MicroVMSandbox)
        sb.commands.run(["true"])
        rtt = []
        for _ in range(args.execs):
            start = time.monotonic()
            sb.commands.run(["true"])
            rtt.append((time.monotonic() - start) * 1000)
        line("exec round trip (true)", rtt)
        start = time.monotonic()
        sb.commands.run(["python3", "-c", "print(1)"])
        print(f"{'python3 -c print(1) in a warm VM':<44} {(time.monotonic() - start) * 1000:8.1f} ms")
        time.sleep(1.0)
        pid = inner.qemu_pid()
        assert pid is not None
        print(f"{'RSS of an idle VM (QEMU process)':<44} {rss_kib(pid) / 1024:8.1f} MiB"
              f"   (host cgroup: {inner.cgroup.memory_usage() / 2**20 if inner.cgroup else 0:.1f} MiB)")

    guest = assets()
    boots = []
    for _ in range(args.boots):
        with tempfile.TemporaryDirectory(prefix="corral-boot-") as tmp:
            proc, qmp, seconds = templates._boot(Path(tmp), guest, accel, 384, time.monotonic() + 180)
            qmp.close()
            proc.kill()
            proc.wait()
            boots.append(seconds * 1000)
    line("boot from scratch -> guest ready marker", boots)


if __name__ == "__main__":
    main()
