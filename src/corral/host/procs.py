"""Processes and their trees as ``/proc`` shows them (host pids)."""

from __future__ import annotations

import os
import subprocess
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


_PF_EXITING = 0x4


def exited_within(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``proc`` to end (and reap it); whether it did."""
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def process_start_time(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (tells pid reuse apart)."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None else None


def named_process_lives(name: str) -> bool | None:
    """Whether the process ``PID.START`` (pid and :func:`process_start_time`: a reused pid is
    another process) or ``PID`` alone (names made before the start time was added) still runs;
    None when ``name`` names no process."""
    pid, dot, start = name.partition(".")
    if not pid.isdigit() or (dot and not start.isdigit()):
        return None
    started = process_start_time(int(pid))
    return started is not None and (not dot or started == int(start))


def exiting(pid: int) -> bool:
    """True if ``pid`` is gone, a zombie, or on its way out (``PF_EXITING``: the kernel no
    longer moves it between cgroups, and it will never run again)."""
    fields = _stat(pid)
    # state, ppid, pgrp, session, tty_nr, tpgid, flags
    return fields is None or fields[0] in ("Z", "X", "x") or bool(int(fields[6]) & _PF_EXITING)


def raise_open_files_limit(to_kernel_bound: bool = False) -> int:
    """Raise this process's open-files limit; returns the new soft limit.

    Each live sandbox holds descriptors in its owner (its agent channel, ~2; an ``allow``
    sandbox's egress tunnels, up to ~6 each for 256): under a distribution's default soft limit
    of 1024 an owner would fail at a few hundred sandboxes.  The soft limit goes to the hard one.

    ``to_kernel_bound`` (``corral serve``, whose sandboxes are many tenants'): as root
    (``CAP_SYS_RESOURCE``) both go to ``fs.nr_open``, the kernel's bound -- at this host's hard
    limit (20,000) a dozen sandboxes of one tenant using every tunnel left the server no
    descriptor for another tenant's create.  Not for the library, whose owner is the caller's
    own process: its other children would inherit a million (and some close every one of them).
    Sandboxes inherit neither: a command starts with 1024 (``agent/exec.c``)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if to_kernel_bound and os.geteuid() == 0 and hard != resource.RLIM_INFINITY:
        try:
            nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
            if nr_open > hard:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nr_open, nr_open))
                return nr_open
        except (OSError, ValueError):
            pass
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            pass
    return soft


def host_memory() -> int:
    """The host's memory (``MemTotal``), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 1 << 30
