"""Start-up figures of the process tier (issue 2).

Prints p50/p95/p99 over N iterations of:
  - cold create -> first command (`true`) -> destroy, through the Python API
  - the same with network="allow" (proxy, relay, and the namespace that audits direct attempts)
  - exec round trip (`true`) in a live sandbox
  - `corral run -- true` as a whole new process (CLI start-up included)
  - the floor: bare `bwrap --unshare-all ... true`
  - a sandbox's range of 65,536 host uids: reserve + release (host-wide claim and state-dir record)
  - the range's own work on a create, timed in-process: reserve, writing the namespace's uid and
    gid maps (the helper already waiting: its start overlaps the rest of create), release;
    printed beside the cold create's p50 (run-to-run noise of a cold create here: ~+-9 ms)
  - its user namespace mapping the range (helper start, maps, descriptor) and one idmapped image
    layer (open_tree + mount_setattr), the parts of create that real owners and root inside add
and each figure's ratio to the floor and to a plain `subprocess.run(["true"])` (the same
process start with no sandbox: what an exec round trip is compared with), with the load average.

Targets on a 2-core machine: cold p50 <= 30 ms, p99 <= 60 ms (issue 16: <= 5 ms); exec p50
<= 5 ms (issue 16: <= 0.8 ms);
`corral run -- true` p50 <= 200 ms; the uid range p50 <= 1 ms (issue 13); the user
namespace and idmapped layers together p50 <= 1 ms (issue 13: root inside, real owners).

Usage: python bench/startup.py [--iterations 100] [--cli-iterations 30] [--allow-iterations 50] [--exec-only]

--exec-only: only the exec round trip and its two baselines (quick, for interleaved runs of two
checkouts: `PYTHONPATH=OTHER/src python bench/startup.py --exec-only`); it also prints the exec
round trip's host CPU (every thread of this process) per command.
"""

from __future__ import annotations

import argparse
import atexit
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return statistics.median(ordered), pick(0.95), pick(0.99)


