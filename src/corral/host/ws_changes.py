"""The manifest of a workspace overlay's upper layer, kept up to date by looking again only
where the sandbox changed something (:mod:`.fsnotify`), so that a write-back costs what changed
since the last one, not what the sandbox ever made.

A change event names a directory (by file handle) and an entry of it.  The entry is looked at
anew exactly as the full walk (:func:`.workspace.scan`) looks at it -- its directory opened one
component at a time with ``O_NOFOLLOW`` below the upper layer's descriptor, the entry ``lstat``-ed,
a directory opened to read its opaque mark -- and:

- a directory that is new at its path (made, moved there, or a different one than before) is
  walked whole; the entries below a directory that left its path are gone;
- every other name of a file with more than one (a hard link: the kernel reports the one
  name it was reached by, and none for a link count change) is looked at too, found by inode;
- the entry of the directory an event came from is looked at too (its change time moved).

The events are where to look, never what to believe.  Whatever cannot be placed -- a queue
overflow, a directory handle that resolves to a path the walk cannot reach -- makes the caller
walk everything, as before (:meth:`UpperTree.full`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator

from .fsnotify import ChangeWatch
from .workspace import (
    _DIR_FLAGS,
    MAX_DEPTH,
    MAX_PATH,
    DirsBeneath,
    Entry,
    Key,
    Manifest,
    _open_dir_beneath,
    entry_of,
    opaque,
    open_beneath,
    rel_of,
    scan,
)

#: at most this many events are read per write-back; more counts as an overflow (walk everything)
DRAIN_LIMIT = 1 << 16


class Unplaced(Exception):
    """An event's directory could not be placed in the upper layer: walk everything."""


def key_of(rel: str) -> Key:
    """The manifest key of the entry at ``rel`` (not the root)."""
    parent, _, name = rel.rpartition("/")
    return (parent, name)


def listed(prefix: str) -> bool:
    """True if the walk lists the entries of the directory ``prefix`` (:data:`MAX_DEPTH`)."""
    return (prefix.count("/") + 1 if prefix else 0) < MAX_DEPTH


