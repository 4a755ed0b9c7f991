"""Walk a workspace and copy what changed between the host's tree and the sandbox's, without
ever following a path the sandbox controls (the copy mode is :mod:`.ws_copy`, the overlay
:mod:`.ws_overlay`).

The sandbox works on its own copy, on its size-limited disk, owned by its
unprivileged host uid: its writes are bounded by the disk limit, and the host
directory is written only here.  Both sides are walked one component at a
time with ``O_NOFOLLOW`` directory descriptors, so a symlink the sandbox
plants (even while a sync runs) can neither make us read a host file into the
workspace nor write outside it.

What a sync writes to the host is bounded by what the sandbox's disk holds: only a file's
data extents are copied (a hole, which costs the sandbox nothing, stays a hole), and the
names of one file (hard links) become names of one host file, not one copy each.  Without
that a sandbox with a 64 MiB disk wrote 4 GiB into the host directory with ``truncate -s
2G f; ln f g`` (``test_workspace_write_back_is_bounded_by_the_sandboxs_disk``).

No walk or copy crosses a mount point below the tree's root (:func:`open_beneath`): what is
mounted inside a host directory (a chroot's bound ``/etc``, a volume, an NFS export) is not the
directory's, and write-back, which runs as host root, wrote the sandbox's files into it (a
root-owned ``cron.d/evil``, a replaced ``shadow``), while a copy-in showed the sandbox its files.
A mount point is copied in as an empty directory (what the overlay's non-recursive view shows),
and write-back leaves it and everything below it as the host has it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Callable, Container, Iterable, Iterator
from pathlib import Path

from .openat2 import RESOLVE_NO_XDEV, openat2
from .ws_git import HeldPaths, host_keeps, makes_a_git_directory

log = logging.getLogger(__name__)

# (kind, size, ctime_ns, mode, inode): the change time, which no one can set back
Entry = tuple[str, int, int, int, int]
#: an entry by (its directory's path below the root, "" at the top; its name): the directory's
#: path is one string shared by all its entries, so a manifest costs a name per entry, not a
#: path (a sandbox's 200,000 files 120 levels down made the owner hold 1.7 GB of paths)
Key = tuple[str, str]
Manifest = dict[Key, Entry]
#: within one sync, a source file with more than one name, by (st_dev, st_ino): the path of the
#: destination file its first name was copied to, and that file's inode
Links = dict[tuple[int, int], tuple[str, int]]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "f"
    if stat.S_ISDIR(mode):
        return "d"
    if stat.S_ISLNK(mode):
        return "l"
    return "o"


#: what a walk or a copy meets where the sandbox changed a path meanwhile (gone; a directory made
#: a file or a link): the entry is skipped, and the next sync sees what it is now
CHANGED_MEANWHILE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)

#: entries deeper than this many directories, or whose path below the workspace is longer
#: than ``MAX_PATH`` bytes, are not written back (nor copied in): a walk holds one descriptor
#: per level, and a sandbox's chain of thousands of directories (free on its tmpfs) made the
#: write-back raise ``RecursionError`` at every command and could make the host hold
#: gigabytes of path names
MAX_DEPTH = 128
MAX_PATH = 4096


def scan(root: Path | int, upper: bool = False, prefix: str = "") -> Manifest:
    """Every entry below ``root`` (not following symlinks), down to ``MAX_DEPTH`` levels and
    ``MAX_PATH`` bytes of path.

    ``upper``: ``root`` is an overlay's upper layer, whose kinds add ``w`` (a whiteout, recorded
    without size, time or inode: overlayfs makes every whiteout a name of one shared inode, whose
    change time moves whenever another is made) and ``D`` (an opaque directory); a directory
    that cannot be opened there is left out (it went away while the walk ran).

    ``root`` may be an open directory (not closed here) that is ``prefix`` below the tree's
    root: the keys and the limits are then the tree's."""
    manifest: Manifest = {}
    root_fd = os.dup(root) if isinstance(root, int) else os.open(root, _DIR_FLAGS)
    above = prefix.count("/") + 1 if prefix else 0  # the levels above root_fd
    # depth first, one open directory per level: (descriptor, its path, that path's length in bytes, what is left of it)
    stack: list[tuple[int, str, int, Iterator[os.DirEntry[str]]]] = [
        (root_fd, prefix, len(os.fsencode(prefix)), _entries(root_fd))]
    try:
        while stack:
            dir_fd, prefix, prefix_bytes, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                stack.pop()
                os.close(dir_fd)
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            key = (prefix, entry.name)
            if prefix_bytes + len(os.fsencode(entry.name)) >= MAX_PATH:
                continue
            manifest[key] = entry_of(st, upper)
            if manifest[key][0] != "d" or above + len(stack) >= MAX_DEPTH:
                continue
            try:
                fd = open_beneath(dir_fd, entry.name, _DIR_FLAGS)
            except OSError:  # (a mount point too: listed, its entries not)
                if upper:
                    del manifest[key]
                continue
            if upper and opaque(fd):
                manifest[key] = ("D", *manifest[key][1:])
            rel = rel_of(key)
            stack.append((fd, rel, len(os.fsencode(rel)), _entries(fd)))
    finally:
        for dir_fd, _, _, _ in stack:
            os.close(dir_fd)
    return manifest


