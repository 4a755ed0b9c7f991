"""Workspace figures (issue 16, target 6): what a workspace's size costs a sandbox.

For N-file workspaces (4 KiB files, 100 to a directory: 20,000 files is ~80 MB) in the default
``rw`` mode, prints p50/p95 of:
  - create (``Sandbox.create`` until it returns), and the same without a workspace (the floor);
  - exec round trip (``true``), which writes the workspace back after every command;
  - exec once the sandbox has changed C files (write-back walks what changed, not the workspace);
  - one command that changes one file, the write-back of that file included;
for the overlay (now: the host directory as the overlay's idmapped lower layer) and the copy
(before: ``corral.host.ws_overlay.ENABLED = False``), with the ratio copy/overlay; and how many
upper-layer entries the write-back of one ``true`` looked at after the C changes (with the change
watch: none; ``--no-watch``, the overlay before it, walks every one at every command).

Targets with 100,000 files: exec p50 <= 2 ms, create <= 20 ms above the floor.

Usage: python bench/workspace.py [--files 20000 100000] [--iterations 15] [--execs 200]
                                 [--copy-iterations 3] [--tier process] [--changed 1000] [--no-watch]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def make_workspace(root: Path, files: int) -> None:
    block = os.urandom(4096)
    for d in range((files + 99) // 100):
        sub = root / f"d{d:05}"
        sub.mkdir()
        for f in range(min(100, files - d * 100)):
            (sub / f"f{f:03}.txt").write_bytes(block)


def bench(workspace: Path, tier: str, iterations: int, execs: int, changed: int,
          looked: list[int] | None = None) -> dict[str, list[float]]:
    from corral import Sandbox
    from corral.host.ws_overlay import WorkspaceOverlay

    figures: dict[str, list[float]] = {"create": [], "create, no workspace": [], "exec": [],
                                       f"exec, {changed} changed": [], "change 1 file": []}
    for _ in range(iterations):  # alternating, so that both see the same machine
        for name, ws in (("create", str(workspace)), ("create, no workspace", None)):
            start = time.perf_counter()
            made = Sandbox.create(tier=tier, workspace=ws, disk="2G", memory="512M")
            figures[name].append((time.perf_counter() - start) * 1000)
            made.close()
    with Sandbox.create(tier=tier, workspace=str(workspace), disk="2G", memory="512M") as sb:
        for _ in range(3):
            sb.commands.run(["true"])
        figures["exec"] = [timed(lambda: sb.commands.run(["true"])) for _ in range(execs)]
        figures["change 1 file"] = [timed(lambda: sb.commands.run(["sh", "-c", "echo x >> /workspace/d00000/f000.txt"]))
                                    for _ in range(max(5, execs // 10))]
        dirs = (changed + 99) // 100
        sb.commands.run(["sh", "-c", f"for d in $(ls /workspace | head -n {dirs}); do touch /workspace/$d/*; done"],
                        timeout=300)
        sb.commands.run(["true"])
        figures[f"exec, {changed} changed"] = [timed(lambda: sb.commands.run(["true"])) for _ in range(execs)]
        overlay = getattr(sb._tier_sandbox(), "workspace", None)
        if looked is not None and isinstance(overlay, WorkspaceOverlay):
            looked.append(overlay.looked_at)
    return figures


def mount_only(n: int) -> list[float]:
    """The overlay's own part of create: the workspace's user namespace, the view, the mount."""
    from corral.host import mounts
    from corral.host.uids import allocate_range, release_range
    from corral.host.userns import start_userns
    from corral.host.ws_overlay import mount_workspace, owner_maps
    from corral.tiers.linux.agent_build import agent_binary

    state = Path(os.environ["CORRAL_STATE_DIR"])
    helper = agent_binary(state)
    ids = allocate_range(state, "bench-ws")
    base = Path(tempfile.mkdtemp(prefix="corral-bench-mnt-"))
    samples = []
    try:
        for i in range(n):
            host, upper, work, merged = (base / f"{name}{i}" for name in "huwm")
            for d in (host, upper, work, merged):
                d.mkdir()
            start = time.perf_counter()
            pending = start_userns(helper, ids)
            fd = pending.finish(owner_maps(host, ids.user))
            mount_workspace(host, merged, upper, work, fd, read_only=False)
            samples.append((time.perf_counter() - start) * 1000)
            pending.close()
            os.close(fd)
            mounts.umount(merged)
    finally:
        release_range(state, ids.base, owner="bench-ws")
        shutil.rmtree(base, ignore_errors=True)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, nargs="+", default=[20000, 100000])
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--copy-iterations", type=int, default=3)
    parser.add_argument("--execs", type=int, default=200)
    parser.add_argument("--changed", type=int, default=1000)
    parser.add_argument("--tier", default="process")
    parser.add_argument("--no-watch", action="store_true", help="the overlay without its change watch (before it)")
    args = parser.parse_args()
    own_state = "CORRAL_STATE_DIR" not in os.environ
    os.environ.setdefault("CORRAL_STATE_DIR", tempfile.mkdtemp(prefix="corral-bench-ws-state-"))
    try:
        return run(args)
    finally:
        if own_state:  # every sandbox is closed by now: nothing is mounted there
            shutil.rmtree(os.environ["CORRAL_STATE_DIR"], ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    from corral import Sandbox
    from corral.host import ws_overlay

    for _ in range(3):  # warm-up: imports, the image, the agent binary
        Sandbox.create(tier=args.tier).close()
    with Sandbox.create(tier=args.tier) as sb:
        bare_exec = [timed(lambda: sb.commands.run(["true"])) for _ in range(args.execs)]
    print(f"tier {args.tier}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus")
    print(f"no workspace: exec p50 {percentiles(bare_exec)[0]:.2f} ms; the workspace mount alone "
          f"(its user namespace, idmapped view, overlay) p50 {percentiles(mount_only(args.iterations * 4))[0]:.2f} ms")
    print(f"{'files':>7} {'figure':<22} {'overlay p50':>11} {'p95':>8} {'copy p50':>10} {'p95':>8} {'copy/overlay':>12}")
    for files in args.files:
        root = Path(tempfile.mkdtemp(prefix="corral-bench-ws-"))
        try:
            make_workspace(root, files)
            ws_overlay.ENABLED, ws_overlay.WATCH = True, not args.no_watch
            looked: list[int] = []
            new = bench(root, args.tier, args.iterations, args.execs, args.changed, looked)
            shutil.rmtree(root)
            root.mkdir()
            make_workspace(root, files)
            ws_overlay.ENABLED = False
            old = bench(root, args.tier, args.copy_iterations, max(20, args.execs // 10), args.changed)
        finally:
            ws_overlay.ENABLED = True
            shutil.rmtree(root, ignore_errors=True)
        for name in new:
            n50, n95 = percentiles(new[name])
            o50, o95 = percentiles(old[name])
            print(f"{files:>7} {name:<22} {n50:>9.2f}ms {n95:>6.2f}ms {o50:>8.1f}ms {o95:>6.1f}ms {o50 / n50:>11.1f}x")
        print(f"        write-back of one command after {args.changed} changed looked at {looked[0] if looked else '?'}"
              f" upper-layer entries ({'no change watch' if args.no_watch else 'change watch'});"
              f" load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
