"""``openat2(2)``, which Python's os module lacks: an open whose path resolution follows rules
(``RESOLVE_*``) the kernel enforces at every step, where a check before an ``openat`` could be
raced.  The wasm worker has a copy of its own: it imports nothing of Corral."""

from __future__ import annotations

import ctypes
import os

from .mounts import libc

SYS_OPENAT2 = 437  # the same number on every architecture (the unified syscall table)
#: no step may cross a mount point
RESOLVE_NO_XDEV = 0x01
#: no ``/proc/PID/fd``-style link is followed
RESOLVE_NO_MAGICLINKS = 0x02
#: the directory given acts as ``/`` for every step (``..`` and absolute links stay in it)
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str | bytes, flags: int, resolve: int, mode: int = 0) -> int:
    """``path`` opened below the directory ``dir_fd`` with ``flags`` under the ``resolve`` rules;
    OSError with the kernel's errno (ENOSYS: a kernel before 5.6, or a seccomp filter without it)."""
    how = _OpenHow(flags, mode, resolve)
    fd = libc().syscall(SYS_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(path))
    return int(fd)
