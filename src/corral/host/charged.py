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
import json
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

from .. import errors
from . import cgroups

#: exit status of a child whose work raised (what it raised is in its report)
_RAISED = 1
#: the most a child's report of what it raised may take: less than a pipe holds, so the child's
#: one write never waits for the owner, who reads it only once the child is gone
_REPORT_MAX = 16 << 10


def run_charged(procs_files: Sequence[str], work: Callable[[], None]) -> None:
    """Run ``work`` in a child placed first in the groups whose ``cgroup.procs`` are ``procs_files``.

    What ``work`` raises is raised here: an ``OSError`` with its errno (``ENOSPC``: the sandbox's
    disk is full), one of Corral's errors (a restore's ``SnapshotCorrupt``) as its own class and
    message; anything else as ``OSError(EIO)`` naming it.  A child the kernel killed -- the
    sandbox's or the sandboxes' memory limit reached: the child asks to be the OOM killer's first
    choice -- raises ``OSError(ENOMEM)``, and the owner lives on."""
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child ends in os._exit: coverage never sees it)
            status = _RAISED
            try:
                # no finalizer of the owner's objects may run here (a socket's close, a pool's)
                gc.disable()
                os.close(report_r)
                with open("/proc/self/oom_score_adj", "w") as adj:
                    adj.write("1000")
                cgroups.join(procs_files, os.getpid())
                work()
                status = 0
            except BaseException as exc:  # every failure goes to the owner, typed
                try:
                    os.write(report_w, _report(exc))
                except BaseException:  # the owner then says EIO
                    pass
            finally:
                os._exit(status)
        os.close(report_w)
        report_w = -1
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
        if os.WEXITSTATUS(wait_status):
            os.set_blocking(report_r, False)  # the child is gone: what it wrote is all there
            try:
                raw = os.read(report_r, _REPORT_MAX)
            except BlockingIOError:
                raw = b""
            raise _raised(raw)
    finally:
        os.close(report_r)
        if report_w >= 0:
            os.close(report_w)


def run_here(work: Callable[[], None]) -> None:
    """Run ``work`` in this process: where there is no sandbox group to charge (no cgroups)."""
    work()


def run_in_memory_group(cgroup: cgroups.SandboxCgroup, work: Callable[[], None], leaf: Path | None = None) -> None:
    """:func:`run_charged` in ``cgroup``'s memory group alone (the charge is what matters, and each
    further v1 move cost ~2 ms): v1 its memory controller's group; v2, where processes live in
    leaves only, ``leaf`` or else a ``host-writes`` leaf made for the call and removed after it."""
    if cgroup.layout.version == 1:
        run_charged([str(cgroup.memory_group / "cgroup.procs")], work)
        return
    if leaf is not None:
        run_charged([str(leaf / "cgroup.procs")], work)
        return
    made = cgroup.leaf("host-writes")
    try:
        run_charged([str(made / "cgroup.procs")], work)
    finally:
        cgroup.remove_leaf(made)


def _report(exc: BaseException) -> bytes:
    """What the child tells the owner it raised: data, never an object (the owner builds the
    error anew from a class it knows)."""
    if isinstance(exc, errors.SandboxError):
        kind = {"error": type(exc).__name__, "message": str(exc)[:4096],
                "errno": getattr(exc, "errno", None)}
    elif isinstance(exc, OSError):
        kind = {"errno": exc.errno, "strerror": (exc.strerror or "")[:1024],
                "filename": str(exc.filename)[:2048] if exc.filename is not None else None}
    else:
        kind = {"errno": errno.EIO, "strerror": f"the write into the sandbox failed: {type(exc).__name__}: "
                                                f"{str(exc)[:1024]}", "filename": None}
    return json.dumps(kind).encode()[:_REPORT_MAX]


def _raised(raw: bytes) -> BaseException:
    """The error a child's report names (``OSError(EIO)`` if it cannot be read)."""
    try:
        report = json.loads(raw)
        name = report.get("error")
        if name is not None:
            cls = getattr(errors, str(name), None)
            if isinstance(cls, type) and issubclass(cls, errors.SandboxError):
                error = cls(str(report["message"]))
                if report.get("errno"):  # (FileError's, HostError's)
                    error.errno = int(report["errno"])  # type: ignore[attr-defined]
                return error
        elif report.get("errno"):
            return OSError(int(report["errno"]), str(report["strerror"]),
                           *(() if report.get("filename") is None else (str(report["filename"]),)))
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    return OSError(errno.EIO, "the write into the sandbox failed")
