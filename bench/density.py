"""Cost of a create with many sandboxes alive, and what bounds how many fit (issue 16, target 2).

Creates ``--count`` idle sandboxes (64 MiB each) one after another and prints:

- cold create p50 (create -> `true` -> destroy, 20 samples) with none alive and with
  ``--count`` alive, and their ratio (target <= 1.5);
- create p50 of each successive tenth of the fill (where the O(live) cost shows);
- memory per idle sandbox (host MemAvailable drop / count), host mounts, pids and
  the owner's fds and threads per sandbox, and the host's own responsiveness
  (`/usr/bin/python3 -c pass`, wall) with all of them alive;
- the kernel limits those counts run into (pid_max, the owner's RLIMIT_NOFILE,
  mount-max per namespace, the uid range).

Usage: python bench/density.py [--count 1000]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def host_mounts() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for _ in f)


def cold_p50(sandbox_cls: type, n: int = 20) -> float:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        with sandbox_cls.create(memory="64M") as sb:
            sb.commands.run(["true"])
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def python_wall() -> float:
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-c", "pass"], check=True)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=1000)
    args = parser.parse_args()
    state = tempfile.mkdtemp(prefix="corral-bench-density-")
    os.environ["CORRAL_STATE_DIR"] = state
    os.environ.setdefault("CORRAL_CGROUP_PARENT", "corral-bench-density")

    from corral import Sandbox

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; RLIMIT_NOFILE {soft}/{hard}")
    empty = cold_p50(Sandbox)
    python_empty = python_wall()
    mem0, mounts0 = mem_available(), host_mounts()
    fds0, threads0 = len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
    pids0 = len([p for p in os.listdir("/proc") if p.isdigit()])
    live, creates = [], []
    try:
        for _ in range(args.count):
            start = time.perf_counter()
            live.append(Sandbox.create(memory="64M"))
            creates.append((time.perf_counter() - start) * 1000)
        full = cold_p50(Sandbox)
        n = len(live)
        tenth = max(1, n // 10)
        print(f"{n} idle sandboxes alive")
        print(f"cold create p50: {empty:.1f} ms with none alive, {full:.1f} ms with {n} alive: "
              f"ratio {full / empty:.2f} (target <= 1.5)")
        print("create p50 by tenth of the fill: " + " ".join(
            f"{statistics.median(creates[i:i + tenth]):.1f}" for i in range(0, n, tenth)))
        pids = len([p for p in os.listdir("/proc") if p.isdigit()]) - pids0
        print(f"per idle sandbox: {(mem0 - mem_available()) / n / 2**20:.2f} MiB of host memory, "
              f"{(host_mounts() - mounts0) / n:.1f} host mounts, {pids / n:.1f} host processes, "
              f"{(len(os.listdir('/proc/self/fd')) - fds0) / n:.1f} owner fds, "
              f"{(len(os.listdir('/proc/self/task')) - threads0) / n:.1f} owner threads")
        print(f"host responsiveness: /usr/bin/python3 -c pass {python_empty:.1f} ms with none alive, {python_wall():.1f} ms now")
        pid_max = Path("/proc/sys/kernel/pid_max").read_text().strip()
        mount_max = Path("/proc/sys/fs/mount-max").read_text().strip()
        print(f"limits: pid_max {pid_max}; owner fds {soft}; mount-max per namespace {mount_max}")
    finally:
        start = time.perf_counter()
        for sb in live:
            sb.kill()
        print(f"destroyed {len(live)} in {time.perf_counter() - start:.1f} s; "
              f"load average at end: {os.getloadavg()[0]:.2f}")
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