#: a whiteout's entry (:func:`scan`)
WHITEOUT: Entry = ("w", 0, 0, 0, 0)


def entry_of(st: os.stat_result, upper: bool) -> Entry:
    """A manifest's entry for ``st`` (an opaque directory is found by its caller)."""
    if upper and is_whiteout(st):
        return WHITEOUT
    return (_kind(st.st_mode), st.st_size, st.st_ctime_ns, st.st_mode & 0o7777, st.st_ino)


def rel_of(key: Key) -> str:
    """An entry's path below the root."""
    return f"{key[0]}/{key[1]}" if key[0] else key[1]


def depth_order(keys: Iterable[Key], deepest_first: bool = False) -> list[Key]:
    """``keys`` parents first (or deepest first), each directory's entries together."""
    depths: dict[str, int] = {}

    def depth(key: Key) -> int:
        if key[0] not in depths:
            depths[key[0]] = key[0].count("/") + 1 if key[0] else 0
        return depths[key[0]]

    return sorted(keys, key=lambda k: (depth(k), k[0]), reverse=deepest_first)


class DirsBeneath:
    """Open directories below a root descriptor, by path, without following symlinks; the last
    one opened is kept for the next entry of the same directory (a sync visits a directory's
    entries together: without it, each of 200,000 files 120 levels down cost 120 opens).

    ``shown_to``: copying a host directory in, its stat (its owner's): each directory opened on
    the way must be one :func:`readable_by_owner` lets be read, or :class:`NotShown` is raised."""

    def __init__(self, root_fd: int, create: bool, uid: int, gid: int,
                 shown_to: os.stat_result | None = None) -> None:
        self.root_fd, self.create, self.uid, self.gid = root_fd, create, uid, gid
        self.shown_to = shown_to
        self._path: str | None = None
        self._fd = -1

    def open(self, path: str) -> int:
        """The directory ``path`` ("" for the root); owned by this object: do not close it."""
        if path != self._path:
            self.close()
            self._fd = _open_dir_beneath(self.root_fd, path.split("/") if path else [], self.create,
                                         self.uid, self.gid, self.shown_to)
            self._path = path
        return self._fd

    def close(self) -> None:
        """Close what is open; also when it may be gone or replaced (the next open walks anew)."""
        if self._fd >= 0:
            os.close(self._fd)
        self._path, self._fd = None, -1


def remove_gone(dst_fd: int, keys: Iterable[Key], uid: int, gid: int, writing_back: bool = True,
                configured: HeldPaths | None = None) -> None:
    """Remove the entries ``keys`` (and what is below them) from the tree at ``dst_fd``, deepest
    first; one whose directory is gone already is skipped.  ``writing_back``: not what
    :func:`host_keeps` (the sandbox no more deletes the host's git configuration or a protective
    hook than it changes them; ``configured``: what the host's git configuration names)."""
    parents = DirsBeneath(dst_fd, False, uid, gid)
    try:
        for key in depth_order(keys, deepest_first=True):
            try:
                parent = parents.open(key[0])
                if writing_back and host_keeps(rel_of(key), _kind_at(parent, key[1]), configured):
                    continue
                if writing_back:
                    check_owners(parent, key[1], uid)
                remove_beneath(parent, key[1], owner=uid if writing_back else None)
            except NotTheOwners as exc:
                log.warning("workspace write-back leaves %s as the host has it: %s", rel_of(key), exc)
            except OSError:
                continue
    finally:
        parents.close()