def measure(fn: Callable[[], object], n: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def context_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of every thread of ``pid`` so far: a voluntary
    one is a sleep, each ended by a wake-up (costly on this VM), so they count the wake-ups."""
    counts = [0, 0]
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as status:
                for line in status:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        counts[line.startswith("non")] += int(line.split()[1])
        except OSError:
            pass  # a thread that ended meanwhile
    return counts[0], counts[1]


def exec_only(iterations: int) -> int:
    """The exec round trip alone, interleaved with its baseline, and the host CPU and wake-ups
    it takes."""
    from corral import Sandbox

    plain: list[float] = []
    samples: list[float] = []
    with Sandbox.create() as sb:
        measure(lambda: sb.commands.run(["true"]), 20, warmup=0)
        for _ in range(iterations):
            samples += measure(lambda: sb.commands.run(["true"]), 1, warmup=0)
            plain += measure(lambda: subprocess.run(["true"], check=True), 1, warmup=0)
        # the process tier's agent (pid 1 of the sandbox), for its own wake-ups
        agent_pid = getattr(sb._inner, "_agent_host_pid", lambda: None)()
        host_before = context_switches(os.getpid())
        agent_before = context_switches(agent_pid) if agent_pid else (0, 0)
        cpu = time.process_time()
        measure(lambda: sb.commands.run(["true"]), iterations, warmup=0)
        cpu_ms = (time.process_time() - cpu) * 1000 / iterations
        host_after = context_switches(os.getpid())
        agent_after = context_switches(agent_pid) if agent_pid else (0, 0)
    import corral

    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus; iterations {iterations}; "
          f"corral from {os.path.dirname(corral.__file__)}")
    for name, rows in (('subprocess.run(["true"]) (no sandbox)', plain), ("exec round trip in a live sandbox", samples)):
        p50, p95, p99 = percentiles(rows)
        print(f"{name:<40} p50 {p50:6.3f}  p95 {p95:6.3f}  p99 {p99:6.3f} ms  p50/true {p50 / percentiles(plain)[0]:.2f}")
    print(f"host CPU per exec round trip (all threads): {cpu_ms:.3f} ms; target p50 <= 0.8 ms (issue 16)")
    per = [(after - before) / iterations for before, after in zip(host_before + agent_before, host_after + agent_after, strict=True)]
    print(f"sleeps (wake-ups) per exec round trip: host threads {per[0]:.2f} voluntary + {per[1]:.2f} preempted"
          + (f"; the sandbox's agent {per[2]:.2f} + {per[3]:.2f}" if agent_pid else ""))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--cli-iterations", type=int, default=30)
    parser.add_argument("--allow-iterations", type=int, default=50)
    parser.add_argument("--exec-only", action="store_true")
    args = parser.parse_args()
    if "CORRAL_STATE_DIR" not in os.environ:  # a private one, removed at exit
        os.environ["CORRAL_STATE_DIR"] = tempfile.mkdtemp(prefix="corral-bench-")
        atexit.register(shutil.rmtree, os.environ["CORRAL_STATE_DIR"], True)
    if args.exec_only:
        return exec_only(args.iterations)

    from pathlib import Path

    from corral import Sandbox
    from corral.host.uids import allocate_range, release_range
    from corral.registry import state_dir

    floor_argv = ["bwrap", "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
                  "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc",
                  "--dev", "/dev", "true"]
    floor = measure(lambda: subprocess.run(floor_argv, check=True), args.iterations)
    plain = measure(lambda: subprocess.run(["true"], check=True), args.iterations)

    def cold() -> None:
        with Sandbox.create() as sb:
            sb.commands.run(["true"])

    cold_samples = measure(cold, args.iterations)

    def cold_allow() -> None:
        with Sandbox.create(allow=["example.com"]) as sb:
            sb.commands.run(["true"])

    allow_samples = measure(cold_allow, args.allow_iterations)
    with Sandbox.create() as sb:
        exec_samples = measure(lambda: sb.commands.run(["true"]), args.iterations)
    cli = [sys.executable, "-m", "corral.cli", "run", "--", "true"]
    entry = os.path.join(os.path.dirname(sys.executable), "corral")
    if os.path.exists(entry):
        cli = [entry, "run", "--", "true"]
    cli_samples = measure(lambda: subprocess.run(cli, check=True), args.cli_iterations, warmup=2)

    def cold_root() -> None:
        with Sandbox.create(user="root") as sb:
            sb.commands.run(["true"])

    root_samples = measure(cold_root, args.iterations)

    state = state_dir(Path(os.environ["CORRAL_STATE_DIR"]))
    uid_samples = measure(lambda: release_range(state, allocate_range(state, "sb-bench").base, owner="sb-bench"),
                          args.iterations)
    ids = allocate_range(state, "sb-bench-userns")
    from corral.host.idmap import idmapped_tree
    from corral.host.userns import make_userns
    from corral.tiers.linux.agent_build import agent_binary

    helper = agent_binary(state)

    def range_work() -> float:
        """ms of the range's own work in one create: reserve, map writes (+ the namespace's fd), release."""
        from corral.host.userns import start_userns

        t0 = time.perf_counter()
        ids = allocate_range(state, "sb-bench-range")
        t1 = time.perf_counter()
        pending = start_userns(helper, ids)
        stdout = pending._proc.stdout
        assert stdout is not None
        select.select([stdout], [], [], 5)  # the helper's start is not the range's work: create overlaps it
        t2 = time.perf_counter()
        os.close(pending.finish())
        t3 = time.perf_counter()
        pending.close()
        t4 = time.perf_counter()
        release_range(state, ids.base, owner="sb-bench-range")
        t5 = time.perf_counter()
        return ((t1 - t0) + (t3 - t2) + (t5 - t4)) * 1000

    for _ in range(3):
        range_work()
    range_samples = [range_work() for _ in range(max(args.iterations, 200))]
    userns_samples = measure(lambda: os.close(make_userns(helper, ids)), args.iterations)
    userns_fd = make_userns(helper, ids)
    idmap_samples = measure(lambda: os.close(idmapped_tree(Path("/usr"), userns_fd)), args.iterations)
    os.close(userns_fd)
    release_range(state, ids.base, owner="sb-bench-userns")

    floor_p50, plain_p50 = percentiles(floor)[0], percentiles(plain)[0]
    rows = [
        ("bwrap --unshare-all true (floor)", floor, ""),
        ('subprocess.run(["true"]) (no sandbox)', plain, ""),
        ("cold create -> true -> destroy (API)", cold_samples, "p50 <= 30, p99 <= 60; issue 16: p50 <= 5"),
        ("  the same, network=allow", allow_samples, ""),
        ("  the same, user=root", root_samples, ""),
        ("exec round trip in a live sandbox", exec_samples, "p50 <= 5; issue 16: p50 <= 0.8"),
        ("`corral run -- true` (whole process)", cli_samples, "p50 <= 200"),
        ("uid range: reserve + release", uid_samples, "p50 <= 1"),
        ("uid range: reserve + maps + release", range_samples, "p50 <= 1 (issue 13)"),
        ("user namespace of the range (whole)", userns_samples, "(create overlaps it)"),
        ("one idmapped image layer", idmap_samples, "x layers per create"),
    ]
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus; iterations {args.iterations}")
    print(f"{'what':<40} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'p50/floor':>10} {'p50/true':>9}  target")
    for name, samples, target in rows:
        p50, p95, p99 = percentiles(samples)
        print(f"{name:<40} {p50:8.2f} {p95:8.2f} {p99:8.2f} {p50 / floor_p50:10.2f} {p50 / plain_p50:9.2f}  {target}")
    range_p50, cold_p50 = percentiles(range_samples)[0], percentiles(cold_samples)[0]
    print(f"the uid range's own work: p50 {range_p50:.3f} ms beside a cold create's p50 {cold_p50:.2f} ms"
          f" ({100 * range_p50 / cold_p50:.1f} %); load average now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
