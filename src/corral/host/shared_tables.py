"""The kernel's host-wide tables that sandboxes draw from, sized so that none can be emptied by
a sandbox for the others.

Each of these is one pool for the whole host, counted in entries, while what an entry costs is
charged to the memory cgroup of the process that takes it (open files, tasks and their kernel
stacks, terminals): the sandbox's memory limit is the real bound on its share.  A table smaller
than what the sandboxes' memory limits allow is a pool one sandbox can empty for everyone --
measured on this host (Debian 12 without systemd, so at the kernel's defaults):

- ``fs.file-max`` (2,466,093 here): a 512 MiB sandbox can hold ~2.2 M open files; two fill the
  table, and every other sandbox's ``open`` fails with ENFILE;
- ``kernel.pid_max`` (32,768 here: the kernel's default on a machine with few CPUs): one
  sandbox given ``pids=40000``, or 128 fork bombs at the default 256, leave the host no pid;
- ``kernel.threads-max`` (192,724 here: the kernel sizes it so that kernel stacks fill at most
  an eighth of RAM; every task, thread or process, counts): two 4 GiB sandboxes given
  ``pids=100100`` started 96,000 threads each (a uid's ``RLIMIT_NPROC`` is half the table) and
  no other sandbox nor the host could fork;
- ``kernel.pty.max`` (4,096, of which 1,024 are kept for the host's own ``/dev/pts``): one
  sandbox opened 3,071 terminals and every other sandbox's ``openpty`` failed.  Each sandbox
  of the process tier now has its own ``devpts`` with at most :data:`PTYS_PER_SANDBOX`
  (``tiers/process``), and the table is widened so that as many sandboxes as this host can
  hold may each use theirs.

:func:`widen` raises each to the value systemd has set at boot since v240/v243 (``fs.file-max``
to ``LONG_MAX``, ``kernel.pid_max`` to ``PID_MAX_LIMIT``) -- on most hosts they are there
already --, ``kernel.threads-max`` to the same (a task needs a pid: the pid table is then the
one bound left beside memory) and ``kernel.pty.max`` to the kernel's maximum.  It only ever
raises, once per process, at the first sandbox.  Where it cannot (no root, a read-only ``/proc/sys``) the
sandboxes still run, and ``corral doctor`` says which table stays narrow.

The conntrack table, charged to no cgroup either, is bounded per sandbox by its own rule
(``egress/open_net.py``).  The asynchronous I/O table (``fs.aio-max-nr``, 65,536 events: one sandbox's 16 ``io_setup``
calls took all of it) is not widened: its rings are not charged to the sandbox, so the
process tier refuses ``io_setup`` instead (``host/seccomp.py``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: terminals a process-tier sandbox may have open at once (its ``devpts``'s ``max``): the agent's
#: own terminal commands are at most 64
PTYS_PER_SANDBOX = 128


@dataclass(frozen=True)
class Table:
    """One host-wide table: its sysctl, the least Corral wants, and why."""

    name: str
    wanted: int
    why: str

    @property
    def path(self) -> Path:
        return Path("/proc/sys") / self.name.replace(".", "/")


TABLES = (
    Table("fs.file-max", 2**63 - 1, "open files (each charged to its sandbox's memory)"),
    Table("kernel.pid_max", 4_194_304, "process ids (each sandbox's bounded by its pids limit)"),
    Table("kernel.threads-max", 4_194_304, "tasks (each charged to its sandbox's memory, bounded by its pids limit)"),
    Table("kernel.pty.max", 1 << 20, f"terminals ({PTYS_PER_SANDBOX} per sandbox)"),
)

_done = False
_lock = threading.Lock()


def current(table: Table) -> int | None:
    """The table's size now; None if this host does not say."""
    try:
        return int(table.path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def narrow() -> list[Table]:
    """The tables smaller than Corral wants."""
    return [t for t in TABLES if (size := current(t)) is not None and size < t.wanted]


def widen() -> list[Table]:
    """Raise every table smaller than wanted (once per process); returns those still narrow."""
    global _done
    with _lock:
        if _done:
            return narrow()
        _done = True
        left = []
        for table in narrow():
            try:
                table.path.write_text(f"{table.wanted}\n")
                log.info("raised %s to %d: %s", table.name, table.wanted, table.why)
            except OSError as exc:
                log.warning("cannot raise %s (%s): one sandbox can exhaust the host's %s", table.name, exc, table.why)
                left.append(table)
        return left
