"""Corral on a Ray cluster (issue 17): prints figures against the issue's targets.

    nice .venv/bin/python bench/cluster.py [--rounds 50] [--churn-seconds 60] [--churn-threads 4]

A local cluster on this host (``ray.cluster_utils.Cluster``): a head and 3 worker nodes of 8
``corral_slots``, each worker with a host actor keeping a warm pool of 2-4 sandboxes.

1. warm create (a pool hit on some node), driver to ready sandbox       target p99 <= 200 ms
2. cold create (no pool for the spec), for comparison
3. exec round trip of ``true`` on a cluster sandbox minus the same on a local one
   (baseline: ``Sandbox.create()`` in this process)                      target <= 20 ms
4. churn: create + exec + destroy for N seconds with T threads           target >= 10 per second
5. footprint: RSS of every Ray process of head + 3 nodes (host actors included, sandboxes not)
                                                                         target <= 3 GiB
Runs as root in its own state directory and cgroup parent; prints the load average.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

TAG = f"c17-bench-{os.getpid()}"
POOL_SPEC = {"limits": {"memory": "128M"}}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def report(name: str, values_ms: list[float], target: str = "") -> None:
    print(f"{name:<46} n={len(values_ms):<4} p50={pct(values_ms, 0.5):8.2f} ms  p95={pct(values_ms, 0.95):8.2f} ms"
          f"  p99={pct(values_ms, 0.99):8.2f} ms  {target}", flush=True)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def rss_of_ray() -> tuple[int, int]:
    """(bytes, processes) of every process whose command line is Ray's (gcs, raylets, agents, workers)."""
    total, count = 0, 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "site-packages/ray/" in cmdline or cmdline.startswith("ray::"):
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    count += 1
    return total, count


def wait_warm(ray: object, hosts: dict[str, object], key: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = ray.get([h.load.remote(key) for h in hosts.values()])  # type: ignore[attr-defined]
        if all(load["warm"] >= 2 for load in loads):
            return
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--churn-seconds", type=float, default=60.0)
    parser.add_argument("--churn-threads", type=int, default=4)
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix=f"{TAG}-state-"))
    temp = Path(tempfile.mkdtemp(prefix=f"{TAG}-ray-"))
    os.environ["CORRAL_STATE_DIR"] = str(state)
    os.environ["CORRAL_CGROUP_PARENT"] = TAG
    # Ray's one-machine mode (read when it is imported): a loopback address stays the loopback
    # and its servers, which run any code sent to them, bind nowhere else
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # and its token authentication, as docs/cluster.md sets a cluster up (Corral uses no cluster
    # without it); also read when Ray is imported
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    import ray
    from ray.cluster_utils import Cluster

    from corral import Sandbox
    from corral.cluster.node.actor import down, start_hosts
    from corral.spec import SandboxSpec, template_key

    print(f"load average at start: {loadavg()}; ray {ray.__version__}", flush=True)
    small = {"num_cpus": 0, "object_store_memory": 80 << 20, "node_ip_address": "127.0.0.1"}
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False,
                                                           "temp_dir": str(temp)})
    try:
        for _ in range(3):
            cluster.add_node(**small, resources={"corral_slots": 8})
        ray.init(address=cluster.address, namespace="corral", include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING")
        hosts = start_hosts(ray, pools=[{"spec": POOL_SPEC, "min_idle": 2, "max_idle": 4}])
        print(f"cluster of 4 nodes and 3 host actors up in {time.perf_counter() - t0:.1f} s", flush=True)
        key = template_key(SandboxSpec.from_dict(POOL_SPEC))

        warm: list[float] = []
        for _ in range(args.rounds):
            wait_warm(ray, hosts, key)
            t1 = time.perf_counter()
            sb = Sandbox.create(cluster=True, memory="128M")
            warm.append((time.perf_counter() - t1) * 1000)
            sb.kill()
        report("warm create (pool hit on a node)", warm, f"target p99 <= 200 ms: "
               f"{'met' if pct(warm, 0.99) <= 200 else 'MISSED'}")
        cold: list[float] = []
        for _ in range(max(10, args.rounds // 2)):
            t1 = time.perf_counter()
            sb = Sandbox.create(cluster=True, memory="192M")
            cold.append((time.perf_counter() - t1) * 1000)
            sb.kill()
        report("cold create (no pool for the spec)", cold)

        def round_trips(sb: Sandbox) -> list[float]:
            times = []
            sb.commands.run(["true"])
            for _ in range(args.rounds * 2):
                t1 = time.perf_counter()
                sb.commands.run(["true"])
                times.append((time.perf_counter() - t1) * 1000)
            return times

        with Sandbox.create() as local:
            local_times = round_trips(local)
        with Sandbox.create(cluster=True) as remote:
            cluster_times = round_trips(remote)
        report("exec `true`, local sandbox (baseline)", local_times)
        report("exec `true`, cluster sandbox", cluster_times)
        over50 = pct(cluster_times, 0.5) - pct(local_times, 0.5)
        over99 = pct(cluster_times, 0.99) - pct(local_times, 0.99)
        print(f"{'exec overhead over local':<46} p50=+{over50:.2f} ms  p99=+{over99:.2f} ms  target <= 20 ms: "
              f"p50 {'met' if over50 <= 20 else 'MISSED'}, p99 {'met' if over99 <= 20 else 'MISSED'} "
              f"(p50 x{pct(cluster_times, 0.5) / pct(local_times, 0.5):.2f} of local)", flush=True)

        done = [0]
        failed: list[str] = []
        stop = time.monotonic() + args.churn_seconds
        lock = threading.Lock()

        def churn() -> None:
            while time.monotonic() < stop:
                try:
                    with Sandbox.create(cluster=True, memory="128M") as sb:
                        sb.commands.run(["true"])
                    with lock:
                        done[0] += 1
                except Exception as exc:
                    failed.append(repr(exc))

        t1 = time.perf_counter()
        threads = [threading.Thread(target=churn) for _ in range(args.churn_threads)]
        for thread in threads:
            thread.start()
        footprint = (0, 0)
        while any(t.is_alive() for t in threads):
            time.sleep(1)
            footprint = max(footprint, rss_of_ray())
        elapsed = time.perf_counter() - t1
        rate = done[0] / elapsed
        print(f"{'churn create+exec+destroy':<46} {done[0]} in {elapsed:.1f} s with {args.churn_threads} threads = "
              f"{rate:.1f}/s, {len(failed)} failed  target >= 10/s: {'met' if rate >= 10 else 'MISSED'}", flush=True)
        if failed:
            print("  first failure:", failed[0])
        print(f"{'footprint: RSS of Ray processes (peak in churn)':<46} {footprint[0] / 2**30:.2f} GiB in "
              f"{footprint[1]} processes (head + 3 nodes + 3 host actors)  target <= 3 GiB: "
              f"{'met' if footprint[0] <= 3 * 2**30 else 'MISSED'}", flush=True)
        print(f"load average at end: {loadavg()}", flush=True)
        down(True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        from corral.host import cgroup_tree, cgroups, mounts
        from corral.registry import gc

        gc(state)
        mounts.unmount_all(state)
        shutil.rmtree(state, ignore_errors=True)
        layout = cgroups.detect()
        for root in {*layout.controllers.values(), layout.kill_root}:
            if (root / TAG).is_dir():
                cgroup_tree.remove_tree(root / TAG)
    return 0


if __name__ == "__main__":
    sys.exit(main())
