"""A cgroup and everything below it: its processes, killing them all, removing the tree.

The kill tree's mechanics for :mod:`.cgroups` (one leaf per command, killed as a whole: with
``cgroup.kill`` where a v2 hierarchy has it, else by freezing and signalling), and what the
janitor and the tests use to empty and remove groups left behind.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path


def write(path: Path, value: str) -> None:
    """Write a control file (one open, one write: its value is taken as a whole)."""
    with open(path, "w") as f:
        f.write(value)


def read_pids(group: Path) -> list[int]:
    try:
        return [int(x) for x in (group / "cgroup.procs").read_text().split()]
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENODEV):  # gone, or going (removed while read)
            return []
        raise


def all_groups(group: Path) -> list[Path]:
    """``group`` and every group below it, as they are now: a child removed during the walk
    (a command's leaf retired on another thread) is skipped, never an error."""
    found, todo = [], [group]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            with os.scandir(current) as entries:
                todo += [Path(entry.path) for entry in entries if entry.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            continue
    return found


def kill_group(group: Path, mode: str, deadline: float = 5.0, signalled: Callable[[], None] | None = None) -> None:
    """Kill every process in ``group`` (recursively) and wait until it is empty; ``signalled``
    is called once every process has its SIGKILL, before the wait."""
    if not group.exists():
        return
    end = time.monotonic() + deadline
    if mode == "cgroup.kill":
        try:
            write(group / "cgroup.kill", "1")
        except OSError as exc:
            # ENODEV: the group is being removed (its command just ended and retired it)
            if exc.errno in (errno.ENOENT, errno.ENODEV):
                return
            raise
        if signalled is not None:
            signalled()
    else:
        _freeze_kill(group, mode, end, signalled)
    while time.monotonic() < end:
        if not _populated(group, mode):
            return
        time.sleep(0.002)


def _freeze_kill(group: Path, mode: str, end: float, signalled: Callable[[], None] | None) -> None:
    # freeze first so nothing can fork while we kill, then thaw so SIGKILL lands
    freeze_file, frozen, thawed = (
        ("freezer.state", "FROZEN", "THAWED") if mode == "freezer" else ("cgroup.freeze", "1", "0")
    )
    while time.monotonic() < end:
        groups = all_groups(group)
        pids = [pid for g in groups for pid in read_pids(g)]
        if not pids:
            if signalled is not None:
                signalled()
            return
        try:
            write(group / freeze_file, frozen)
        except OSError:
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            write(group / freeze_file, thawed)
        except OSError:
            pass
        if signalled is not None:
            # every process listed has its SIGKILL; one forked between the listing and the
            # freeze runs until the next pass, a millisecond on
            signalled()
            signalled = None
        time.sleep(0.001)


def _populated(group: Path, mode: str) -> bool:
    if mode != "freezer":
        try:
            for line in (group / "cgroup.events").read_text().splitlines():
                if line.startswith("populated "):
                    return line.split()[1] == "1"
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENODEV):
                return False
            raise
    return any(read_pids(g) for g in all_groups(group))


def rmdir_group(path: Path, tries: int = 400) -> None:
    """rmdir a group without children, retrying while tasks still leave it (EBUSY); gone is fine."""
    for _ in range(tries):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            time.sleep(0.005)


def remove_tree(group: Path) -> None:
    """rmdir a group and its children, deepest first; tolerate races with exiting tasks."""
    try:
        group.rmdir()  # the common case, a group without children: no walk over its files
        return
    except FileNotFoundError:
        return
    except OSError:
        pass  # children, or tasks still leaving: walk and retry below
    for path in [Path(top) for top, _, _ in os.walk(group, topdown=False)]:
        rmdir_group(path)
