"""A workspace as an overlay on the host directory: nothing is copied when the sandbox is made,
and each write-back looks only at what the sandbox changed since the previous one.

Layout, on the sandbox's disk tmpfs (the disk limit bounds every write, copy-ups included)::

    ws-upper/   the overlay's upper layer: every file the sandbox created or changed,
                a whiteout (character device 0/0) per deletion, opaque directories
    ws-work/    overlayfs's work directory
    ws/         the merged view, bound at /workspace

The lower layer is an idmapped, read-only, nosuid, nodev, noatime view of the host directory
(:mod:`.idmap`) through a user namespace that maps the directory's owner (its uid, and its gid)
to the sandbox user's host ids, and every other gid but Corral's pool of sandbox ids to itself
(:class:`HostGroups`; no uid but the owner's).  Inside, the owner's files belong to the sandbox
user (uid 1000); files of any other host user show as ``nobody`` (65534): readable as their mode
allows, never writable (a copy-up could not give the copy an owner the sandbox can name).  An
owner's file of another group than the directory's (``root:adm`` in a ``root:root``
directory; a group-shared or setgid project directory) shows as ``nogroup``, the sandbox user
changes and deletes it as its owner, and a copy-up keeps its host group: that group is none of
the sandbox's (it cannot ``chgrp`` or ``setgid`` to it, nor read another user's file through it),
and for the same reason root inside has no override over such a file (it writes it in place
only as its owner, uid 1000: ``EACCES`` else), nor has gVisor, whose Sentry reaches files as the
sandbox's root (there such a file is deleted, renamed or replaced, not written in place).
Before, only the directory's gid was mapped: such a file could be neither written (``EACCES``)
nor deleted (``EOVERFLOW``).  The sandbox never writes the host directory: the view is
read-only, overlayfs writes only its upper layer, and only Corral's write-back (running as host
root, outside the sandbox) writes the host directory.

The overlay is mounted with ``redirect_dir=off``, ``metacopy=off`` and ``index=off`` (this
kernel's defaults, spelled out because the write-back relies on them): the upper layer holds
whole copies and never points back into the lower one.  Renaming a directory that exists on
the host fails with ``EXDEV`` inside, which ``mv`` and most tools answer by copying and
deleting.  Hard links in the host directory are separate files once one of them is changed
(overlayfs copies up one name), as they are after today's write-back.

Write-back (:meth:`WorkspaceOverlay.sync_back`) finds what changed in the upper layer since the
previous write-back, and applies it with the rules of :mod:`.workspace` (directory descriptors
opened with ``O_NOFOLLOW`` on both sides; files owned by the host directory's owner; only
symlinks that stay inside the workspace).  A file or directory whose group in the upper layer
is one of :class:`HostGroups` keeps that group on the host where the host has it there already
(the host entry it replaces has it: a copy-up keeps it; or its host directory is setgid with it:
a setgid directory's copy passes it to what is made in it), every other entry gets the
directory's (:func:`.workspace.write_back_group`), so write-back never writes a group that none of
the owner's entries in the directory had, whatever the upper layer says (on gVisor a directory
raced into place there with group 0).  To find it, it looks only where a change watch of the
sandbox's disk (:mod:`.fsnotify`, made before the sandbox runs anything) saw a change, and
compares what it finds there with the previous write-back's manifest (:mod:`.ws_changes`): its
cost follows what changed since the previous write-back, not what the sandbox made before.  It
walks the whole upper layer instead, as every write-back did before, at the first write-back,
when the watch lost events (its queue is the kernel's bounded one), when an event cannot be
placed, where this host gives no watch (no fanotify with file handles; more sandboxes at once
than half of ``fs.fanotify.max_user_groups``), and at destroy -- which is when a write through a
shared mapping that a background process still holds arrives at the latest (it makes no event
until the mapping goes).  Only an ``rw`` workspace has a watch: one fanotify group of the owner's,
closed at destroy, whose queue (the kernel's ``fs.fanotify.max_queued_events``, 16,384 events:
a few MB of the owner's kernel memory at most) also fills with the sandbox's changes outside
the workspace (its root's upper layers share the disk), which are read and dropped.  Either way,
what it applies:

- a regular file, symlink or directory that is new or changed: copied to the host (a symlink
  leading out of the workspace is not: the host's entry at its path is deleted);
- a new whiteout: the host's entry is deleted;
- a directory that became opaque (``trusted.overlay.opaque``: deleted and made anew inside):
  the host's entries that the upper directory does not hold are deleted;
- an entry of the previous walk that is gone: deleted on the host (overlayfs removes an entry
  without leaving a whiteout when no lower layer had it when it was removed).

Changes made on the host while the sandbox is live: overlayfs calls them undefined (never a
crash) -- inside, a host change to a path the sandbox has not changed may show or not
(lookups are cached), and a path the sandbox changed is its own copy, which host changes do
not reach.  At write-back only the paths the sandbox changed since the previous write-back
are written: for those the sandbox's version wins (a host edit of them is replaced, a host
deletion undone), every other host change is kept.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import InvalidSpec
from . import idmap, mounts
from .fsnotify import ChangeWatch, Overflow
from .git_reach import GitReach
from .mountns import HostMounts, MountNamespace
from .uids import RANGE_SIZE, SANDBOX_UID, UID_TOP, WIDE_BASE
from .workspace import (
    _DIR_FLAGS,
    WHITEOUT,
    Budget,
    DirsBeneath,
    Entry,
    Key,
    Links,
    Manifest,
    OtherMount,
    _copy_entry,
    _kind_at,
    _open_dir_beneath,
    copy_changed,
    is_whiteout,
    link_stays_inside,
    rel_of,
    remove_beneath,
    remove_gone,
    scan,
)
from .ws_changes import Unplaced, UpperTree
from .ws_copy import WorkspaceCopy, open_host_dir
from .ws_git import HeldPaths, host_keeps

#: False: the process and gVisor tiers copy the workspace instead, as before the overlay
#: (bench/workspace.py sets it to compare the two)
ENABLED = True
#: False: write-backs walk the whole upper layer every time (no change watch; bench/workspace.py
#: sets it to compare)
WATCH = True
#: the overlay's options beyond its layers (see the module docstring)
OVERLAY_OPTIONS = "redirect_dir=off,metacopy=off,index=off"

log = logging.getLogger(__name__)


#: the ids a ``gid_map`` line may name: ``0 .. 2**32 - 2`` (``-1`` is no id)
_ID_END = 2**32 - 1


class HostGroups:
    """The host gids the workspace's user namespace maps to themselves (:func:`owner_maps`): every
    gid but the directory's own and Corral's pool of sandbox ids.  They are no gid of the sandbox's
    (it cannot take one with ``chgrp`` nor ``setgid``), so a file of the directory's owner with such
    a group, which the sandbox user changes as the owner, keeps its group when overlayfs copies it
    up; write-back gives a file such a group only if it had it in the upper layer, where nothing
    but the host directory's entries brings one (:func:`.workspace.write_back_group`)."""

    def __init__(self, dir_gid: int, sandbox_user: int) -> None:
        own = sandbox_user - SANDBOX_UID  # the sandbox's range (in the pool, unless a test's)
        holes = sorted([(dir_gid, dir_gid + 1), (WIDE_BASE, UID_TOP), (own, own + RANGE_SIZE)])
        self.spans: list[tuple[int, int]] = []  # [start, end) each
        start = 0
        for low, high in holes:
            if low > start:
                self.spans.append((start, min(low, _ID_END)))
            start = max(start, high)
        if start < _ID_END:
            self.spans.append((start, _ID_END))

    def __contains__(self, gid: object) -> bool:
        return isinstance(gid, int) and any(low <= gid < high for low, high in self.spans)


