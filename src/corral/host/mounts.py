"""Mount primitives: size-limited tmpfs, overlayfs, and unmounting what is left.

Direct mount(2)/umount2(2) through ctypes: spawning mount(8) would cost ~2 ms
per call on the create path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2
MS_BIND = 0x1000


@lru_cache(maxsize=1)
def libc() -> ctypes.CDLL:
    """The C library, for the syscalls Python's os module lacks (mount, umount2, setns, unshare)."""
    # by its soname first: find_library runs ldconfig (milliseconds every `corral run` would pay)
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def check(result: int, what: str) -> None:
    """Raise OSError (with errno) for a failed libc call."""
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: Path, fstype: str | None, flags: int = 0, options: str = "") -> None:
    check(
        libc().mount(source.encode(), str(target).encode(), None if fstype is None else fstype.encode(), flags,
                     options.encode()),
        f"mount {fstype or source} on {target}",
    )


def mount_tmpfs(target: Path, size: int, uid: int, gid: int, mode: int = 0o700) -> None:
    # an inode cap too: millions of empty files would otherwise cost host memory, not disk
    inodes = max(16384, size // 4096)
    mount("corral", target, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={size},nr_inodes={inodes},mode={mode:o},uid={uid},gid={gid}")


def mount_overlay(target: Path, lower: list[Path], upper: Path, work: Path) -> None:
    for p in (*lower, upper, work):
        if any(c in str(p) for c in ",:\\"):
            raise ValueError(f"overlay path {p} contains a character overlayfs cannot take")
    options = f"lowerdir={':'.join(map(str, lower))},upperdir={upper},workdir={work}"
    mount("overlay", target, "overlay", MS_NOSUID | MS_NODEV, options)


def umount(target: Path, lazy: bool = False) -> None:
    check(libc().umount2(str(target).encode(), MNT_DETACH if lazy else 0), f"umount {target}")


def mountinfo() -> list[tuple[str, str]]:
    """(mount point, everything after " - ": fstype, source, super options) per mount."""
    entries = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            entries.append((left.split()[4].replace("\\040", " "), right.strip()))
    return entries


def superblock_options(point: Path) -> str:
    """The filesystem-level options of the mount at ``point`` ('' if nothing is mounted there)."""
    found = ""
    for mounted, rest in mountinfo():
        if mounted == str(point):
            found = rest.split()[-1] if rest else ""  # the last mount over a point is the visible one
    return found


def mounts_under(prefix: Path) -> list[Path]:
    """Mount points at or below ``prefix``, deepest first."""
    base = str(prefix).rstrip("/")
    found = [Path(point) for point, _ in mountinfo() if point == base or point.startswith(base + "/")]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _unmount_known(points: Sequence[Path]) -> bool:
    clean = True
    for point in reversed(points):
        try:
            umount(point)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT):
                continue  # not (or no longer) a mount point
            try:
                umount(point, lazy=True)
            except OSError:
                clean = False
    return clean


def unmount_all(prefix: Path, known: Sequence[Path] | None = None) -> None:
    """Unmount everything at or below ``prefix``; falls back to a lazy detach if busy.

    ``known``: the mounts the caller made there, in the order it made them.  The owner
    of a sandbox knows its mounts, so teardown unmounts those (last made first) and
    need not read /proc/self/mountinfo, whose size (and parse time) grows with every
    live sandbox on the host; only if one would not go is the table searched.
    """
    if known is not None and _unmount_known(known):
        return
    for _ in range(3):
        points = mounts_under(prefix)
        if not points:
            return
        for point in points:
            try:
                umount(point)
            except OSError:
                try:
                    umount(point, lazy=True)
                except OSError:
                    pass
