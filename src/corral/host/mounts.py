"""Mount primitives: size-limited tmpfs, overlayfs, and unmounting what is left.

Direct mount(2)/umount2(2) through ctypes: spawning mount(8) would cost ~2 ms
per call on the create path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path

from ..spec import Limits

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MNT_DETACH = 0x2
MS_REMOUNT = 0x20
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


def tmpfs_inodes(size: int) -> int:
    """The most entries a sandbox's tmpfs of ``size`` bytes holds: millions of empty files would
    otherwise cost host memory, not disk (and a snapshot of them, host inodes)."""
    return max(16384, size // 4096)


def tmpfs_args(size: int, uid: int, gid: int, mode: int = 0o700) -> tuple[str, int, str]:
    """(fstype, flags, options) of a sandbox's size-limited tmpfs owned by ``uid``:``gid``."""
    inodes = tmpfs_inodes(size)
    return "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes={inodes},mode={mode:o},uid={uid},gid={gid}"


def disk_held_in_memory(limits: Limits) -> int:
    """The size of a disk tmpfs whose pages are charged to the sandbox's own memory cgroup,
    such that files alone can never fill that memory.

    tmpfs pages cannot be reclaimed (no swap): a sandbox that wrote ``memory`` bytes of files
    would leave no room for any process, and the kernel's OOM killer would then kill its agent
    (pid 1) and every later command -- the whole sandbox gone, what it had not written back lost.
    So the disk holds at most what leaves a reserve for the agent and a small command (16 MiB
    and a sixteenth of ``memory``), less a fifth for the kernel's own memory of a full inode
    table (tmpfs inodes and dentries, ~1 KiB per file of at least 4 KiB: ``tmpfs_args``).  Past
    it a write fails with ``ENOSPC``, and the sandbox goes on.

    Every tier holds its disk so: the process and gVisor tiers in the sandbox's own group; a
    microVM's in QEMU's (its 9p server writes the pages: a full 1 GiB workspace OOM-killed QEMU,
    whose group holds guest RAM and 384 MiB besides, and the whole VM was lost), which this size
    is added to; wasm's in its worker's (a full disk left later commands 6 MiB)."""
    mib = 1 << 20
    reserve = min(limits.memory // 2, 16 * mib + limits.memory // 16)
    return max(mib, min(limits.disk, (limits.memory - reserve) * 4 // 5))


def mount_tmpfs(target: Path, size: int, uid: int, gid: int, mode: int = 0o700) -> None:
    fstype, flags, options = tmpfs_args(size, uid, gid, mode)
    mount("corral", target, fstype, flags, options)


def devpts_args(max_ptys: int) -> tuple[str, int, str]:
    """A ``devpts`` of its own (as bubblewrap's ``--dev`` makes one) holding at most ``max_ptys``
    terminals: the host's table of them is shared (``host/shared_tables.py``)."""
    return "devpts", MS_NOSUID | MS_NOEXEC, f"newinstance,ptmxmode=0666,mode=620,max={max_ptys}"


def device_nodes_args() -> tuple[str, int, str]:
    """A tiny tmpfs for a sandbox's own device nodes: without ``nodev``, as only host root in the
    host's user namespace can mount one (a tmpfs the sandbox mounted would refuse its devices)."""
    return "tmpfs", MS_NOSUID | MS_NOEXEC, "size=4k,nr_inodes=24,mode=755"


def overlay_args(lower: list[Path], upper: Path, work: Path) -> tuple[str, int, str]:
    """(fstype, flags, options) of an overlay of ``lower`` (top first) under ``upper``."""
    for p in (*lower, upper, work):
        if any(c in str(p) for c in ",:\\"):
            raise ValueError(f"overlay path {p} contains a character overlayfs cannot take")
    return "overlay", MS_NOSUID | MS_NODEV, f"lowerdir={':'.join(map(str, lower))},upperdir={upper},workdir={work}"


def read_only_overlay_args(lower: list[Path]) -> tuple[str, int, str]:
    """(fstype, flags, options) of a read-only overlay of ``lower`` (top first; overlayfs takes
    two or more layers when there is no upper one)."""
    if len(lower) < 2:
        raise ValueError("a read-only overlay needs two or more lower layers")
    for p in lower:
        if any(c in str(p) for c in ",:\\"):
            raise ValueError(f"overlay path {p} contains a character overlayfs cannot take")
    return "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV, f"lowerdir={':'.join(map(str, lower))}"


def mount_overlay(target: Path, lower: list[Path], upper: Path, work: Path) -> None:
    fstype, flags, options = overlay_args(lower, upper, work)
    mount("overlay", target, fstype, flags, options)


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


def origin_of(path: Path) -> Path | None:
    """Where the directory ``path`` (resolved) is in the tree of this namespace when a mount shows
    it elsewhere (``/etc/ssl`` bound at ``/srv/x``: ``/etc/ssl``; ``/`` bound at ``/srv/r``:
    ``/srv/r/etc`` is ``/etc``); None when it is where it is, or its file system is mounted whole
    nowhere (nothing to compare with)."""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mounts.append((fields[2], _unescape(fields[3]), _unescape(fields[4])))
    text = str(path)
    best: tuple[str, str, str] | None = None
    for device, root, point in mounts:  # the last of equal mount points is the one on top
        if (text == point or text.startswith(point.rstrip("/") + "/")) and (best is None or len(point) >= len(best[2])):
            best = (device, root, point)
    if best is None:
        return None
    device, root, point = best
    # where the file system is mounted whole (its first such mount: the original, not a later bind of it)
    whole = next((p for d, r, p in mounts if d == device and r == "/"), None)
    if whole is None:
        return None
    origin = Path(whole) / Path(root).relative_to("/") / Path(text).relative_to(point)
    return None if origin == path else origin


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mountinfo_everywhere() -> Iterator[str]:
    """Every line of ``/proc/PID/mountinfo`` of every mount namespace on the host (this process's
    first; one process read per namespace): sandboxes mount in namespaces of their own
    (:mod:`corral.host.mountns`), where the host's table does not show them."""
    seen: set[str] = set()
    for pid in ("self", *(p for p in os.listdir("/proc") if p.isdigit())):
        try:
            ns = os.readlink(f"/proc/{pid}/ns/mnt")
            if ns in seen:
                continue
            seen.add(ns)
            with open(f"/proc/{pid}/mountinfo") as f:
                lines = f.readlines()
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        yield from lines


def mounted_anywhere(prefix: Path) -> list[str]:
    """Mount points at or below ``prefix`` in any mount namespace of the host (as each one's
    process sees it), for leak checks."""
    base = str(prefix).rstrip("/")
    found = []
    for line in mountinfo_everywhere():
        point = line.split()[4].replace("\\040", " ")
        if point == base or point.startswith(base + "/"):
            found.append(point)
    return found


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
