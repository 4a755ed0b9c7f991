"""Host-side writes into a sandbox's memory-backed disk, charged to the sandbox's memory cgroup.

A tmpfs page is charged to the memory cgroup of the process that allocates it (the owner of the
writer's ``mm``, not the thread: on v1 and v2 alike, moving one thread does not move its charges)
and stays charged there until the file goes: it cannot be reclaimed.  Where the host itself
writes a sandbox's files (the wasm tier's files API and workspace copy-in), the owner's own
group paid for them -- no limit of the sandbox's, nor the parent's that bounds all sandboxes
together, saw them (300 MiB through ``files.write`` grew the owner's group by 322 MiB, the
sandbox's by 3 MiB).  So such a write is done by a short-lived child forked for it, which joins
the sandbox's groups before it writes anything.  Forking (not ``exec``ing a helper) because the
data and the code are already here: a fresh interpreter importing the copy code took ~0.3 s.
"""

from __future__ import annotations

import errno
import gc
import os
import signal
from collections.abc import Callable, Sequence

from . import cgroups

#: exit status of a child whose work raised something other than an OSError
_OTHER_FAILURE = 255


def run_charged(procs_files: Sequence[str], work: Callable[[], None]) -> None:
    """Run ``work`` in a child placed first in the groups whose ``cgroup.procs`` are ``procs_files``.

    An ``OSError`` of ``work`` is raised here with its errno (``ENOSPC``: the sandbox's disk is
    full).  A child the kernel killed -- the sandbox's or the sandboxes' memory limit reached:
    the child asks to be the OOM killer's first choice -- raises ``OSError(ENOMEM)``, and the
    owner lives on."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child ends in os._exit: coverage never sees it)
        status = _OTHER_FAILURE
        try:
            # no finalizer of the owner's objects may run here (a socket's close, a pool's)
            gc.disable()
            with open("/proc/self/oom_score_adj", "w") as adj:
                adj.write("1000")
            cgroups.join(procs_files, os.getpid())
            work()
            status = 0
        except OSError as exc:
            status = exc.errno if exc.errno and 0 < exc.errno < _OTHER_FAILURE else errno.EIO
        except BaseException:
            status = _OTHER_FAILURE
        finally:
            os._exit(status)
    try:
        _, wait_status = os.waitpid(pid, 0)
    except BaseException:
        # interrupted: the child must not outlive the call that asked for it
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    if os.WIFSIGNALED(wait_status):
        raise OSError(errno.ENOMEM, f"the sandbox's memory is full (the writer was killed by signal "
                                    f"{os.WTERMSIG(wait_status)})")
    code = os.WEXITSTATUS(wait_status)
    if code == _OTHER_FAILURE:
        raise OSError(errno.EIO, "the write into the sandbox failed")
    if code:
        raise OSError(code, os.strerror(code))