def owner_maps(host: Path, sandbox_user: int, st: os.stat_result | None = None) -> tuple[str, str]:
    """``uid_map`` and ``gid_map`` of the workspace's user namespace: the host directory's owner
    (uid; gid) is the sandbox user's host uid (``sandbox_user``, uid 1000 inside); every other gid
    but Corral's is itself (:class:`HostGroups`: a handful of lines, of the kernel's 340); every
    other uid is unmapped (``nobody`` inside, whose files the sandbox never changes)."""
    st = st if st is not None else os.stat(host)
    lines = [f"{st.st_gid} {sandbox_user} 1\n"]
    lines += [f"{low} {low} {high - low}\n" for low, high in HostGroups(st.st_gid, sandbox_user).spans]
    return f"{st.st_uid} {sandbox_user} 1\n", "".join(lines)


def mount_workspace(host: Path, merged: Path, upper: Path, work: Path, userns_fd: int, read_only: bool,
                    mounter: HostMounts | None, host_st: os.stat_result) -> None:
    """The one mount a sandbox's set-up makes for its workspace: the overlay of the idmapped view
    of ``host`` (ids of ``userns_fd``) and ``upper`` at ``merged``; with ``read_only`` a
    read-only overlay of the view over ``upper``, left empty, and no ``work``.  Never the view
    itself: its inodes are the host's, and a Unix socket in the host directory (an agent's, a
    database's) could be connected to from inside, whatever the sandbox's network.
    A ``mounter`` of the sandbox's own mount namespace makes them there (the view then goes
    through an empty directory of the run dir, ``lower/workspace``, for the time of the mount).
    ``host_st`` is the directory as the caller opened it: the view is made of ``host`` by its
    path and refused unless it is that directory (a host user owning a directory on the path
    could swap it for a link between the caller's checks and the mount, and the sandbox saw
    where the link led: a directory that user cannot enter)."""
    def expect(view: os.stat_result) -> None:
        if (view.st_dev, view.st_ino) != (host_st.st_dev, host_st.st_ino):
            raise InvalidSpec(f"workspace {host}: the path led elsewhere as it was mounted (a link put on it "
                              "since it was checked); give the directory itself")

    if isinstance(mounter, MountNamespace):
        view = merged.parent.parent / "lower" / "workspace"
        view.mkdir(parents=True)
        try:
            if read_only:
                mounter.mapped_read_only(merged, host, upper, userns_fd, view, extra=OVERLAY_OPTIONS, expect=expect)
            else:
                mounter.mapped_overlay(merged, host, upper, work, userns_fd, view, extra=OVERLAY_OPTIONS,
                                       expect=expect)
        finally:
            view.rmdir()
        return
    # overlayfs opens lower files O_NOATIME already; noatime covers whatever else reads the view
    tree = idmap.idmapped_tree(host, userns_fd, noatime=True)
    try:
        expect(os.fstat(tree))
        # the detached view by its descriptor: overlayfs keeps its own clone of it
        view = Path(f"/proc/self/fd/{tree}")
        if read_only:
            fstype, flags, options = mounts.read_only_overlay_args([view, upper])
        else:
            fstype, flags, options = mounts.overlay_args([view], upper, work)
        mounts.mount("overlay", merged, fstype, flags, f"{options},{OVERLAY_OPTIONS}")
    finally:
        os.close(tree)


