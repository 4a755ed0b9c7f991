"""Cost of a create with many sandboxes alive, and what bounds how many fit (issue 16, target 2).

Fills the host with idle sandboxes (64 MiB each) one after another, in stages
(``--stages 1000,2000``: the count alive at the end of each), and at each stage prints:

- cold create p50 (create -> `true` -> destroy, 20 samples) with that many alive, and its
  ratio to the p50 with none alive (target <= 1.5);
- create p50 of each successive tenth of the fill (where an O(live) cost shows);
- memory per idle sandbox: the host's MemAvailable drop, and of it the sandboxes' processes
  (PSS), kernel slab and tmpfs (Shmem); host mounts, processes, owner fds and threads per
  sandbox;
- the host's responsiveness: `/usr/bin/python3 -c pass` (wall) now vs with none alive.

It stops early (and says why) when a create fails, when the host's responsiveness is more
than ``--slow`` times worse than at the start, or when MemAvailable falls under 25%.  Last,
the limits these counts run into: uid ranges, pid_max, the owner's RLIMIT_NOFILE, the
namespace sysctls, memory.

Usage: python bench/density.py [--stages 1000] [--slow 4]
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
from typing import Any


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def host_mounts() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for _ in f)


def cold_p50(sandbox_cls: Any, n: int = 20) -> float:
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


FLOOR = ["bwrap", "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
         "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "true"]


def paired_p50(sandbox_cls: Any, n: int = 20) -> tuple[float, float]:
    """(cold create p50, bare bwrap p50), their samples taken in turn: both see the same load,
    so their ratio holds on a busy host where either alone drifts with the neighbours."""
    creates, floors = [], []
    for _ in range(n):
        start = time.perf_counter()
        with sandbox_cls.create(memory="64M") as sb:
            sb.commands.run(["true"])
        middle = time.perf_counter()
        subprocess.run(FLOOR, check=True)
        creates.append((middle - start) * 1000)
        floors.append((time.perf_counter() - middle) * 1000)
    return statistics.median(creates), statistics.median(floors)


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def pss_of(marker: str) -> tuple[int, int]:
    """(processes, summed PSS in bytes) of the processes whose cgroup path names ``marker``."""
    count = total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker not in Path(f"/proc/{pid}/cgroup").read_text():
                continue
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        count += 1
                        break
        except OSError:
            continue
    return count, total


def sysctl(name: str) -> str:
    try:
        return Path("/proc/sys", name).read_text().strip()
    except OSError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="1000", help="counts alive at the end of each stage, e.g. 1000,2000")
    parser.add_argument("--count", type=int, help="one stage of this many (the old form)")
    parser.add_argument("--slow", type=float, default=4.0, help="stop when python3 -c pass is this many times slower")
    args = parser.parse_args()
    stages = [args.count] if args.count else [int(x) for x in args.stages.split(",")]
    state = tempfile.mkdtemp(prefix="corral-bench-density-")
    os.environ["CORRAL_STATE_DIR"] = state
    own_parent = "CORRAL_CGROUP_PARENT" not in os.environ
    parent = os.environ.setdefault("CORRAL_CGROUP_PARENT", "corral-bench-density")

    from corral import Sandbox
    from corral.host.uids import SLOTS

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; RLIMIT_NOFILE {soft}/{hard}")
    cold_p50(Sandbox, 3)  # warm: the image, the agent binary, the seccomp filter
    empty, floor_empty = paired_p50(Sandbox)
    python_empty = python_wall()
    mem0, slab0, shmem0, mounts0 = mem_available(), meminfo("Slab"), meminfo("Shmem"), host_mounts()
    fds0, threads0 = len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
    pids0 = len([p for p in os.listdir("/proc") if p.isdigit()])
    print(f"cold create p50 with none alive: {empty:.1f} ms; bare bwrap {floor_empty:.1f} ms; "
          f"python3 -c pass {python_empty:.1f} ms; host mounts {mounts0}")
    live: list[object] = []
    stop = ""
    try:
        for target in stages:
            creates = []
            while len(live) < target and not stop:
                start = time.perf_counter()
                try:
                    live.append(Sandbox.create(memory="64M"))
                except Exception as exc:  # the limit this host ran into: say which
                    stop = f"create {len(live) + 1} failed: {type(exc).__name__}: {exc}"
                    break
                creates.append((time.perf_counter() - start) * 1000)
                if len(live) % 250 == 0:
                    if mem_available() < meminfo("MemTotal") // 4:
                        stop = f"MemAvailable under 25% at {len(live)} alive"
                    elif python_wall() > args.slow * python_empty:
                        stop = f"host responsiveness over {args.slow}x worse at {len(live)} alive"
            n = len(live)
            if not n:
                break
            full, floor = paired_p50(Sandbox)
            tenth = max(1, len(creates) // 10)
            print(f"-- {n} idle sandboxes alive (load average {os.getloadavg()[0]:.2f})")
            print(f"cold create p50: {empty:.1f} ms with none alive, {full:.1f} ms with {n} alive: "
                  f"ratio {full / empty:.2f} (target <= 1.5); bare bwrap, sampled in turn: {floor_empty:.1f} -> "
                  f"{floor:.1f} ms; create / bwrap {empty / floor_empty:.2f} -> {full / floor:.2f}: "
                  f"ratio {(full / floor) / (empty / floor_empty):.2f} (the load-independent form of the target)")
            if creates:
                print("create p50 by tenth of this stage's fill (ms): " + " ".join(
                    f"{statistics.median(creates[i:i + tenth]):.1f}" for i in range(0, len(creates), tenth)))
            procs, pss = pss_of(parent)
            pids = len([p for p in os.listdir("/proc") if p.isdigit()]) - pids0
            mib = 2**20
            print(f"per idle sandbox: {(mem0 - mem_available()) / n / mib:.2f} MiB of host memory (MemAvailable), "
                  f"of which processes {pss / n / mib:.2f} MiB PSS ({procs / n:.1f} processes), "
                  f"kernel slab {(meminfo('Slab') - slab0) / n / mib:.2f} MiB, "
                  f"tmpfs {(meminfo('Shmem') - shmem0) / n / mib:.2f} MiB")
            print(f"per idle sandbox: {(host_mounts() - mounts0) / n:.1f} host mounts, {pids / n:.1f} host processes, "
                  f"{(len(os.listdir('/proc/self/fd')) - fds0) / n:.1f} owner fds, "
                  f"{(len(os.listdir('/proc/self/task')) - threads0) / n:.1f} owner threads")
            print(f"host responsiveness: /usr/bin/python3 -c pass {python_empty:.1f} ms with none alive, "
                  f"{python_wall():.1f} ms now")
            if stop:
                break
        print(f"stopped: {stop}" if stop else f"stopped at the last stage ({len(live)} alive), not at a limit")
        print(f"limits: uid ranges (one of 65,536 ids per sandbox) {SLOTS}; pid_max {sysctl('kernel/pid_max')}; "
              f"owner fds {soft}; user/mnt/net namespaces {sysctl('user/max_user_namespaces')}/"
              f"{sysctl('user/max_mnt_namespaces')}/{sysctl('user/max_net_namespaces')}; "
              f"mount-max per namespace {sysctl('fs/mount-max')}; MemTotal {meminfo('MemTotal') / 2**30:.1f} GiB")
    finally:
        start = time.perf_counter()
        for sb in live:
            sb.kill()  # type: ignore[attr-defined]
        print(f"destroyed {len(live)} in {time.perf_counter() - start:.1f} s; "
              f"load average at end: {os.getloadavg()[0]:.2f}")
        shutil.rmtree(state, ignore_errors=True)
        if own_parent:  # the bench's own parent groups, empty now: leave no cgroup behind
            from corral.host import cgroup_tree, cgroups

            layout = cgroups.detect()
            for root in {*layout.controllers.values(), layout.kill_root}:
                cgroup_tree.remove_tree(root / parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