class UpperTree:
    """The manifest of the upper layer open as ``fd`` (owned by the caller), with what lets it be
    updated in pieces: each directory's names, and the names of each non-directory inode."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.manifest: Manifest = {}
        self._children: dict[str, set[str]] = {}
        self._inode: dict[int, Key] = {}  # a name of each non-directory inode
        self._names: dict[int, set[Key]] = {}  # every name, for the inodes seen with more than one
        #: keys to look at again at the next update whatever the events say (a copy deferred)
        self.pending: set[Key] = set()
        #: entries looked at by the last :meth:`full` or :meth:`look` (tests read it)
        self.looked_at = 0
        self._root = os.readlink(f"/proc/self/fd/{fd}")

    # -- everything ---------------------------------------------------------------
    def full(self) -> Manifest:
        """Every entry of the upper layer, walked anew (not yet :meth:`commit`-ted)."""
        current = scan(self.fd, upper=True)
        self.looked_at = len(current)
        return current

    def replace(self, manifest: Manifest) -> None:
        """Make ``manifest`` (a whole walk's, as written back) the one kept."""
        self.manifest = {}
        self._children, self._inode, self._names = {}, {}, {}
        for key, entry in manifest.items():
            self._set(key, entry)

    # -- where the events point ------------------------------------------------------
    def spots(self, watch: ChangeWatch) -> set[Key]:
        """The keys the events queued since the last drain point at (with :attr:`pending`).
        :class:`.fsnotify.Overflow` or :class:`Unplaced`: look at everything instead."""
        by_dir: dict[bytes, set[str]] = {}
        for change in watch.drain(DRAIN_LIMIT):
            by_dir.setdefault(change.handle, set()).add(change.name)
        keys = set(self.pending)
        for handle, names in by_dir.items():
            rel = self._place(watch, handle)
            if rel is None:
                continue
            if rel:
                keys.add(key_of(rel))  # its change time moved, its opaque mark may have
            if listed(rel):
                keys.update((rel, name) for name in names if name != ".")
        return keys

    def _place(self, watch: ChangeWatch, handle: bytes) -> str | None:
        """The path below the upper layer of the directory ``handle``; None if it is gone or
        outside (the image's upper layers, overlayfs's work directory)."""
        try:
            fd = watch.open_dir(self.fd, handle)
        except OSError as exc:
            if exc.errno == errno.ESTALE:
                return None  # gone: its removal is an event of its parent's (or of an ancestor's)
            raise Unplaced(str(exc)) from exc
        try:
            st = os.fstat(fd)
            if st.st_nlink == 0:
                return None  # removed, still open somewhere: likewise
            path = os.readlink(f"/proc/self/fd/{fd}")
            if path == self._root:
                return ""
            if not path.startswith(self._root + "/"):
                return None
            rel = path[len(self._root) + 1:]
            try:
                found = _open_dir_beneath(self.fd, rel.split("/"), create=False, uid=0, gid=0)
            except OSError as exc:
                raise Unplaced(f"{rel}: {exc}") from exc
            try:
                same = os.fstat(found)
            finally:
                os.close(found)
            if (same.st_dev, same.st_ino) != (st.st_dev, st.st_ino):
                raise Unplaced(f"{rel} is not the directory the event named")
            return rel
        finally:
            os.close(fd)

    # -- looking there ------------------------------------------------------------
    def look(self, spots: Iterable[Key]) -> dict[Key, Entry | None]:
        """Each of ``spots`` and whatever it leads to (a directory's subtree, a file's other
        names) as it is now (None: gone)."""
        found: dict[Key, Entry | None] = {}
        queue = sorted(spots, reverse=True)  # popped in order: one directory's names together
        parents = DirsBeneath(self.fd, False, 0, 0)
        self.looked_at = 0
        try:
            while queue:
                key = queue.pop()
                if key in found:
                    continue
                old, new = self.manifest.get(key), self._stat(parents, key)
                self.looked_at += 1
                found[key] = new
                was_dir, is_dir = old is not None and old[0] in "dD", new is not None and new[0] in "dD"
                moved = was_dir and is_dir and old is not None and new is not None and old[4] != new[4]
                if was_dir and (not is_dir or moved):
                    for below in self._below(rel_of(key)):
                        found[below] = None
                if is_dir and (not was_dir or moved) and listed(rel_of(key)):
                    walked = self._walk(rel_of(key))
                    self.looked_at += len(walked)
                    found.update(walked)
                for entry in (old, new):
                    if entry is not None and entry[0] not in "dDw":
                        queue.extend(self._names.get(entry[4], ()))
                        if (other := self._inode.get(entry[4])) is not None:
                            queue.append(other)
        finally:
            parents.close()
        return found

    def _stat(self, parents: DirsBeneath, key: Key) -> Entry | None:
        """The entry ``key`` as :func:`.workspace.scan` would record it now; None if it would not."""
        if not listed(key[0]) or len(os.fsencode(key[0])) + len(os.fsencode(key[1])) >= MAX_PATH:
            return None
        try:
            parent = parents.open(key[0])
            entry = entry_of(os.stat(key[1], dir_fd=parent, follow_symlinks=False), upper=True)
            if entry[0] != "d" or not listed(rel_of(key)):
                return entry
            fd = open_beneath(parent, key[1], _DIR_FLAGS)
        except OSError:
            parents.close()
            return None  # gone, no longer below a directory, a mount point (the walk leaves it out too)
        try:
            return ("D", *entry[1:]) if opaque(fd) else entry
        finally:
            os.close(fd)

    def _walk(self, rel: str) -> Manifest:
        """Every entry below the directory ``rel`` as it is now."""
        try:
            fd = _open_dir_beneath(self.fd, rel.split("/"), create=False, uid=0, gid=0)
        except OSError:
            return {}
        try:
            return scan(fd, upper=True, prefix=rel)
        finally:
            os.close(fd)

    def _below(self, rel: str) -> Iterator[Key]:
        """The keys of the kept manifest below the directory ``rel``."""
        stack = [rel]
        while stack:
            prefix = stack.pop()
            for name in self._children.get(prefix, ()):
                key = (prefix, name)
                yield key
                if self.manifest[key][0] in "dD":
                    stack.append(rel_of(key))

    # -- keeping it ------------------------------------------------------------------
    def commit(self, found: dict[Key, Entry | None]) -> None:
        """Record ``found`` (as written back: a deferred key holds its previous entry, or None)."""
        for key, entry in found.items():
            self._drop(key)
            if entry is not None:
                self._set(key, entry)

    def _set(self, key: Key, entry: Entry) -> None:
        self.manifest[key] = entry
        self._children.setdefault(key[0], set()).add(key[1])
        if entry[0] in "dDw":
            return
        ino = entry[4]
        first = self._inode.setdefault(ino, key)
        if first != key:
            self._names.setdefault(ino, {first}).add(key)

    def _drop(self, key: Key) -> None:
        entry = self.manifest.pop(key, None)
        if entry is None:
            return
        names = self._children.get(key[0])
        if names is not None:
            names.discard(key[1])
            if not names:
                del self._children[key[0]]
        if entry[0] in "dDw":
            return
        ino = entry[4]
        others = self._names.get(ino)
        if others is not None:
            others.discard(key)
            if self._inode.get(ino) == key:
                self._inode[ino] = next(iter(others))  # it had two names at least
            if len(others) <= 1:
                del self._names[ino]
        elif self._inode.get(ino) == key:
            del self._inode[ino]

