"""Snapshots of sandboxes: taken, stored, listed, removed, and reaped when their writer died.

A snapshot of a process or gVisor sandbox is its *filesystem*: what it changed of its image (the
overlay's writable layers, deletions included) and its workspace copy.  It holds no processes,
no memory, no network rules and no secrets: a sandbox made from it (``Sandbox.create(snapshot=)``,
``sb.fork(n)``) starts fresh processes with a fresh identity (sandbox id, hostname, machine id)
on the same tier and image.  A microVM's is *live* (kind "live": memory, devices, processes and
its workspace; :mod:`corral.tiers.microvm.live`), and is also how a sandbox pauses to disk
(:mod:`corral.parked`).  The wasm tier cannot take one (:class:`InvalidState`).

Stored under ``<state>/snapshots/`` (0700)::

    snap-<16 hex>/meta.json        id, kind, tier, image, created, size, owner tenant,
                                   the sha256 of files/manifest.json
    snap-<16 hex>/files/           manifest + content blobs (corral.tiers.linux.fs_snapshot)
    blobs/t-<tenant hash>/SHA256   every content of one tenant once: each snapshot's blobs are hard
                                   links to these (content-addressed: a fork or a second snapshot
                                   of a sandbox writes only what changed); one no snapshot links to
                                   is removed.  Per tenant, never across tenants: a store shared by
                                   all told a tenant, by what a snapshot wrote (and took), whether
                                   another tenant held a content -- an oracle for guessing its
                                   files (a token, a password in a config) one guess per snapshot
    .tmp-<id>-<pid>-<start>/       a snapshot being written: renamed into place when whole
    snap-<16 hex>/writing.lock     a live snapshot named while its memory image is written: its
                                   meta.json says "writing" while its writer holds this (flock)
    .del-<id>-<token>/             a snapshot being removed

A writer that dies leaves its ``.tmp-`` directory, or a snapshot still marked "writing" whose
lock nobody holds; :func:`reap_leftovers` (run by ``gc`` and at every library start) removes
those whose writer is gone.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import parked
from .errors import InvalidState, SnapshotCorrupt, SnapshotNotFound
from .host.mounts import tmpfs_inodes
from .host.procs import process_start_time
from .parked import load as load_parked
from .spec import SandboxSpec
from .tiers import tier_class
from .tiers.base import SNAPSHOT_IN_USE, PendingWrite, TierSandbox
from .tiers.linux.fs_snapshot import manifest_budget, manifest_digest, prune_shared

DIRECTORY = "snapshots"
#: the contents every snapshot links to
SHARED = "blobs"
_ID = re.compile(r"snap-[0-9a-f]{16}\Z")
#: held (flock, exclusive) by the process writing the snapshot it is in, until it is whole
WRITING = "writing.lock"
#: what a live snapshot holds beyond the sandbox's memory limit, at most: the guest's own share of
#: its RAM and the rounding up to a template's size (tiers/microvm/tier.py, ``ram_mb``: 96 + 63 MiB),
#: the memory image's slack (1 MiB) and the device state
LIVE_OVERHEAD = 256 << 20
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """One stored snapshot."""

    id: str
    #: what it holds: "filesystem" (files only: no processes, memory, network rules or secrets), or
    #: "live" (a microVM: memory, devices, processes and its workspace; docs/snapshots.md)
    kind: str
    #: bytes it takes of the host's disk: the blocks of its files and manifest (contents shared
    #: with other snapshots included), at least one each, and their inodes (:func:`_stored_size`)
    size: int
    created: float
    tier: str
    image: str
    #: the sandbox it was taken of
    sandbox_id: str = ""
    #: bytes taking it wrote (contents other snapshots already hold are shared, not written)
    written: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Snapshot:
        return cls(str(data["id"]), str(data["kind"]), int(data["size"]), float(data["created"]),
                   str(data["tier"]), str(data["image"]), str(data.get("sandbox_id", "")), int(data.get("written", 0)))


def fork_spec(parent: SandboxSpec) -> SandboxSpec:
    """What a fork of a sandbox with ``parent`` gets: its tier, image, limits, env, cwd and user --
    not its network rules, secrets or workspace (the files come from the snapshot)."""
    return SandboxSpec(tier=parent.tier, image=parent.image, limits=parent.limits, env=parent.env, cwd=parent.cwd,
                       user=parent.user)


def host_costs(store: Path) -> tuple[int, int]:
    """(block, inode) of the file system holding ``store``: the least a file takes of it, and what
    each inode is charged besides its blocks -- the bytes of that file system per inode it has
    (statvfs; 16 KiB on ext4's default), at least a block.  Inodes are a disk's other capacity:
    charged so, a tenant's share of them is never more than its share of the bytes (20,000 files
    of 8 bytes were counted as 3.4 MB, their 160 KB and a manifest, and took 89.5 MB of blocks
    and 20,000 inodes; file systems with inodes made on demand report none: a block each)."""
    while not store.exists() and store != store.parent:  # (none taken yet: where it will be)
        store = store.parent
    fs = os.statvfs(store)
    block = fs.f_frsize or fs.f_bsize
    per_inode = fs.f_blocks * block // fs.f_files if fs.f_files else 0
    return block, max(block, per_inode)


def bytes_at_most(spec: SandboxSpec, store: Path) -> int:
    """The most a snapshot of a sandbox with ``spec`` may hold in the store at ``store``
    (``Snapshot.size``): its files' sizes are bounded by its ``disk``, their number by its disk's
    inodes (``tmpfs_inodes``), each charged a block and an inode beyond its content
    (:func:`host_costs`), and its manifest by ``manifest_budget``
    (:func:`corral.tiers.linux.fs_snapshot.capture` refuses past either); a live one adds its
    memory image and device state.  What a server reserves of a tenant's quota for one in flight."""
    block, per_inode = host_costs(store)
    disk = spec.limits.disk
    most = disk + manifest_budget(disk) + tmpfs_inodes(disk) * (block + per_inode)
    if tier_class(spec.tier).capabilities.snapshot == "live":
        most += spec.limits.memory + LIVE_OVERHEAD
    return most