def _kind_at(dir_fd: int, name: str) -> str:
    """The kind of the entry ``name`` (what :func:`host_keeps` tells a ``.git`` directory from a
    ``.git`` file by; other names need no system call)."""
    if name != ".git":
        return "f"
    return _kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)


def _entries(dir_fd: int) -> Iterator[os.DirEntry[str]]:
    """The entries of an open directory, read at once (the descriptor stays open for the walk)."""
    with os.scandir(dir_fd) as it:
        return iter(list(it))


#: the extended attribute overlayfs marks an upper directory with when it hides the lower one
OPAQUE = "trusted.overlay.opaque"


def is_whiteout(st: os.stat_result) -> bool:
    """An overlay's mark of a deleted lower entry: a character device 0/0."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def opaque(fd: int) -> bool:
    """True if the open upper directory ``fd`` is opaque (it hides the lower layer's)."""
    try:
        return os.getxattr(fd, OPAQUE) == b"y"
    except OSError:
        return False


def _open_dir_beneath(root_fd: int, parts: list[str], create: bool, uid: int, gid: int,
                      shown_to: os.stat_result | None = None) -> int:
    """Open the directory ``parts`` below root_fd without following symlinks.

    With ``create``, a missing component is made, and one that is not a real
    directory (a symlink, a file) is replaced by one.  With ``shown_to`` (the stat of the host
    directory copied in), each directory opened on the way is judged by :func:`readable_by_owner`
    as opened: :class:`NotShown` for one that is not, whatever its name was when it was looked at.
    """
    fd = os.dup(root_fd)
    try:
        for name in parts:
            try:
                nxt = open_beneath(fd, name, _DIR_FLAGS)
            except OSError as exc:
                if not create or exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    raise
                check_owners(fd, name, uid)  # never made in, nor made of, another user's entry
                if exc.errno != errno.ENOENT:
                    os.unlink(name, dir_fd=fd)
                os.mkdir(name, 0o755, dir_fd=fd)
                os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
                nxt = open_beneath(fd, name, _DIR_FLAGS)
            os.close(fd)
            fd = nxt
            if shown_to is not None and not readable_by_owner(os.fstat(fd), shown_to):
                raise NotShown(errno.EACCES, "another user's directory its mode lets no one else search")
        return fd
    except BaseException:
        os.close(fd)
        raise


def link_stays_inside(rel: str, target: str) -> bool:
    """True if a symlink at ``rel`` pointing to ``target`` resolves inside the tree, whatever the
    other links in the tree are.

    Judged by the target's text alone, as the tree's other links may change later, but not by
    normalizing it: ``..`` after a name climbs from wherever that name leads, so ``a/a/../..``
    with ``a -> .`` leaves the tree (the sandbox planted ``/etc/shadow`` in the user's
    directory so).  A target may climb only first, from the link's own directory (a real one:
    write-back makes real directories), and no higher than the tree's root; then it only
    descends, and each link it meets on the way was held to this same rule."""
    if not target or target.startswith("/"):
        return False
    parts = [part for part in target.split("/") if part not in ("", ".")]
    climbs = 0
    while climbs < len(parts) and parts[climbs] == "..":
        climbs += 1
    if ".." in parts[climbs:]:
        return False
    depth = len([part for part in rel.split("/")[:-1] if part not in ("", ".")])
    return climbs <= depth


class Budget:
    """The data bytes one sync may still copy: what the file system of the tree it copies holds.  A
    quiet tree never needs more; a sandbox moving 8 MiB of data ahead of the copy in a sparse file
    made a 32 MiB sandbox's write-back put 216 MiB in the user's directory."""

    def __init__(self, src_fd: int) -> None:
        st = os.fstatvfs(src_fd)
        self.left = st.f_blocks * st.f_frsize

    def take(self, wanted: int) -> int:
        """Up to ``wanted`` bytes of what is left; :class:`OverBudget` if nothing is."""
        if self.left <= 0:
            raise OverBudget()
        got = min(wanted, self.left)
        self.left -= got
        return got


class OverBudget(Exception):
    """A sync used up its :class:`Budget`: what it did not copy waits for the next one."""


def defer(current: Manifest, previous: Manifest, keys: Iterable[Key]) -> None:
    """Record ``keys`` in ``current`` (the manifest a sync leaves) as the sync found them, so that
    the next sync copies them: their previous entries, or none."""
    for key in keys:
        if key in previous:
            current[key] = previous[key]
        else:
            current.pop(key, None)


def copy_changed(current: Manifest, previous: Manifest, sources: DirsBeneath, targets: DirsBeneath,
                 skip: tuple[str, ...], copy: Callable[[Key, Entry, int, int], None],
                 writing_back: bool = True, configured: HeldPaths | None = None) -> None:
    """Call ``copy(key, entry, source dir fd, target dir fd)`` for each entry of ``current`` that
    is new or changed since ``previous`` (parents first; kinds in ``skip`` left out, and when
    ``writing_back`` what :func:`host_keeps`).  An entry the sandbox changed under the walk is left
    for the next write-back; once the :class:`Budget` is spent, it and every later one are
    (:func:`defer`)."""
    order = depth_order(current)
    owner = sources.shown_to  # copying in: the host directory's stat
    hidden: set[str] = set()  # copying in: the directories left out, whose entries are too
    for i, key in enumerate(order):
        entry = current[key]
        if entry[0] in skip or previous.get(key) == entry:
            continue
        if writing_back and (host_keeps(rel_of(key), entry[0], configured)
                             or makes_a_git_directory(current, targets.root_fd, key, entry[0])):
            continue  # (before the target's directory is opened: that would make it)
        try:
            if owner is not None:
                shown = _as_shown(key, entry, sources, owner, hidden)
                if shown is None:
                    continue
                entry = shown
            copy(key, entry, sources.open(key[0]), targets.open(key[0]))
        except OverBudget:
            defer(current, previous, order[i:])
            return
        except NotTheOwners as exc:
            log.warning("workspace write-back leaves %s as the host has it: %s", rel_of(key), exc)
            targets.close()  # (it may hold a directory it did not open)
        except NotShown:
            hidden.add(key[0])  # its directory was swapped for another user's since it was looked at
        except OSError as exc:
            if exc.errno not in CHANGED_MEANWHILE:
                raise
            sources.close()  # what they held may be gone
            targets.close()  # (changed while we copied: a directory made a link...)


class NotShown(PermissionError):
    """Copying a host directory in: a directory opened on the way is another user's that
    :func:`readable_by_owner` does not let be read (its name was swapped since it was looked at)."""


class NotTheOwners(PermissionError):
    """Write-back met a host entry of another user than the workspace directory's owner, or a
    directory of one to write in: it leaves them as they are (:func:`check_owners`)."""


def check_owners(dir_fd: int, name: str | None, uid: int) -> None:
    """Raise :class:`NotTheOwners` unless the directory ``dir_fd`` and its entry ``name`` (if
    any, and if there) are ``uid``'s.  Write-back changes only the directory owner's entries,
    in the owner's directories, as the overlay lets the sandbox change only those: another
    user's private file copied into a sandbox came back deleted, or replaced by one of the
    owner's (helper rt107)."""
    if os.fstat(dir_fd).st_uid != uid:
        raise NotTheOwners(errno.EPERM, "a directory of another user")
    if name is None:
        return
    try:
        theirs = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_uid
    except FileNotFoundError:
        return
    if theirs != uid:
        raise NotTheOwners(errno.EPERM, "another user's")


class OtherMount(NotTheOwners):
    """A walk or a copy met a mount point below the tree's root: what is mounted there is not the
    workspace's (:func:`open_beneath`), and is neither copied in nor written back."""

    def __init__(self, name: str) -> None:
        super().__init__(errno.EXDEV, "a mount point (what is mounted there is not the workspace's)", name)


#: this kernel (or the owner's seccomp filter: older Docker profiles) has no ``openat2``
_no_openat2 = False


def open_beneath(dir_fd: int, name: str, flags: int) -> int:
    """``name`` in the directory ``dir_fd`` opened with ``flags`` (no ``O_CREAT``), unless it is a
    mount point: :class:`OtherMount` then.  ``openat2(RESOLVE_NO_XDEV)``, one system call as
    ``openat`` is; where there is none, the two descriptors' mount ids are compared (``st_dev``
    is not enough: a bind mount of a directory of the same file system has the same)."""
    global _no_openat2
    if not _no_openat2:
        try:
            return openat2(dir_fd, name, flags, RESOLVE_NO_XDEV)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise OtherMount(name) from None
            if exc.errno != errno.ENOSYS:
                raise
        _no_openat2 = True
    fd = os.open(name, flags, dir_fd=dir_fd)
    if _mount_id(fd) != _mount_id(dir_fd):
        os.close(fd)
        raise OtherMount(name)
    return fd


def _mount_id(fd: int) -> str:
    with open(f"/proc/self/fdinfo/{fd}") as info:
        return next((line for line in info if line.startswith("mnt_id:")), "")


def readable_by_owner(st: os.stat_result, owner: os.stat_result) -> bool:
    """True if the host entry ``st`` is the directory's owner's (``owner``: the directory's
    stat), a symlink, or a file (a directory: listed and searched) that its others' bits let
    anyone read: what the overlay shows of another user's entry.  Its group's bits do not count,
    even when its group is the directory's (``nobody:user`` inside): overlayfs checks the host file
    with its mounter's credentials too, which no mode but others' lets read it (measured: a
    ``4343:root`` 0640 file in a root-owned directory is ``EACCES`` inside, for root too)."""
    if st.st_uid == owner.st_uid or stat.S_ISLNK(st.st_mode):
        return True
    needed = 0o5 if stat.S_ISDIR(st.st_mode) else 0o4
    return st.st_mode & needed == needed


def _as_shown(key: Key, entry: Entry, sources: DirsBeneath, owner: os.stat_result, hidden: set[str]) -> Entry | None:
    """Copying a host directory in: the entry to copy for ``key``, or None to leave it out.
    Another user's entry is copied only as far as :func:`readable_by_owner` says, without its
    write bits (it is not the sandbox's to change: write-back leaves it as the host has it);
    one that says no is left out, not copied as a placeholder (a placeholder would be the
    sandbox user's, whose root reads and writes it), and so is everything below a directory left
    out.  Before, the copy was the sandbox user's whatever its host owner and mode: the sandbox
    read other users' 0600 files (helper rt107).  This looks at names: what is copied is judged
    again as opened (the directories by :class:`DirsBeneath`, a file by :func:`_make_temporary`),
    as the workspace's owner can swap the names meanwhile."""
    rel = rel_of(key)
    if key[0] in hidden:
        if entry[0] == "d":
            hidden.add(rel)
        return None
    st = os.stat(key[1], dir_fd=sources.open(key[0]), follow_symlinks=False)
    if not readable_by_owner(st, owner):
        if entry[0] == "d":
            hidden.add(rel)
        return None
    if st.st_uid == owner.st_uid or entry[0] == "l":
        return entry
    return (entry[0], entry[1], entry[2], entry[3] & ~0o222, entry[4])


def _copy_data(src: int, dst: int, size: int, budget: Budget | None = None) -> None:
    """Copy the first ``size`` bytes of ``src`` to the empty ``dst``, data extents only: a hole
    stays a hole (the file systems that cannot tell report the whole file as data).  ``budget``
    bounds the bytes copied."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break  # only a hole is left
            raise
        try:
            end = min(os.lseek(src, start, os.SEEK_HOLE), size)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return  # the file shrank meanwhile (a command rewrote it): the next sync sees its new size
            raise
        os.lseek(dst, start, os.SEEK_SET)
        while start < end:
            wanted = min(end - start, 1 << 30)
            sent = os.sendfile(dst, src, start, budget.take(wanted) if budget is not None else wanted)
            if budget is not None:
                budget.left += wanted - sent  # what the file did not have
            if sent == 0:
                return  # the file shrank meanwhile: the next sync sees its new size
            start += sent
        offset = end
    os.ftruncate(dst, size)


def _link_to_copied(dst_root: int, dst_dir: int, tmp: str, earlier: tuple[str, int], uid: int, gid: int) -> bool:
    """Make ``tmp`` in ``dst_dir`` another name of the file this sync copied to ``earlier``'s path,
    if that path still names the file copied there; False if it does not (copy it anew)."""
    *dirs, name = earlier[0].split("/")
    try:
        fd = _open_dir_beneath(dst_root, dirs, create=False, uid=uid, gid=gid)
    except OSError:
        return False
    try:
        if os.stat(name, dir_fd=fd, follow_symlinks=False).st_ino != earlier[1]:
            return False
        os.link(name, tmp, src_dir_fd=fd, dst_dir_fd=dst_dir, follow_symlinks=False)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


#: mode bits write-back never gives a host file or directory: writing by others (a sandbox made
#: the user's ``.git`` 0777 and scripts 0666, for any host user to swap hooks or edit them)
WRITE_BACK_DROPS = stat.S_IWOTH


def write_back_group(source_gid: int, gid: int, groups: Container[int] | None, dst_dir: int, name: str) -> int:
    """The group the copy ``name`` in ``dst_dir`` gets: the source's if it is one of ``groups`` (a
    workspace overlay's :class:`.ws_overlay.HostGroups`) and the host has it there already -- the
    host entry it replaces has it (a file changed in place), or the host directory is set-group-id
    with it (made in a setgid project directory) -- else ``gid`` (the host directory's).  Not the
    source's group alone: on gVisor a directory raced into place came back with group 0 (a full run
    found ``ws/d`` owned by ``4321:0``)."""
    if groups is None or source_gid not in groups:
        return gid
    try:
        if os.stat(name, dir_fd=dst_dir, follow_symlinks=False).st_gid == source_gid:
            return source_gid
    except FileNotFoundError:
        pass
    parent = os.fstat(dst_dir)
    return source_gid if parent.st_mode & stat.S_ISGID and parent.st_gid == source_gid else gid


def _copy_entry(
    src_dir: int, dst_dir: int, dst_root: int, rel: str, kind: str, mode: int, uid: int, gid: int,
    inside_links_only: bool, links: Links | None = None, budget: Budget | None = None,
    groups: Container[int] | None = None, shown_to: os.stat_result | None = None,
) -> None:
    """Copy the entry ``rel`` (a directory, a symlink or a regular file), whose directories are
    open as ``src_dir`` and ``dst_dir``, to the destination (``dst_root``).  ``links``: the sync's
    map of multiply-linked files, so that every name of one source file names one destination file;
    ``budget``: the sync's :class:`Budget` (:class:`OverBudget` once it is spent, nothing copied);
    ``groups``: the source groups a file or directory keeps (:func:`write_back_group`);
    ``shown_to``: copying in, the host directory's stat (:func:`_make_temporary`)."""
    name = rel.rsplit("/", 1)[-1]
    if inside_links_only:  # writing to the host: what others may write there is not the sandbox's to widen
        mode &= ~WRITE_BACK_DROPS
        check_owners(dst_dir, name, uid)
    if kind == "d":
        fd = _open_dir_beneath(dst_dir, [name], create=True, uid=uid, gid=gid)
        try:
            dst_st = os.fstat(fd)
            if groups is not None:
                group = write_back_group(os.stat(name, dir_fd=src_dir, follow_symlinks=False).st_gid, gid, groups,
                                         dst_dir, name)
                if group != gid and group != dst_st.st_gid:
                    os.fchown(fd, -1, group)  # (a directory's group stays as it is, but for one of ``groups``)
            # its mode too: a 0700 directory made 0755 on the host let every host user read it; the
            # set-group-id bit only stays where the destination has it too (a setgid project directory)
            os.fchmod(fd, mode & 0o1777 | mode & dst_st.st_mode & stat.S_ISGID)
        finally:
            os.close(fd)
        return
    # 255 bytes, not characters: a name of 127 "é" made every later write-back fail (ENAMETOOLONG)
    tmp = os.fsdecode(os.fsencode(f".corral-tmp-{os.getpid()}-{name}")[:255])
    remove_beneath(dst_dir, tmp)  # left by a sync that failed midway: every later one failed on it
    try:
        if not _make_temporary(src_dir, dst_dir, dst_root, rel, tmp, kind, mode, uid, gid, inside_links_only, links,
                               budget, groups, shown_to):
            return
    except BaseException:
        with contextlib.suppress(OSError):
            remove_beneath(dst_dir, tmp)
        raise
    try:
        _replace(dst_dir, tmp, name, owner=uid if inside_links_only else None)
    except BaseException:
        with contextlib.suppress(OSError):
            remove_beneath(dst_dir, tmp)
        raise


def _replace(dir_fd: int, tmp: str, name: str, owner: int | None) -> None:
    """Rename ``tmp`` to ``name`` in ``dir_fd``; a directory there is removed first (``owner``: as
    :func:`remove_beneath` does), a mount point is left (:class:`OtherMount`)."""
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return
    except IsADirectoryError:
        pass
    except OSError as exc:
        if exc.errno == errno.EBUSY:  # a file mounted on ``name``
            raise OtherMount(name) from exc
        raise
    remove_beneath(dir_fd, name, owner=owner)
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY):
            raise
        raise NotTheOwners(errno.EPERM, "a directory holding another user's entries") from exc


