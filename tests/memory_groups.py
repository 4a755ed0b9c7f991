"""Memory cgroups as tests read them: whose group a page was charged to, and how much it holds."""

from __future__ import annotations

from pathlib import Path


def owner_memory_group() -> Path:
    """This process's memory group (the owner's, when it runs sandboxes itself)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") or (controllers == "" and Path("/sys/fs/cgroup/memory.current").exists()):
            root = Path("/sys/fs/cgroup/memory") if controllers else Path("/sys/fs/cgroup")
            return root / path.lstrip("/")
    raise AssertionError("no memory cgroup")


def usage(group: Path) -> int:
    """The bytes charged to ``group`` (v1 or v2)."""
    for name in ("memory.usage_in_bytes", "memory.current"):
        if (group / name).exists():
            return int((group / name).read_text())
    raise AssertionError(f"no usage file in {group}")


def limit_file(group: Path) -> Path:
    return group / ("memory.max" if (group / "memory.max").exists() else "memory.limit_in_bytes")
