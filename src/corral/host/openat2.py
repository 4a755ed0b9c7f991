"""``openat2(2)``, which Python's os module lacks: an open whose path resolution follows rules
(``RESOLVE_*``) the kernel enforces at every step, where a check before an ``openat`` could be
raced.  The wasm worker has a copy of its own: it imports nothing of Corral."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from pathlib import Path

from .mounts import libc

SYS_OPENAT2 = 437  # the same number on every architecture (the unified syscall table)
#: no step may cross a mount point
RESOLVE_NO_XDEV = 0x01
#: no ``/proc/PID/fd``-style link is followed
RESOLVE_NO_MAGICLINKS = 0x02
#: no link of any kind is followed, at any step (ELOOP)
RESOLVE_NO_SYMLINKS = 0x04
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


class UnsafeFile(OSError):
    """A file host code was to read inside a tree a sandbox or an image build controls is a link
    (or lies behind one), not a regular file (a fifo, a device), or bigger than the reader takes."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(errno.EPERM, why, path)


def read_in_tree(root: Path, path: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (relative) inside the directory ``root``, read as host
    code may read what a sandbox or an image build wrote: ``root`` is ``/`` for the lookup, no link
    is followed at any step nor a mount crossed, the open never blocks (a fifo) and only a regular
    file of at most ``limit`` bytes is read.  A path read by name as host root followed an image's
    ``/etc/shadow -> ../../../etc/shadow`` to the host's own, and a fifo there hung the reader.

    FileNotFoundError if nothing is there (or a parent is not a directory); :class:`UnsafeFile`
    for a link, anything but a regular file, or more than ``limit`` bytes."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = _open_no_links(root_fd, path)
    finally:
        os.close(root_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(path, "not a regular file")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise UnsafeFile(path, f"bigger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


#: this kernel (or the owner's seccomp filter) has no ``openat2``: :func:`_open_no_links` walks
_walk_without_openat2 = False


def _open_no_links(root_fd: int, path: str) -> int:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    global _walk_without_openat2
    try:
        if not _walk_without_openat2:
            try:
                return openat2(root_fd, path, flags, RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)
            except OSError as exc:
                if exc.errno != errno.ENOSYS:
                    raise
            _walk_without_openat2 = True
        # one component at a time, none of them a link: what openat2 above does in one call
        parts = [part for part in path.split("/") if part not in ("", ".")]
        if ".." in parts:
            raise UnsafeFile(path, "leaves its tree")
        current = root_fd
        try:
            for part in parts[:-1]:
                step = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
                if current != root_fd:
                    os.close(current)
                current = step
                kind = stat.S_IFMT(os.fstat(step).st_mode)
                if kind != stat.S_IFDIR:
                    raise OSError(errno.ELOOP if kind == stat.S_IFLNK else errno.ENOTDIR, "", path)
            return os.open(parts[-1], flags, dir_fd=current)
        finally:
            if current != root_fd:
                os.close(current)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(errno.ENOENT, "no such file", path) from None
        if exc.errno in (errno.ELOOP, errno.EXDEV):
            raise UnsafeFile(path, "a link (or reached through one)" if exc.errno == errno.ELOOP else "on another mount") from None
        raise


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_dir_in_tree(root_fd: int, path: str, *, links_in_root: bool, create: bool) -> int:
    """A descriptor of the directory ``path`` (relative) inside the tree ``root_fd``, opened as host
    code may write into a tree a sandbox or an image build controls: nothing outside the tree is
    ever reached.  With ``links_in_root`` a link on the way resolves inside the tree, ``root_fd``
    being its ``/`` (``openat2(RESOLVE_IN_ROOT)``: what the tree's own commands see); without it (or
    on a kernel without ``openat2``) no link is followed at all.  With ``create`` a missing directory
    is made (0755, the caller's).  By path, an image's ``/usr/local/lib -> /etc`` led a build's
    copy into the host's ``/etc``.

    :class:`UnsafeFile` for a link that is not followed, one that leads nowhere in the tree, or
    something that is not a directory; FileNotFoundError for a missing one without ``create``."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UnsafeFile(path, "leaves its tree")
    fd = os.open(".", _DIR_FLAGS, dir_fd=root_fd)
    try:
        for depth, part in enumerate(parts):
            prefix = "/".join(parts[:depth + 1])
            try:
                step = _open_dir_step(root_fd, fd, prefix, part, links_in_root)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:  # a link to nothing in the tree
                    raise UnsafeFile(prefix, "a link to nothing in the tree") from None
                step = _open_dir_step(root_fd, fd, prefix, part, links_in_root)
            os.close(fd)
            fd = step
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_dir_step(root_fd: int, parent_fd: int, prefix: str, part: str, links_in_root: bool) -> int:
    global _walk_without_openat2
    try:
        if links_in_root and not _walk_without_openat2:
            try:  # the whole prefix from the root: a link resolves against the tree's root, not its directory
                return openat2(root_fd, prefix, _DIR_FLAGS,
                               RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)
            except OSError as exc:
                if exc.errno != errno.ENOSYS:
                    raise
            _walk_without_openat2 = True
        return os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, "no such directory", prefix) from None
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
            why = {errno.ELOOP: "a link", errno.ENOTDIR: "not a directory (or a link)",
                   errno.EXDEV: "on another mount"}[exc.errno]
            raise UnsafeFile(prefix, why) from None
        raise