def _make_temporary(
    src_dir: int, dst_dir: int, dst_root: int, rel: str, tmp: str, kind: str, mode: int, uid: int, gid: int,
    inside_links_only: bool, links: Links | None, budget: Budget | None, groups: Container[int] | None = None,
    shown_to: os.stat_result | None = None,
) -> bool:
    """Make ``tmp`` in ``dst_dir`` a copy of the link or file ``rel`` (:func:`_copy_entry`); False
    if there is nothing to copy (a link that leads out of the tree, an entry no longer of its kind,
    or, copying in with ``shown_to``, a file :func:`readable_by_owner` does not let be read).

    The file is judged as opened, not by its name: the workspace's owner swapped their 0644 file
    with another user's 0600 one in a loop (``renameat2(RENAME_EXCHANGE)``), and the copy made of
    what was looked at as the owner's copied the other user's secret in 41 of 200 creates."""
    name = rel.rsplit("/", 1)[-1]
    if kind == "l":
        try:
            target = os.readlink(name, dir_fd=src_dir)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False  # no longer a link: the next sync sees what it is now
            raise
        if inside_links_only and not link_stays_inside(rel, target):
            return False  # never plant a link to host paths in the user's directory
        os.symlink(target, tmp, dir_fd=dst_dir)
        os.chown(tmp, uid, gid, dir_fd=dst_dir, follow_symlinks=False)
        return True
    src = _open_file(src_dir, name)
    if src is None:
        return False  # no longer a file: the next sync sees what it is now
    try:
        st = os.fstat(src)
        if shown_to is not None:
            if not readable_by_owner(st, shown_to):
                return False
            if st.st_uid != shown_to.st_uid:
                mode &= ~0o222  # (as :func:`_as_shown`, for what was opened)
        key = (st.st_dev, st.st_ino)
        earlier = links.get(key) if links is not None and st.st_nlink > 1 else None
        if earlier is None or not _link_to_copied(dst_root, dst_dir, tmp, earlier, uid, gid):
            dst, anonymous = _new_file(dst_dir, tmp)
            try:
                _copy_data(src, dst, st.st_size, budget)
                os.fchown(dst, uid, write_back_group(st.st_gid, gid, groups, dst_dir, name))
                os.fchmod(dst, mode & 0o777)
                if anonymous:  # whole and the user's now: only then does it get a name
                    os.link(f"/proc/self/fd/{dst}", tmp, dst_dir_fd=dst_dir, follow_symlinks=True)
                if links is not None and st.st_nlink > 1:
                    links[key] = (rel, os.fstat(dst).st_ino)
            finally:
                os.close(dst)
        return True
    finally:
        os.close(src)