def make_workspace(host: Path, mode: str, disk: Path, uid: int, max_bytes: int,
                   userns: Callable[[tuple[str, str]], int],
                   mounter: HostMounts | None = None,
                   charge: Callable[[Callable[[], None]], None] | None = None,
                   ) -> tuple[WorkspaceCopy | WorkspaceOverlay | None, bool]:
    """The workspace of a sandbox whose disk tmpfs is ``disk`` and whose user is host uid ``uid``,
    at ``disk/ws`` (an empty directory): the overlay (``ro``: the read-only view), or the copy
    when ``host`` cannot be idmapped (its file system, an older kernel).  ``userns(maps)`` gives
    a user namespace with those maps (:func:`owner_maps`); ``charge`` runs the copy, if it comes to
    that, where its pages are charged to the sandbox (``host/charged.py``).  Returns what writes it
    back (None for ``ro``) and whether ``disk/ws`` is now a mount point."""
    ws, upper, work = disk / "ws", disk / "ws-upper", disk / "ws-work"
    # the files as this process reaches them (through the sandbox's mount namespace, if its own)
    on_disk = mounter.view if mounter is not None else (lambda path: path)
    read_only = mode == "ro"
    # the directory the checks saw, opened once: the mount is checked to be of it, the copy (if it
    # comes to that) is made of it, write-back writes to it
    host_fd = open_host_dir(host)
    try:
        host_st = os.fstat(host_fd)
        on_disk(upper).mkdir()  # ``ro``: the empty layer under the view
        if not read_only:
            on_disk(work).mkdir()
            # the overlay's root is the upper's: the sandbox user's, with the host directory's mode
            os.chown(on_disk(upper), uid, uid)
            os.chmod(on_disk(upper), host_st.st_mode & 0o7777)
        try:
            mount_workspace(host, ws, upper, work, userns(owner_maps(host, uid, host_st)), read_only, mounter, host_st)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
                raise
            log.warning("workspace %s cannot be idmapped (%s): copied instead", host, exc)
            for unused in (on_disk(upper), on_disk(work)):
                if unused.exists():
                    unused.rmdir()
            opened, host_fd = host_fd, -1  # the copy's now (it closes it, also if it failed to be made)
            return WorkspaceCopy.create(host, on_disk(ws), uid, uid, max_bytes, host_fd=opened, charge=charge), False
        if read_only:
            return None, True
        groups = HostGroups(host_st.st_gid, uid)
        opened, host_fd = host_fd, -1  # the overlay's now (it closes it, also if it failed to be made)
        return WorkspaceOverlay(host, on_disk(upper), opened, watch=mode == "rw", groups=groups), True
    finally:
        if host_fd >= 0:
            os.close(host_fd)


