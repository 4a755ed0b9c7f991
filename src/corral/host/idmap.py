"""Idmapped mounts: a read-only view of an image layer whose files belong to the sandbox's ids.

An image on the host is owned by host root (and a few system users); inside a
sandbox whose user namespace maps its own host range to 0-65535, host root is
unmapped and every file would show as ``nobody``, unwritable even by root
inside.  An idmapped mount (``mount_setattr(MOUNT_ATTR_IDMAP)``, Linux 5.12+;
ext4, xfs, btrfs, tmpfs 6.3+) shows on-disk id N as the host id that N maps
to in the sandbox's user namespace (``base + N``), without touching the files:
the overlay built on such layers shows ``root:root`` for the image's root
files, and copies a file up to the sandbox's own upper layer with the same
(sandbox) owner.

The syscalls have no wrapper in Python's os module: ctypes, by number (x86_64
and aarch64 share them since Linux 5.2's unified table).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from .mounts import check, libc

SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442

OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
AT_EMPTY_PATH = 0x1000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOATIME = 0x10
MOUNT_ATTR__ATIME = 0x70
MOUNT_ATTR_IDMAP = 0x100000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _syscall(number: int, *args: object) -> int:
    fn = libc().syscall
    fn.restype = ctypes.c_long
    return int(fn(ctypes.c_long(number), *args))


def idmapped_tree(source: Path, userns_fd: int, *, read_only: bool = True, noatime: bool = False) -> int:
    """A detached, read-only (unless ``read_only=False``), nosuid, nodev mount of ``source`` (a
    directory or a single file) whose ids are those of the user namespace ``userns_fd`` (on-disk
    id N shows as what N maps to): its descriptor (O_CLOEXEC), usable as a path through
    ``/proc/self/fd/N`` (an overlay's lower layer, QEMU's guest RAM file) until closed.
    With ``noatime``, reads through it do not update access times either."""
    tree = _syscall(SYS_OPEN_TREE, ctypes.c_int(-100), str(source).encode(),
                    ctypes.c_uint(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC))
    if tree < 0:
        check(-1, f"open_tree {source}")
    try:
        flags = MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (MOUNT_ATTR_RDONLY if read_only else 0)
        attr = _MountAttr(flags | (MOUNT_ATTR_NOATIME if noatime else 0), MOUNT_ATTR__ATIME if noatime else 0, 0,
                          userns_fd)
        check(_syscall(SYS_MOUNT_SETATTR, ctypes.c_int(tree), b"", ctypes.c_uint(AT_EMPTY_PATH),
                       ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
              f"idmap {source}")
    except BaseException:
        os.close(tree)
        raise
    return tree


def attach(tree: int, target: Path) -> None:
    """Mount the detached tree ``tree`` (from :func:`idmapped_tree`) on the directory ``target``."""
    check(_syscall(SYS_MOVE_MOUNT, ctypes.c_int(tree), b"", ctypes.c_int(-100), str(target).encode(),
                   ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)), f"move_mount to {target}")
