"""Memory cgroups as tests read them: whose group a page was charged to, and how much it holds."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def owner_memory_group() -> Path:
    """This process's memory group (the owner's, when it runs sandboxes itself)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") or (controllers == "" and Path("/sys/fs/cgroup/memory.current").exists()):
            root = Path("/sys/fs/cgroup/memory") if controllers else Path("/sys/fs/cgroup")
            return root / path.lstrip("/")
    raise AssertionError("no memory cgroup")


@pytest.fixture
def owner_group() -> Iterator[Path]:
    """A memory group of this test's own, this process moved into it for the test: the group the
    pytest worker starts in is shared (here the root's, the whole host's usage), and another
    worker's or process's allocations there made a test's "the owner grew by less than half" fail
    in a parallel run.  Charges made meanwhile stay with the group (reparented when it goes)."""
    before = owner_memory_group()
    v1 = Path("/sys/fs/cgroup/memory") in (before, *before.parents)
    root = Path("/sys/fs/cgroup/memory") if v1 else Path("/sys/fs/cgroup")
    mine = root / f"corral-test-owner-{os.getpid()}"
    mine.mkdir(exist_ok=True)
    (mine / "cgroup.procs").write_text(str(os.getpid()))
    try:
        yield mine
    finally:
        # with the processes it started that live on (a wasm zygote, a pool's spares): they would
        # have been in the worker's group had it not moved
        for _ in range(10):
            pids = (mine / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    (before / "cgroup.procs").write_text(pid)
        mine.rmdir()


def usage(group: Path) -> int:
    """The bytes charged to ``group`` (v1 or v2)."""
    for name in ("memory.usage_in_bytes", "memory.current"):
        if (group / name).exists():
            return int((group / name).read_text())
    raise AssertionError(f"no usage file in {group}")


def limit_file(group: Path) -> Path:
    return group / ("memory.max" if (group / "memory.max").exists() else "memory.limit_in_bytes")