def _new_file(dir_fd: int, tmp: str) -> tuple[int, bool]:
    """A file to copy into, in ``dir_fd``: unnamed (``O_TMPFILE``) where the file system allows,
    so that an owner killed mid-copy leaves nothing in the user's directory (a named temporary
    stayed there for good, partial and root's); else ``tmp``.  (descriptor, whether unnamed)"""
    try:
        return os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=dir_fd), True
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=dir_fd), False


def _open_file(dir_fd: int, name: str) -> int | None:
    """``name`` in ``dir_fd`` opened to read if it is a regular file, else None.  It is looked at
    (``O_PATH``, which opens nothing) before it is opened, through that descriptor: a name the
    sandbox swaps meanwhile for a fifo, socket, whiteout or link (a background ``rm f; ln g f``
    made commands fail with ``EACCES``) is never opened, nor followed; nor is a file mounted there
    (a bind mount of a single file: not the workspace's)."""
    try:
        path_fd = open_beneath(dir_fd, name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OtherMount:
        return None
    try:
        if not stat.S_ISREG(os.fstat(path_fd).st_mode):
            return None
        return os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(path_fd)


#: the most directories :func:`remove_beneath` holds open at once: a directory deeper than this
#: below the one removed is first moved up beside the top one (a sandbox's chain of thousands of
#: directories held a descriptor per level, and could take an owner's last ones)
REMOVE_HELD_DIRS = 64


def remove_beneath(dir_fd: int, name: str, owner: int | None = None) -> None:
    """Remove ``name`` in ``dir_fd`` and, if it is a directory, everything below it, never
    following a symlink; without recursion, as a tree may be deeper than Python's stack.
    ``owner``: below ``name``, entries of another uid are left, with the directories that hold
    them (write-back deletes only the directory owner's).  Without ``owner`` the whole tree goes
    and at most ``REMOVE_HELD_DIRS`` directories are open at a time, however deep it is: a
    directory that deep is renamed into ``name`` (it is being removed anyway) and removed from there."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        _unlink(dir_fd, name)
        return
    # (a directory's descriptor, its name in its parent's, its entries left): the parent is the one below
    top = open_beneath(dir_fd, name, _DIR_FLAGS)
    stack = [(top, name, iter(os.listdir(top)))]
    moved_up: list[str] = []  # directories moved into ``top`` after its entries were listed
    try:
        while stack:
            fd, _, children = stack[-1]
            child = next(children, None)
            if child is None and len(stack) == 1 and moved_up:
                stack[0] = (top, name, iter(moved_up))
                moved_up = []
                continue
            if child is None:
                fd, done, _ = stack.pop()
                os.close(fd)
                try:
                    os.rmdir(done, dir_fd=stack[-1][0] if stack else dir_fd)
                except OSError as exc:
                    if owner is None or exc.errno != errno.ENOTEMPTY:
                        raise
                continue
            try:
                child_st = os.stat(child, dir_fd=fd, follow_symlinks=False)
                if owner is not None and child_st.st_uid != owner:
                    continue
                if not stat.S_ISDIR(child_st.st_mode):
                    _unlink(fd, child)
                elif owner is None and len(stack) >= REMOVE_HELD_DIRS:
                    moved = f".corral-removing-{secrets.token_hex(8)}"
                    os.rename(child, moved, src_dir_fd=fd, dst_dir_fd=top)
                    moved_up.append(moved)
                else:
                    sub = open_beneath(fd, child, _DIR_FLAGS)
                    stack.append((sub, child, iter(os.listdir(sub))))
            except FileNotFoundError:
                continue
            except OtherMount:
                if owner is None:
                    raise
                continue  # left, with the directories that hold it (as another user's entry)
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.EBUSY:  # a file mounted on ``name``
            raise OtherMount(name) from exc
        raise
