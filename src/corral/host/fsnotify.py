"""What changed in a file system since the last look: a fanotify group (``fanotify(7)``) that
reports each directory-entry and data change as (the directory's file handle, the entry's name).

No well-kept Python binding exists; this is ctypes over libc's ``fanotify_init``,
``fanotify_mark`` and ``open_by_handle_at``.  Used by :mod:`.ws_overlay` to write back only
the directories a sandbox changed; the events are a hint of where to look, never trusted for
what is there (everything they name is looked at anew).

What it relies on, checked on Linux 6.18 (``tests/test_ws_notify.py``) and detected at run time
(:meth:`ChangeWatch.open` returns None where it cannot work: a kernel before 5.9, a file system
without file handles, no ``CAP_SYS_ADMIN``):

- one ``FAN_MARK_FILESYSTEM`` mark with ``FAN_REPORT_DFID_NAME`` reports, for every entry of
  the file system, create/delete/move (both ends of a rename and of a ``RENAME_EXCHANGE``), data
  writes and truncation, attribute changes (mode, owner, times, extended attributes, link
  count), and the close of a file opened for writing, each as (parent directory, name) -- also
  when overlayfs makes the change in its upper layer on behalf of a process in the overlay;
- an event on a directory itself comes with the name ``.``;
- the queue is bounded (16384 events by default; never ``FAN_UNLIMITED_QUEUE``: the sandbox
  controls the rate): when it overflows the kernel queues ``FAN_Q_OVERFLOW`` and the caller
  must look at everything;
- a write through a shared writable ``mmap`` makes no event (only the ``close`` of the file
  it was opened by does, if that comes after).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from .mounts import libc

FAN_MODIFY = 0x2
FAN_ATTRIB = 0x4
FAN_CLOSE_WRITE = 0x8
FAN_MOVED_FROM = 0x40
FAN_MOVED_TO = 0x80
FAN_CREATE = 0x100
FAN_DELETE = 0x200
FAN_Q_OVERFLOW = 0x4000
FAN_ONDIR = 0x40000000

FAN_CLOEXEC = 0x1
FAN_NONBLOCK = 0x2
FAN_CLASS_NOTIF = 0x0
FAN_REPORT_DIR_FID = 0x400
FAN_REPORT_NAME = 0x800
FAN_REPORT_DFID_NAME = FAN_REPORT_DIR_FID | FAN_REPORT_NAME

FAN_MARK_ADD = 0x1
FAN_MARK_FILESYSTEM = 0x100

FAN_EVENT_INFO_TYPE_DFID_NAME = 2
FANOTIFY_METADATA_VERSION = 3

#: every change to an entry that a write-back must see
WATCHED = (FAN_CREATE | FAN_DELETE | FAN_MOVED_FROM | FAN_MOVED_TO | FAN_MODIFY | FAN_ATTRIB
           | FAN_CLOSE_WRITE | FAN_ONDIR)

# struct fanotify_event_metadata: event_len u32, vers u8, reserved u8, metadata_len u16,
# mask u64, fd s32, pid s32
_METADATA = struct.Struct("=IBBHQii")
# struct fanotify_event_info_header (type u8, pad u8, len u16) + __kernel_fsid_t (2 x s32)
_INFO = struct.Struct("=BBH8x")
# struct file_handle: handle_bytes u32, handle_type s32, f_handle[handle_bytes]
_HANDLE = struct.Struct("=Ii")

_libc = libc()  # by soname: find_library ran ldconfig at every import (~10 ms of each `corral run`)
_init = getattr(_libc, "fanotify_init", None)
_mark = getattr(_libc, "fanotify_mark", None)
_open_by_handle = getattr(_libc, "open_by_handle_at", None)
if _init is not None and _mark is not None and _open_by_handle is not None:
    _init.argtypes, _init.restype = [ctypes.c_uint, ctypes.c_uint], ctypes.c_int
    _mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
    _mark.restype = ctypes.c_int
    _open_by_handle.argtypes, _open_by_handle.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int], ctypes.c_int


def _raise(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


@dataclass(frozen=True)
class Change:
    """One event: the directory (its file handle, as ``struct file_handle`` bytes) and the name
    of the entry in it (``.``: the directory itself); ``mask`` says what happened."""

    handle: bytes
    name: str
    mask: int


class Overflow(Exception):
    """The queue overflowed (or held more than a drain reads): events were lost, look at everything."""


class ChangeWatch:
    """A fanotify group marking the whole file system of a path; its one owner closes it."""

    def __init__(self, fd: int, on_close: Callable[[], None] | None = None) -> None:
        self.fd = fd
        self._on_close = on_close

    @classmethod
    def open(cls, path: str | os.PathLike[str], on_close: Callable[[], None] | None = None) -> ChangeWatch | None:
        """A watch of the file system holding ``path``, or None where this host cannot have one
        (no fanotify or no file-handle reporting in the kernel, a file system that cannot encode
        file handles, no privilege, no group left).  ``on_close`` is called once it is closed."""
        if _init is None or _mark is None or _open_by_handle is None:
            return None
        fd = _init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK | FAN_REPORT_DFID_NAME, os.O_RDONLY | os.O_CLOEXEC)
        if fd < 0:
            return None  # EINVAL: a kernel before 5.9; EPERM: no CAP_SYS_ADMIN; ENOSYS
        if _mark(fd, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, WATCHED, -1, os.fsencode(path)) < 0:
            # EXDEV, EOPNOTSUPP, ENODEV: a file system without (usable) file handles
            os.close(fd)
            return None
        return cls(fd, on_close)

    def drain(self, limit: int) -> list[Change]:
        """Every event queued since the last drain, without waiting.  :class:`Overflow` if the
        kernel dropped events, or if more than ``limit`` were read (a sandbox writing faster
        than this reads must not keep its owner here)."""
        changes: list[Change] = []
        overflow = False
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            offset = 0
            while offset + _METADATA.size <= len(data):
                event_len, vers, _, metadata_len, mask, fd, _ = _METADATA.unpack_from(data, offset)
                if vers != FANOTIFY_METADATA_VERSION or event_len < _METADATA.size:
                    raise OSError(errno.EPROTO, f"fanotify event of version {vers}, length {event_len}")
                if fd >= 0:
                    os.close(fd)  # a group reporting file handles never opens one; be sure anyway
                if mask & FAN_Q_OVERFLOW:
                    overflow = True
                else:
                    changes.append(_parse(data, offset + metadata_len, offset + event_len, mask))
                offset += event_len
            if len(changes) > limit:
                overflow = True
            if overflow:
                break
        if overflow:
            self.discard()
            raise Overflow()
        return changes

    def discard(self) -> None:
        """Empty the queue: what it held (a bounded number of reads, however fast it fills)."""
        for _ in range(64):
            try:
                os.read(self.fd, 1 << 20)
            except BlockingIOError:
                return

    def open_dir(self, mount_fd: int, handle: bytes) -> int:
        """The directory a :class:`Change` names, opened ``O_PATH`` through the mount of ``mount_fd``
        (a descriptor on the same file system); OSError if it is gone (``ESTALE``)."""
        assert _open_by_handle is not None  # (a watch exists)
        fd = int(_open_by_handle(mount_fd, handle, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        if fd < 0:
            _raise("open_by_handle_at")
        return fd

    def close(self) -> None:
        """Close the group (its mark goes with it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            if self._on_close is not None:
                self._on_close()


def _parse(data: bytes, start: int, end: int, mask: int) -> Change:
    """The (directory handle, name) record of one event; :class:`Overflow` if it has none (an
    event this module did not ask for: look at everything rather than guess)."""
    offset = start
    while offset + _INFO.size <= end:
        info_type, _, length = _INFO.unpack_from(data, offset)
        if length == 0:
            break
        if info_type == FAN_EVENT_INFO_TYPE_DFID_NAME:
            handle_at = offset + _INFO.size
            handle_bytes, _ = _HANDLE.unpack_from(data, handle_at)
            name_at = handle_at + _HANDLE.size + handle_bytes
            handle = bytes(data[handle_at:name_at])
            name = os.fsdecode(data[name_at:offset + length].split(b"\0", 1)[0])
            return Change(handle, name, mask)
        offset += length
    raise Overflow()