def new_snapshot_id() -> str:
    return "snap-" + secrets.token_hex(8)


class SnapshotStore:
    """The snapshots of one state directory.  ``tenant`` (a server's API key name) scopes every
    call to the snapshots that tenant took; None (this process's own SDK) sees every one."""

    def __init__(self, root: Path) -> None:
        self.dir = root / DIRECTORY

    def _ensure(self) -> Path:
        self.dir.mkdir(mode=0o700, exist_ok=True)
        return self.dir

    def take(self, inner: TierSandbox, spec: SandboxSpec, tenant: str | None = None,
             parked_by: str | None = None, check: Callable[[int], None] | None = None) -> Snapshot:
        """Snapshot a live sandbox (paused while its files are copied, then running again).
        ``parked_by``: the state of that sandbox paused to disk (:mod:`corral.parked`): not listed,
        not usable or removable as a snapshot, but counted in its tenant's bytes.  A microVM's
        snapshot is returned once the VM runs on, its memory image still being written in the
        background (:meth:`_finish`): ``size`` and ``written`` are then upper bounds.  ``check``
        is given the size of a snapshot written whole before it is put in the store, and raises to
        refuse it (a server's quota: a refused one is never listed nor counted)."""
        kind = tier_class(spec.tier).capabilities.snapshot
        if not kind:
            raise InvalidState(f"sandbox {inner.id}: the {spec.tier} tier cannot take snapshots"
                               + _why_not(spec.tier), sandbox_id=inner.id)
        snapshot_id = new_snapshot_id()
        pid = os.getpid()
        temp = self._ensure() / f".tmp-{snapshot_id}-{pid}-{process_start_time(pid) or 0}"
        temp.mkdir(mode=0o700)
        rest: PendingWrite | None = None
        lock = -1
        try:
            shared = self._shared(tenant)
            shared.mkdir(mode=0o700, parents=True, exist_ok=True)
            if parked_by is None:
                written, rest = inner.snapshot_begin(temp / "files", shared)
            else:  # a sandbox's state paused to disk: whole before its record is written
                written = inner.snapshot(temp / "files", shared)
            size = _stored_size(temp)
            meta: dict[str, Any] = {"tenant": tenant, "parked_by": parked_by}
            if rest is not None:  # named, but being written: readers wait on its lock (_whole)
                lock = os.open(temp / WRITING, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                fcntl.flock(lock, fcntl.LOCK_EX)
                size, written = size + rest.bytes_at_most, written + rest.bytes_at_most
                meta.update(digest="", writing=True)
            else:
                if check is not None:
                    check(size)
                meta["digest"] = manifest_digest(temp / "files")
            snapshot = Snapshot(snapshot_id, kind, size, time.time(), spec.tier, spec.image, inner.id, written)
            (temp / "meta.json").write_text(json.dumps({**snapshot.to_dict(), **meta}))
            temp.rename(self.dir / snapshot_id)  # whole (or marked as being written), or not there at all
        except BaseException:
            if rest is not None:
                rest.abandon()
            if lock >= 0:
                os.close(lock)
            shutil.rmtree(temp, ignore_errors=True)
            prune_shared(self.dir / SHARED)
            raise
        if rest is not None:
            threading.Thread(target=self._finish, args=(snapshot, rest, lock), daemon=False,
                             name=f"corral-snapshot-{snapshot_id}").start()
        return snapshot

    def _shared(self, tenant: str | None) -> Path:
        """The contents ``tenant``'s snapshots share (None, the embedded SDK's, has its own too).
        A hash names it: a tenant's name is any text, and the directory must not say who it is."""
        key = hashlib.sha256(b"\0" if tenant is None else b"t:" + tenant.encode()).hexdigest()[:32]
        return self.dir / SHARED / f"t-{key}"

    def _finish(self, snapshot: Snapshot, rest: PendingWrite, lock: int) -> None:
        """Write the rest of a snapshot named while being written, then its final description
        (atomically: the ``writing`` mark goes with it) and let its readers in; a failure removes
        it (a reader then finds no snapshot)."""
        directory = self.dir / snapshot.id
        try:
            try:
                written = snapshot.written - rest.bytes_at_most + rest.finish(directory / "files")
            finally:
                rest.abandon()
            meta = json.loads((directory / "meta.json").read_text())
            meta.update(size=_stored_size(directory), written=written, digest=manifest_digest(directory / "files"))
            del meta["writing"]
            (directory / "meta.new").write_text(json.dumps(meta))
            (directory / "meta.new").rename(directory / "meta.json")
        except Exception:
            log.exception("writing snapshot %s failed: it is removed", snapshot.id)
            self._remove(snapshot.id)
        finally:
            os.close(lock)

    def _meta(self, snapshot_id: str, tenant: str | None, parked: bool = False,
              retired: bool = False) -> dict[str, Any]:
        if not isinstance(snapshot_id, str) or not _ID.match(snapshot_id):
            raise SnapshotNotFound(f"no snapshot {snapshot_id!r}")
        path = self.dir / snapshot_id / "meta.json"
        if not path.parent.is_dir():
            raise SnapshotNotFound(f"no snapshot {snapshot_id}")
        try:
            meta = json.loads(path.read_text())
            Snapshot.from_dict(meta)
            str(meta["digest"])
        except FileNotFoundError:  # removed meanwhile
            raise SnapshotNotFound(f"no snapshot {snapshot_id}") from None
        except (OSError, ValueError, KeyError, TypeError):
            raise SnapshotCorrupt(f"snapshot {snapshot_id}: its description is unreadable") from None
        if (tenant is not None and meta.get("tenant") != tenant) or bool(meta.get("parked_by")) != parked \
                or (meta.get("retired") and not retired):
            raise SnapshotNotFound(f"no snapshot {snapshot_id}")
        return dict(meta)

    def _whole(self, snapshot_id: str, tenant: str | None, parked: bool = False) -> dict[str, Any]:
        """Its description once it is whole: waits for a writer still at it; one whose writer died
        before it was whole is :class:`SnapshotCorrupt` (``gc`` removes it)."""
        meta = self._meta(snapshot_id, tenant, parked)
        if meta.get("writing"):
            _writer_alive(self.dir / snapshot_id, wait=True)  # returns once it finished, failed or died
            meta = self._meta(snapshot_id, tenant, parked)
            if meta.get("writing"):
                raise SnapshotCorrupt(f"snapshot {snapshot_id}: its writer died before it was whole")
        return meta

    def get(self, snapshot_id: str, tenant: str | None = None, parked: bool = False,
            retired: bool = False) -> Snapshot:
        """``retired``: one deleted while VMs made from it still map its memory image too."""
        return Snapshot.from_dict(self._meta(snapshot_id, tenant, parked, retired))

    def whole(self, snapshot_id: str, tenant: str | None = None) -> Snapshot:
        """The snapshot once it is whole (one returned while its memory image is still being
        written: its real size and bytes written)."""
        return Snapshot.from_dict(self._whole(snapshot_id, tenant))

    def files(self, snapshot_id: str, tenant: str | None = None, parked: bool = False) -> tuple[Snapshot, Path, str]:
        """The snapshot, its files directory and its manifest's recorded sha256 (for a create;
        ``parked``: the state of a sandbox paused to disk, for its resume)."""
        meta = self._whole(snapshot_id, tenant, parked)
        return Snapshot.from_dict(meta), self.dir / snapshot_id / "files", str(meta["digest"])

    def list(self, tenant: str | None = None, parked: bool = False, retired: bool = False) -> list[Snapshot]:
        if not self.dir.is_dir():
            return []
        found = []
        for entry in sorted(self.dir.iterdir()):
            if not _ID.match(entry.name):
                continue
            try:
                found.append(self.get(entry.name, tenant, parked, retired))
            except (SnapshotNotFound, SnapshotCorrupt):
                continue
        return sorted(found, key=lambda s: s.created)

    def held_by(self, tenant: str | None) -> tuple[Snapshot, ...]:
        """What counts as the tenant's snapshots: its own, the states of its sandboxes paused to
        disk, and those deleted (or resumed) whose memory image VMs still map (a server's quota
        counts them and sums their sizes)."""
        return (*self.list(tenant, retired=True), *self.list(tenant, parked=True, retired=True))

    def delete(self, snapshot_id: str, tenant: str | None = None, parked: bool = False) -> bool:
        """Remove a snapshot; False if there is none (of this tenant).  A corrupted one goes too."""
        try:
            self._whole(snapshot_id, tenant, parked)  # (one being written: once it is whole)
        except SnapshotNotFound:
            return False
        except SnapshotCorrupt:
            if tenant is not None:
                return False  # whose it is cannot be told: only the operator's own SDK removes it
        return self._remove(snapshot_id)

    def _remove(self, snapshot_id: str) -> bool:
        """Remove it, unless VMs made from it map its memory image: then it is *retired* (no
        longer listed or usable, still counted, its files kept) until ``gc`` finds it unused.
        Renamed first: a VM made from it from then on cannot mark it used."""
        where = self.dir / snapshot_id
        gone = self.dir / f".del-{snapshot_id}-{secrets.token_hex(4)}"
        try:
            where.rename(gone)
        except FileNotFoundError:
            return False
        if _in_use(gone):
            meta = json.loads((gone / "meta.json").read_text())
            (gone / "meta.new").write_text(json.dumps({**meta, "retired": True}))
            (gone / "meta.new").rename(gone / "meta.json")
            gone.rename(where)
            return True
        shutil.rmtree(gone, ignore_errors=True)
        prune_shared(self.dir / SHARED)
        return True


#: written after a snapshot's size is known (charged as one block and inode), or while it is written
_NOT_MEASURED = frozenset({"meta.json", "meta.new", WRITING, SNAPSHOT_IN_USE})


def _stored_size(snapshot: Path) -> int:
    """What a snapshot takes of the host's disk: each inode in its directory once (its manifest,
    its blobs -- contents shared with its tenant's other snapshots included -- its directories, a
    live one's VM memory and state) as the blocks allocated to it, at least one, and its inode
    (:func:`host_costs`).  Sizes alone (``st_size``) counted 20,000 files of 8 bytes as 3.4 MB
    where they took 89.5 MB of blocks and 20,000 inodes.  A live snapshot's image disk is the
    image cache's, linked to, not counted."""
    block, per_inode = host_costs(snapshot)
    size = 2 * (block + per_inode)  # the directory itself and its meta.json
    seen: set[int] = set()
    below = [snapshot]
    while below:
        with os.scandir(below.pop()) as entries:
            for entry in entries:
                if entry.name in _NOT_MEASURED or entry.path == str(snapshot / "vm" / "disk"):
                    continue
                st = entry.stat(follow_symlinks=False)
                if st.st_ino in seen:
                    continue
                seen.add(st.st_ino)
                size += max(st.st_blocks * 512, block) + per_inode
                if entry.is_dir(follow_symlinks=False):
                    below.append(Path(entry.path))
    return size


def _in_use(directory: Path) -> bool:
    """Whether VMs made from the live snapshot in ``directory`` still run (each holds a name of
    its in-use mark in its run directory)."""
    try:
        return (directory / "vm" / SNAPSHOT_IN_USE).stat().st_nlink > 1
    except FileNotFoundError:
        return False


def _why_not(tier: str) -> str:
    if tier == "wasm":
        return ": its files live in the interpreter's memory file system, not in layers Corral can copy"
    return ""


#: a sandbox's state paused to disk is written before its record (corral.parked): older than this
#: with no record, its writer died in between
PARKED_GRACE = 120.0


def _orphaned_state(entry: Path, root: Path) -> bool:
    """A sandbox's state paused to disk whose record never came (its writer died in between)."""
    try:
        owner = json.loads((entry / "meta.json").read_text()).get("parked_by")
        old = time.time() - (entry / "meta.json").stat().st_mtime > PARKED_GRACE
    except (OSError, ValueError, AttributeError):
        return False
    if not owner or not old:
        return False
    record = load_parked(root, str(owner))
    return record is None or record.snapshot_id != entry.name


def _writer_alive(directory: Path, wait: bool) -> bool:
    """Whether a process still holds the writing lock of the snapshot in ``directory`` (``wait``:
    until it lets go, then False).  The lock goes with its holder, however that ends."""
    try:
        fd = os.open(directory / WRITING, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | (0 if wait else fcntl.LOCK_NB))
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _marked(entry: Path, mark: str) -> bool:
    """Whether a snapshot's description says ``mark`` (``writing``, ``retired``)."""
    try:
        return bool(json.loads((entry / "meta.json").read_text()).get(mark))
    except (OSError, ValueError, AttributeError):
        return False


def _abandoned(entry: Path) -> bool:
    """A snapshot named while being written whose writer is gone (it died before it was whole;
    looked at again after the lock: the writer may have finished just now)."""
    return _marked(entry, "writing") and not _writer_alive(entry, wait=False) and _marked(entry, "writing")


def reap_leftovers(root: Path) -> list[str]:
    """Remove half-written snapshots whose writer is gone, interrupted removals, the saved
    states of sandboxes paused to disk that no record names, and deleted snapshots no VM uses
    any more."""
    directory = root / DIRECTORY
    if not directory.is_dir():
        return []
    reaped = []
    for entry in directory.iterdir():
        name = entry.name
        if _ID.match(name):
            if _in_use(entry) or not (_orphaned_state(entry, root) or _abandoned(entry) or _marked(entry, "retired")):
                continue  # (a VM maps its memory image: kept, and counted, until it is gone)
        elif name.startswith(".tmp-"):
            parts = name.split("-")
            try:
                pid, start = int(parts[-2]), int(parts[-1])
            except (ValueError, IndexError):
                continue
            if process_start_time(pid) == start:
                continue  # its writer still works on it
        elif not name.startswith(".del-") or _in_use(entry):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        reaped.append(name)
    if reaped:
        prune_shared(directory / SHARED)
    return reaped


def end_parked(root: Path, sandbox_id: str) -> bool:
    """End a sandbox paused to disk: its saved state and its record go (not while another process
    resumes it: False then, as when there is no record)."""
    try:
        with parked.claimed(root, sandbox_id) as record:
            if record is None:
                return False
            SnapshotStore(root).delete(record.snapshot_id, parked=True)
            parked.remove(root, sandbox_id)
            return True
    except BlockingIOError:
        return False


def reap_expired_parked(root: Path, now: float, grace: float) -> list[str]:
    """End every sandbox paused to disk whose lifetime ended more than ``grace`` seconds ago
    (its owner, gone or stopped, did not); returns their ids."""
    return [record.sandbox_id for record in parked.every(root)
            if parked.over(record, now, grace) and end_parked(root, record.sandbox_id)]
