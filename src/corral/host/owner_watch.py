"""A frozen sandbox ends with its owner: the watch kept over it while it is frozen.

A running sandbox dies with the process that owns it (its agent reads end of file on its pipe;
bubblewrap has a parent-death signal).  A frozen one (``pause()``, and the freeze of a
``snapshot()``) cannot notice: its processes, their memory, its mounts and uid range stayed until
the next ``corral gc``.  :class:`OwnerWatch` is a process of the owner's, outside the sandbox's
cgroups, started before the sandbox's first freeze and ended when the owner closes the sandbox; if
the owner dies first it kills every process of the sandbox's groups and thaws them (``agent
--owner-watch``, ``agent/owner_watch.c``).  Frozen or not then: a running sandbox dies with its
owner anyway.  Kept from the first pause on, so that a pause and resume cost no process start
(issue 18's target: 5 ms for both); and that start is a posix_spawn of the static agent, not a
fork of Python (~0.5 ms of the first pause).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from .cgroups import SandboxCgroup


class OwnerWatch:
    """The watch over one sandbox's ``cgroup``, run from ``agent`` (the agent binary).  :meth:`stop`
    ends it (its owner closes the sandbox: it kills the sandbox itself)."""

    def __init__(self, agent: Path, cgroup: SandboxCgroup) -> None:
        groups = [cgroup.kill_group, *(group for group in cgroup.limit_groups if group != cgroup.kill_group)]
        argv = [str(agent), "--owner-watch", cgroup.layout.kill_mode, *map(str, groups)]
        # its own session and /dev/null for stdio are the watch's to take, after its exec: posix_spawn
        # returns at the exec, and each of its own actions added ~0.1 ms to the pause here
        self._pid = os.posix_spawn(agent, argv, {})
        try:
            # signalled through a pidfd: an owner that ignores SIGCHLD has its children reaped
            # for it, and a bare pid might then be another process's
            self._pidfd: int | None = os.pidfd_open(self._pid)
        except OSError:  # gone already (it failed to start): stop() only reaps it
            self._pidfd = None

    def stop(self) -> None:
        """End the watch (its kill is not wanted any more) and reap it.  Idempotent."""
        pidfd, self._pidfd = self._pidfd, None
        pid, self._pid = self._pid, 0
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it ended by itself: it failed to start (it kills only once this process is gone)
            finally:
                os.close(pidfd)
        if pid:
            with contextlib.suppress(ChildProcessError):  # reaped for us (SIGCHLD ignored)
                os.waitpid(pid, 0)