def scan_upper(upper: Path) -> Manifest:
    """Every entry of an overlay's upper layer, kinds as :func:`.workspace.scan`'s plus ``w`` (a
    whiteout) and ``D`` (an opaque directory).  Its time is the change time, which no one can
    set back (a write that keeps a file's size and resets its mtime is still a change)."""
    return scan(upper, upper=True)


class WorkspaceOverlay:
    """A workspace mounted by :func:`mount_workspace`: ``host`` is the user's directory, ``upper``
    the overlay's upper layer, whose changes :meth:`sync_back` writes to ``host``.  Made before
    the sandbox runs anything (its change watch must see every change); :meth:`close` at destroy."""

    def __init__(self, host: Path, upper: Path, host_fd: int, watch: bool = True,
                 groups: HostGroups | None = None) -> None:
        """``host_fd``: the host directory as opened at create (:func:`.ws_copy.open_host_dir`),
        what write-back writes to, never the path again; this overlay's from here, closed also if
        it fails to be made."""
        self.host = host
        self.upper = upper
        #: the upper layer's groups a write-back keeps (:func:`.workspace.write_back_group`)
        self.groups = groups
        self._host_fd = host_fd
        try:
            self._fd = os.open(upper, _DIR_FLAGS)  # also once the path is gone (a mount namespace's)
            try:
                self.tree = UpperTree(self._fd)
                self.watch = _open_watch(upper) if watch else None  # (``cow`` is never written back)
            except BaseException:
                os.close(self._fd)
                raise
        except BaseException:
            os.close(host_fd)
            raise
        self._walked = False  # the first write-back walks everything
        #: write-backs that walked the whole upper layer (tests and figures read it)
        self.full_scans = 0
        self._lock = threading.Lock()  # commands finishing at once write back one at a time
        self._git = GitReach(host)

    @property
    def manifest(self) -> Manifest:
        """The upper layer as the last write-back wrote it to the host."""
        return self.tree.manifest

    @property
    def looked_at(self) -> int:
        """The entries the last write-back looked at: what it changed, or everything."""
        return self.tree.looked_at

    def sync_back(self, full: bool = False) -> None:
        """Write what changed in the upper layer since the last write-back to the host directory:
        where the change watch points, or (``full``, no watch, events lost) after a walk of it all."""
        with self._lock:
            if self._fd < 0:
                return
            found = None
            if self.watch is not None and self._walked and not full:
                try:
                    found = self.tree.look(self.tree.spots(self.watch))
                except (Overflow, Unplaced, OSError) as exc:
                    log.info("workspace %s: walking its upper layer whole (%s)", self.host, exc or "event queue overflow")
            walked, self._walked = self._walked, False  # until it is done: one that fails midway
            host_st = os.fstat(self._host_fd)           # (its events drained) is followed by a walk
            if found is not None:
                self._write(found, host_st.st_uid, host_st.st_gid)
                self._walked = walked
                return
            if self.watch is not None:
                self.watch.discard()  # what happens from here on is the next write-back's
            current = self.tree.full()
            self.full_scans += 1
            if current != self.manifest:
                looked = dict(current)
                _apply(self._fd, self._host_fd, current, self.manifest, host_st.st_uid, host_st.st_gid, self.groups,
                       self._git.held())
                self.tree.pending = {key for key, entry in looked.items() if current.get(key) != entry}
                self.tree.replace(current)
            else:
                self.tree.pending = set()
            self._walked = True

    def _write(self, found: dict[Key, Entry | None], uid: int, gid: int) -> None:
        """Write back the entries ``found`` (:meth:`.ws_changes.UpperTree.look`) that changed."""
        current = {key: entry for key, entry in found.items() if entry is not None}
        # a whiteout an event pointed at is written again: the sandbox deleted that path (again)
        previous = {key: self.manifest[key] for key, entry in found.items()
                    if key in self.manifest and entry != WHITEOUT}
        if current != previous:
            looked = dict(current)
            _apply(self._fd, self._host_fd, current, previous, uid, gid, self.groups, self._git.held())
            self.tree.pending = {key for key, entry in looked.items() if current.get(key) != entry}
        else:
            self.tree.pending = set()
        self.tree.commit({key: current.get(key) for key in found})

    def close(self, write_back: bool = True) -> None:
        """At destroy: the last write-back (with ``write_back``; a walk of everything, for what
        no event showed: a write through a shared mapping still held), then release the watch
        and the upper layer's descriptor."""
        try:
            if write_back:
                self.sync_back(full=True)
        finally:
            with self._lock:
                if self.watch is not None:
                    self.watch.close()
                    self.watch = None
                if self._fd >= 0:
                    os.close(self._fd)
                    os.close(self._host_fd)
                    self._fd = self._host_fd = -1


