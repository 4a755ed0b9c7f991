"""Image figures: cold build, no-change rebuild (target < 1 s), sandbox start from a built image vs `host`
(target: within 20 %).

    .venv/bin/python bench/images.py            # rebuild + start figures; cold build times as recorded
    .venv/bin/python bench/images.py --cold     # also build base and python-data from nothing (minutes)

Run as root. The cold build uses a temporary image directory (no apt cache), so it includes downloads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corral import Sandbox
from corral.images import recipe as recipes
from corral.images import store
from corral.images.build import build
from corral.registry import state_dir


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return f"p50 {statistics.median(ordered) * 1000:8.1f} ms  p95 {pick(0.95) * 1000:8.1f} ms  " \
           f"p99 {pick(0.99) * 1000:8.1f} ms  (n={len(ordered)})"


def cold_builds(names: list[str], state: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-images-", dir="/var/tmp"))
    try:
        for name in names:
            started = time.monotonic()
            result = build(recipes.load(name), state, root=tmp)
            print(f"cold build {name:<12} {time.monotonic() - started:8.1f} s  "
                  f"{result.record.size / 2**20:7.0f} MiB  {result.record.packages} packages")
    finally:
        store.remove_tree(tmp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="also time builds from nothing")
    parser.add_argument("-n", type=int, default=20, help="sandbox starts per image (default 20)")
    args = parser.parse_args()
    state = state_dir(os.environ.get("CORRAL_STATE_DIR") or tempfile.mkdtemp(prefix="corral-bench-state-"))
    images = ["base", "python-data"]

    for name in images:  # make sure they exist (a cold build the first time)
        result = build(recipes.load(name), state)
        seconds = _recorded_seconds(result.record.path)
        print(f"image {name:<12} {result.record.digest[:19]}  {result.record.size / 2**20:7.0f} MiB  "
              f"{result.record.packages} packages; its build took "
              + (f"{seconds:.1f} s" if seconds else "(not recorded)"))
    if args.cold:
        cold_builds(images, state)

    samples = []
    for _ in range(10):
        started = time.monotonic()
        result = build(recipes.load("base"), state)
        samples.append(time.monotonic() - started)
        assert not result.built
    print(f"no-change rebuild (API)   {percentiles(samples)}   target < 1000 ms")
    corral = [sys.executable, "-c", "import sys; from corral.cli import main; sys.exit(main())"]
    cli = []
    for _ in range(3):
        started = time.monotonic()
        subprocess.run([*corral, "image", "build", "-q", "base"], check=True, capture_output=True)
        cli.append(time.monotonic() - started)
    print(f"no-change rebuild (CLI)   {percentiles(cli)}   (includes Python start-up)")

    starts: dict[str, list[float]] = {"host": [], "base": [], "python-data": []}
    for name in starts:  # warm-up: host skeleton, seccomp filter, page cache
        Sandbox.create(image=name, state=state).kill()
    for _ in range(args.n):
        for name, bucket in starts.items():  # interleaved: background load hits every image alike
            started = time.monotonic()
            with Sandbox.create(image=name, state=state) as sb:
                sb.commands.run("true")
                bucket.append(time.monotonic() - started)
    host = statistics.median(starts["host"])
    for name, bucket in starts.items():
        ratio = statistics.median(bucket) / host
        print(f"start+true+kill {name:<12} {percentiles(bucket)}   x{ratio:.2f} of host (target <= 1.20)")

    first_cell = []
    for _ in range(3):
        with Sandbox.create(image="python-data", state=state) as sb:
            started = time.monotonic()
            sb.run_code("import pandas, matplotlib.pyplot")
            first_cell.append(time.monotonic() - started)
    print(f"first cell importing pandas+pyplot {percentiles(first_cell)}")
    if "CORRAL_STATE_DIR" not in os.environ:
        shutil.rmtree(state, ignore_errors=True)
    return 0


def _recorded_seconds(path: Path) -> float:
    import json

    try:
        return float(json.loads((path / "image.json").read_text()).get("build_seconds", 0.0))
    except (OSError, ValueError):
        return 0.0


if __name__ == "__main__":
    sys.exit(main())
