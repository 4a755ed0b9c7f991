"""A workspace copied into the sandbox (the wasm and microVM tiers', and the process and gVisor
tiers' where an overlay cannot be had): made by copying the host directory onto the sandbox's
disk, written back by comparing a walk of the copy with the previous one.  The walking and
copying rules -- descriptors opened with ``O_NOFOLLOW`` on both sides, data extents only, hard
links kept, the write-back's budget -- are :mod:`.workspace`'s."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidSpec, ResourceLimit
from .charged import run_here
from .git_reach import GitReach
from .workspace import (
    _DIR_FLAGS,
    Budget,
    DirsBeneath,
    Entry,
    Key,
    Links,
    Manifest,
    _copy_entry,
    copy_changed,
    rel_of,
    remove_gone,
    scan,
)
from .ws_git import HeldPaths


def open_host_dir(host: Path) -> int:
    """The workspace's host directory, opened once (``host`` is its resolved path, as the spec's
    checks saw it): every write-back goes through this descriptor, never the path again.  A host
    user who owns a directory on the path could otherwise swap it for a link between write-backs,
    and the next one, as root, wrote the sandbox's files where the link led (a root-only
    directory, ``/etc``), past the checks of the path made at create.  Refused if the path
    already leads elsewhere (a link put there since the checks)."""
    try:
        fd = os.open(host, _DIR_FLAGS)
    except (NotADirectoryError, FileNotFoundError) as exc:  # (a link there now: O_NOFOLLOW)
        raise InvalidSpec(f"workspace {host}: no longer the directory it was when checked ({exc.strerror}); "
                          "give the directory itself") from None
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if opened != str(host):
            raise InvalidSpec(f"workspace {host}: the path now leads to {opened} (a link put on it since it "
                              "was checked); give the directory itself")
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class WorkspaceCopy:
    """A workspace copied into a sandbox: ``host`` is the user's dir, ``copy`` the sandbox's."""

    host: Path
    copy: Path
    uid: int
    gid: int
    manifest: Manifest
    #: the host directory as opened at create (:func:`open_host_dir`): what write-back writes to
    host_fd: int
    #: commands finishing at once write back one at a time: two syncs at once raced for the same
    #: temporary names (``FileExistsError``, and a temporary file left in the user's directory)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _git: GitReach = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._git = GitReach(self.host)

    @classmethod
    def create(cls, host: Path, copy: Path, uid: int, gid: int, max_bytes: int, host_fd: int = -1,
               charge: Callable[[Callable[[], None]], None] | None = None) -> WorkspaceCopy:
        """Copy ``host`` in: read through the directory as opened at create (``host_fd``, given:
        the copy's from here, closed also if it fails; else :func:`open_host_dir`), as write-back
        writes to it: never by the path again, which a swap could lead elsewhere.  ``charge``, if
        given, runs the copying where its pages are charged to the sandbox (``host/charged.py``)."""
        if host_fd < 0:
            host_fd = open_host_dir(host)
        try:
            source = scan(host_fd)
            total = sum(e[1] for e in source.values() if e[0] == "f")
            if total > max_bytes:
                raise ResourceLimit(
                    f"workspace {host} holds {total} bytes, more than the sandbox's disk limit of {max_bytes}; "
                    "raise --disk or use a smaller workspace"
                )
            copy.mkdir(mode=0o755, exist_ok=True)
            os.chown(copy, uid, gid)
            def copy_in() -> None:
                _apply(host_fd, copy, source, {}, uid, gid, inside_links_only=False)

            (charge or run_here)(copy_in)
            return cls(host, copy, uid, gid, scan(copy), host_fd)
        except BaseException:
            os.close(host_fd)
            raise

    def sync_back(self) -> None:
        """Write what changed in the copy since the last sync to the host directory."""
        with self._lock:
            if self.host_fd < 0:
                return
            host_st = os.fstat(self.host_fd)
            current = scan(self.copy)
            _apply(self.copy, self.host_fd, current, self.manifest, host_st.st_uid, host_st.st_gid,
                   inside_links_only=True, configured=self._git.held())
            self.manifest = current

    def close(self, write_back: bool = True) -> None:
        """At destroy: the last write-back (with ``write_back``), then the host directory's descriptor."""
        try:
            if write_back:
                self.sync_back()
        finally:
            with self._lock:
                if self.host_fd >= 0:
                    os.close(self.host_fd)
                    self.host_fd = -1


def _apply(
    src: Path | int, dst: Path | int, current: Manifest, previous: Manifest, uid: int, gid: int,
    inside_links_only: bool, configured: HeldPaths | None = None,
) -> None:
    """Copy ``current``'s changes since ``previous`` from ``src`` to ``dst`` (each a path, or a
    directory's descriptor, which is duplicated, not taken)."""
    src_fd = os.dup(src) if isinstance(src, int) else os.open(src, _DIR_FLAGS)
    dst_fd = os.dup(dst) if isinstance(dst, int) else os.open(dst, _DIR_FLAGS)
    # copying in, what is read is judged as opened by the host directory's owner's view of it
    shown_to = None if inside_links_only else os.fstat(src_fd)
    sources, targets = DirsBeneath(src_fd, False, uid, gid, shown_to), DirsBeneath(dst_fd, True, uid, gid)
    links: Links = {}
    budget = Budget(src_fd) if inside_links_only else None  # writing back, not copying in
    try:
        remove_gone(dst_fd, (k for k in previous if k not in current), uid, gid, writing_back=inside_links_only,
                    configured=configured)

        def copy(key: Key, entry: Entry, src_dir: int, dst_dir: int) -> None:
            _copy_entry(src_dir, dst_dir, dst_fd, rel_of(key), entry[0], entry[3], uid, gid, inside_links_only,
                        links, budget, shown_to=shown_to)

        copy_changed(current, previous, sources, targets, ("o",), copy, writing_back=inside_links_only,
                     configured=configured)
    finally:
        sources.close()
        targets.close()
        os.close(src_fd)
        os.close(dst_fd)
