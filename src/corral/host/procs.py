"""Processes and their trees as ``/proc`` shows them (host pids)."""

from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's), empty when it is gone."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(child) for child in f.read().split())
        except FileNotFoundError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children.

    A process forked while the walk runs may be missed: callers use this only
    where the tree cannot grow (e.g. before the sandbox's agent is let go)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def process_start_time(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (tells pid reuse apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])