#: the change watches this process holds, at most half of ``fs.fanotify.max_user_groups`` (the
#: host's other users of fanotify keep the rest); a sandbox past that walks everything
_watches = 0
_watches_lock = threading.Lock()


def _max_watches() -> int:
    try:
        return int(Path("/proc/sys/fs/fanotify/max_user_groups").read_text()) // 2
    except (OSError, ValueError):
        return 0


def _open_watch(upper: Path) -> ChangeWatch | None:
    global _watches
    with _watches_lock:
        if not WATCH or _watches >= _max_watches():
            return None
        watch = ChangeWatch.open(upper, on_close=_closed)
        if watch is not None:
            _watches += 1
        return watch


def _closed() -> None:
    global _watches
    with _watches_lock:
        _watches -= 1


def _apply(upper_fd: int, host_fd: int, current: Manifest, previous: Manifest, uid: int, gid: int,
           groups: HostGroups | None = None, configured: HeldPaths | None = None) -> None:
    src_fd = os.dup(upper_fd)
    dst_fd = os.dup(host_fd)
    sources, targets = DirsBeneath(src_fd, False, uid, gid), DirsBeneath(dst_fd, True, uid, gid)
    links: Links = {}
    budget = Budget(src_fd)
    try:
        gone = [key for key in previous if key not in current]
        gone += [key for key, entry in current.items() if entry[0] == "w" and previous.get(key) != entry]
        remove_gone(dst_fd, gone, uid, gid, configured=configured)

        def copy(key: Key, entry: Entry, src_dir: int, dst_dir: int) -> None:
            kind, rel = entry[0], rel_of(key)
            if kind == "l" and not _link_inside(src_dir, rel):
                remove_beneath(dst_dir, key[1])  # a link Corral does not plant: the host's entry goes
                return
            _copy_entry(src_dir, dst_dir, dst_fd, rel, "d" if kind == "D" else kind, entry[3], uid, gid,
                        inside_links_only=True, links=links, budget=budget, groups=groups)
            if kind == "D" and previous.get(key, ("",))[0] != "D":
                _keep_only_upper(src_fd, dst_fd, rel, uid, gid, configured)

        copy_changed(current, previous, sources, targets, ("w", "o"), copy, configured=configured)
    finally:
        sources.close()
        targets.close()
        os.close(src_fd)
        os.close(dst_fd)


def _link_inside(src_dir: int, rel: str) -> bool:
    try:
        return link_stays_inside(rel, os.readlink(rel.rsplit("/", 1)[-1], dir_fd=src_dir))
    except OSError:
        return True  # no longer a link: _copy_entry sees what it is now


def _keep_only_upper(src_fd: int, dst_fd: int, rel: str, uid: int, gid: int,
                     configured: HeldPaths | None = None) -> None:
    """An opaque directory hides the lower layer's entries: delete the host's that the upper
    directory does not hold (whiteouts in it count as absent)."""
    parts = rel.split("/")
    src = _open_dir_beneath(src_fd, parts, create=False, uid=uid, gid=gid)
    try:
        with os.scandir(src) as it:
            keep = {e.name for e in it if not is_whiteout(e.stat(follow_symlinks=False))}
    finally:
        os.close(src)
    dst = _open_dir_beneath(dst_fd, parts, create=True, uid=uid, gid=gid)
    try:
        for name in os.listdir(dst):
            if name not in keep and not host_keeps(f"{rel}/{name}", _kind_at(dst, name), configured):
                try:
                    remove_beneath(dst, name)
                except OtherMount as exc:
                    log.warning("workspace write-back leaves %s/%s as the host has it: %s", rel, name, exc)
    finally:
        os.close(dst)
