"""Filesystem snapshots of the process and gVisor tiers: a sandbox's writable layers, copied out
and back in.

A sandbox's root is an overlay: the image's read-only layers, one writable *upper* per layer on
the sandbox's disk tmpfs, and the workspace beside them, read whole through its mount point
(:mod:`.rootfs`).  A snapshot is what those hold: every file, directory, symlink and fifo the sandbox wrote, and overlayfs's own
marks -- *whiteouts* (a 0/0 character device: "this image file was deleted") and *opaque*
directories (``trusted.overlay.opaque``: "hide the image's entries below") -- so a file deleted
in the sandbox stays deleted in every sandbox made from the snapshot.

On disk (a directory the caller names; :mod:`corral.snapshots` owns where)::

    manifest.json   one entry per path: layer key (L0, L1, ..., ws), relative path, type,
                    mode, *inside-the-sandbox* uid/gid, xattrs, size and sha256 of the content
    blobs/SHA256    each distinct content once, root-only

Ownership is stored with the ids the sandbox itself sees, translated by :class:`IdMap` (the one
place that knows how host ids and inside ids relate), so a snapshot does not depend on which host
uid its sandbox happened to get.  Restoring writes every file with the new sandbox's host ids and
checks each content's sha256 while copying: a corrupted snapshot raises :class:`SnapshotCorrupt`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import InvalidState, ResourceLimit, SnapshotCorrupt
from ...host.mounts import tmpfs_inodes
from ...host.workspace import CHANGED_MEANWHILE
from ...images import SANDBOX_UID

#: overlay xattrs that name the inode of one mount (copy-up origin, hard-link counts): not carried
_NOT_CARRIED = ("trusted.overlay.origin", "trusted.overlay.impure", "trusted.overlay.nlink",
                "trusted.overlay.uuid")
#: an id the sandbox cannot see (the kernel's overflow id)
OVERFLOW_ID = 65534
CHUNK = 1 << 20
MANIFEST = "manifest.json"
FORMAT = 1


@dataclass(frozen=True)
class IdMap:
    """How one sandbox's host ids and the ids its processes see correspond.

    ``inside_id`` is used when a snapshot is taken, ``host_id`` when one is restored; an id with
    no counterpart becomes the overflow id (``nobody``).  Built by :func:`id_map`."""

    to_inside: dict[int, int]
    to_host: dict[int, int]
    #: the sandbox's whole range of host ids (base, size), mapped to 0 .. size - 1 inside
    id_range: tuple[int, int] | None = None

    def inside_id(self, host_id: int) -> int:
        if self.id_range is not None and self.id_range[0] <= host_id < sum(self.id_range):
            return host_id - self.id_range[0]
        return self.to_inside.get(host_id, OVERFLOW_ID)

    def host_id(self, inside_id: int) -> int:
        if self.id_range is not None and 0 <= inside_id < self.id_range[1]:
            return self.id_range[0] + inside_id
        return self.to_host.get(inside_id, OVERFLOW_ID)


def id_map(uid: int, root_uid: int | None = None, id_range: tuple[int, int] | None = None) -> IdMap:
    """THE translation between a sandbox's host ids and its inside ids, from what its tier knows.

    A sandbox with a range of host ids (``id_range``: base, size) sees host id ``base + N`` as
    ``N``; host root (files the image or Corral's setup made) is stored as 0.  Without a range:
    the sandbox user (uid and gid 1000 inside) is the sandbox's host ``uid``, and gVisor's sandbox
    root (``root_uid`` on the host) is 0 inside."""
    to_inside = {uid: SANDBOX_UID, 0: 0}
    if root_uid is not None:
        to_inside[root_uid] = 0
    return IdMap(to_inside, {SANDBOX_UID: uid, 0: 0}, id_range)


#: a file capability (``security.capability``) of revision 3 names the host uid of the user
#: namespace's root it is valid for (``struct vfs_ns_cap_data``: its last 4 bytes)
_CAPABILITY = "security.capability"
_CAP_REVISION_3 = 0x03000000
_CAP_REVISION_MASK = 0xFF000000
_CAP_V3_SIZE = 24


def _cap_rootid(value: bytes, translate: Callable[[int], int]) -> bytes:
    """A capability with its namespace root translated: copied raw, one taken at host id N read
    back as "Value too large" in a sandbox whose root is another host id (its root could not use
    it either)."""
    if len(value) != _CAP_V3_SIZE or int.from_bytes(value[:4], "little") & _CAP_REVISION_MASK != _CAP_REVISION_3:
        return value
    return value[:-4] + translate(int.from_bytes(value[-4:], "little")).to_bytes(4, "little")


#: POSIX ACLs (``struct posix_acl_xattr_header`` then entries of tag, permissions, id) name users
#: and groups by id: read by the host, the sandbox's ids are host ids
_ACLS = ("system.posix_acl_access", "system.posix_acl_default")
_ACL_VERSION = 2
_ACL_ENTRY = struct.Struct("<HHI")
#: the tags whose entry names an id (ACL_USER, ACL_GROUP); the others carry an undefined one
_ACL_NAMED = (0x02, 0x08)


def _acl_ids(value: bytes, translate: Callable[[int], int]) -> bytes:
    """An ACL with the ids of its named users and groups translated: copied raw, ``user:1234``
    was stored as the parent's host uid 1979647186 and read back in the new sandbox as 4294967295
    (an id it does not map), the entry lost."""
    if len(value) < 4 or (len(value) - 4) % _ACL_ENTRY.size \
            or int.from_bytes(value[:4], "little") != _ACL_VERSION:
        return value
    out = bytearray(value)
    for offset in range(4, len(value), _ACL_ENTRY.size):
        tag, perm, id_ = _ACL_ENTRY.unpack_from(value, offset)
        if tag in _ACL_NAMED:
            _ACL_ENTRY.pack_into(out, offset, tag, perm, translate(id_))
    return bytes(out)


def _ids_translated(name: str, value: bytes, translate: Callable[[int], int]) -> bytes:
    """An xattr's value with the ids it names translated (file capabilities, POSIX ACLs)."""
    if name == _CAPABILITY:
        return _cap_rootid(value, translate)
    if name in _ACLS:
        return _acl_ids(value, translate)
    return value


def _xattrs(path: Path, ids: IdMap) -> dict[str, str]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.startswith(_NOT_CARRIED):
            continue
        try:
            value = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue
        out[name] = _ids_translated(name, value, ids.inside_id).hex()
    return out


#: a snapshot refuses directories nested deeper than this (its walk holds a descriptor per level)
MAX_DEPTH = 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


#: what reading an entry meets if it was changed after the walk saw it: as the workspace's walk
#: (gone; a link now a directory or the other way round), and EINVAL from readlink
_CHANGED = (*CHANGED_MEANWHILE, errno.EINVAL)


@contextlib.contextmanager
def _changed_meanwhile(rel: str) -> Iterator[None]:
    """Raise :class:`SnapshotCorrupt` for an entry found changed under the walk (never followed)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _CHANGED:
            raise
        raise SnapshotCorrupt(f"{_short(rel)} changed while the snapshot was taken") from exc


@contextlib.contextmanager
def _readable(key: str, rel: str) -> Iterator[None]:
    """Name the file a snapshot cannot read (an untyped "Permission denied" named nothing)."""
    try:
        yield
    except PermissionError as exc:
        where = f"/workspace/{rel}" if key == "ws" else f"{key}:{_short(rel)}"
        raise InvalidState(f"snapshot: {where} cannot be read through the sandbox's view of it (a file of a host "
                           "user the sandbox does not map, such as root's with mode 0600, which the sandbox "
                           "cannot read either): a snapshot carries only what it can read; remove the file or "
                           "let the workspace's owner read it") from exc


def _walk(top: Path) -> Iterator[tuple[str, os.stat_result, Path]]:
    """(relative path, lstat, where) of ``top`` and everything below it, parents first, in name
    order.  ``where`` names the entry through its directory's open descriptor
    (``/proc/self/fd/N/NAME``), so no link is followed on the way to it, even one put in a
    directory's place after that directory was listed: the sandbox is frozen while a snapshot is
    taken, and the walk does not depend on it (a thawed sandbox swapping a directory for a link to
    a host directory had its snapshot carry the host's files)."""
    top_fd = os.open(top, _DIR_FLAGS)
    stack: list[tuple[int, str, Iterator[str]]] = [(top_fd, "", iter(sorted(os.listdir(top_fd))))]
    try:
        yield ".", os.fstat(top_fd), Path(f"/proc/self/fd/{top_fd}")
        while stack:
            dir_fd, prefix, names = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                os.close(dir_fd)
                continue
            rel = f"{prefix}/{name}" if prefix else name
            with _changed_meanwhile(rel):
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            yield rel, st, Path(f"/proc/self/fd/{dir_fd}/{name}")
            if not stat.S_ISDIR(st.st_mode):
                continue
            if len(stack) >= MAX_DEPTH:
                raise ResourceLimit(f"snapshot: directories nested more than {MAX_DEPTH} deep, such as "
                                    f"{_short(rel)}, are not carried")
            with _changed_meanwhile(rel):
                fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            stack.append((fd, rel, iter(sorted(os.listdir(fd)))))
            if os.fstat(fd).st_ino != st.st_ino:
                raise SnapshotCorrupt(f"{_short(rel)} changed while the snapshot was taken")
    finally:
        for dir_fd, _, _ in stack:
            os.close(dir_fd)


def _store_blob(path: Path, blobs: Path, shared: Path | None) -> tuple[str, int, int]:
    """Put ``path``'s content in ``blobs`` under its sha256: a hard link to the same content in
    ``shared`` (other snapshots') when there is one, else a copy (then shared).  Returns the
    digest, the size and the bytes written."""
    # never follows a link, never blocks on a fifo put in the file's place
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as src:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SnapshotCorrupt(f"{path.name} changed while the snapshot was taken")
        digest = hashlib.file_digest(src, "sha256").hexdigest()
        size = src.tell()
        final = blobs / digest
        if final.exists():
            return digest, size, 0
        if shared is not None and _holds(shared / digest, digest):
            with contextlib.suppress(OSError):  # gone meanwhile, or too many links: copy it
                os.link(shared / digest, final)
                return digest, size, 0
        src.seek(0)
        temp = blobs / f".in-{secrets.token_hex(6)}"
        again = hashlib.sha256()
        with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as dst:
            while chunk := src.read(CHUNK):
                again.update(chunk)
                dst.write(chunk)
        if again.hexdigest() != digest:  # the sandbox is frozen: this is not a race of its making
            raise SnapshotCorrupt(f"{path.name} changed while the snapshot was taken")
    temp.rename(final)
    if shared is not None:
        with contextlib.suppress(FileNotFoundError):
            (shared / digest).unlink()  # a damaged one (see _holds): this copy replaces it
        with contextlib.suppress(FileExistsError):
            os.link(final, shared / digest)
    return digest, size, size


def _holds(blob: Path, digest: str) -> bool:
    """Whether a shared content is still what its name says (read back: a damaged one must not
    be linked into new snapshots)."""
    try:
        with open(blob, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest() == digest
    except OSError:
        return False


def prune_shared(shared: Path) -> int:
    """Remove shared contents no snapshot links to any more; returns how many went.  ``shared``
    holds contents, and directories of contents (one per tenant: corral.snapshots), pruned alike
    and kept (a snapshot being taken links into its tenant's at any moment)."""
    if not shared.is_dir():
        return 0
    gone = 0
    for blob in shared.iterdir():
        with contextlib.suppress(FileNotFoundError):
            st = blob.lstat()
            if stat.S_ISDIR(st.st_mode):
                gone += prune_shared(blob)
            elif st.st_nlink <= 1:
                blob.unlink()
                gone += 1
    return gone


def capture(layers: list[tuple[str, Path]], dest: Path, ids: IdMap, exclude: dict[str, set[str]],
            max_bytes: int, shared: Path | None = None) -> int:
    """Copy every entry of each ``(key, directory)`` into ``dest`` (made here, must not exist);
    ``exclude[key]`` lists relative paths (and their subtrees) left out.  Contents already in
    ``shared`` (a directory of blobs on the same file system) are linked, not copied, and new
    ones are added to it.  Returns the bytes written.

    Files' sizes may add up to ``max_bytes`` (the sandbox's disk limit), checked before each is
    read: a sparse file claims more than the disk holds, and is refused (:class:`ResourceLimit`)
    rather than written out in full to the host.  The manifest is bounded too
    (:func:`manifest_budget`): entries are free on a tmpfs, and 100,000 empty files 120
    directories down made a 389 MB manifest and an owner of 1.2 GB."""
    dest.mkdir(mode=0o700)
    total = written = 0
    blobs = dest / "blobs"
    blobs.mkdir(mode=0o700)
    # each entry encoded as it is made: the manifest is held once, as the text it will be
    encoded: list[str] = []
    budget = manifest_budget(max_bytes)
    for key, top in layers:
        skipped = exclude.get(key, set())
        #: a file's first name in this layer, by inode: its other names are links to it (counted
        #: once against the disk, written once at a restore; they were copies, each counted)
        first_names: dict[tuple[int, int], str] = {}
        for rel, st, path in _walk(top):
            if rel in skipped or any(rel.startswith(s + "/") for s in skipped):
                continue
            mode = st.st_mode
            entry: dict[str, Any] = {"k": key, "p": rel, "m": stat.S_IMODE(mode), "u": ids.inside_id(st.st_uid),
                                     "g": ids.inside_id(st.st_gid), "t": st.st_mtime_ns}
            if stat.S_ISDIR(mode):
                entry["y"] = "d"
            elif stat.S_ISREG(mode) and st.st_nlink > 1 and (st.st_dev, st.st_ino) in first_names:
                entry["y"] = "h"
                entry["l"] = first_names[(st.st_dev, st.st_ino)]
                encoded.append(json.dumps(entry, separators=(",", ":")))
                budget -= len(encoded[-1]) + 1
                continue
            elif stat.S_ISREG(mode):
                if st.st_nlink > 1:
                    first_names[(st.st_dev, st.st_ino)] = rel
                total += st.st_size
                if total > max_bytes:
                    raise ResourceLimit(f"snapshot: the files add up to more than the sandbox's disk limit of "
                                        f"{max_bytes} bytes (sparse files, such as {key}:{_short(rel)}, are not carried)")
                entry["y"] = "f"
                with _changed_meanwhile(rel), _readable(key, rel):
                    entry["h"], entry["s"], new = _store_blob(path, blobs, shared)
                written += new
            elif stat.S_ISLNK(mode):
                entry["y"] = "l"
                with _changed_meanwhile(rel):
                    entry["l"] = os.readlink(path)
            elif stat.S_ISCHR(mode) and st.st_rdev == 0:
                entry["y"] = "w"  # an overlay whiteout: the image's file at this path was deleted
            elif stat.S_ISFIFO(mode):
                entry["y"] = "p"
            else:
                continue  # sockets and devices are not files a snapshot can carry
            xattrs = _xattrs(path, ids)
            if xattrs:
                entry["x"] = xattrs
            encoded.append(json.dumps(entry, separators=(",", ":")))
            budget -= len(encoded[-1]) + 1
            if budget < 0:
                raise ResourceLimit(f"snapshot: the sandbox's files need more than {manifest_budget(max_bytes)} "
                                    f"bytes of description ({len(encoded)} entries so far, such as {key}:{_short(rel)})")
    data = f'{{"format":{FORMAT},"entries":[{",".join(encoded)}]}}'.encode()
    (dest / MANIFEST).write_bytes(data)
    return len(data) + written


def _named(directory: Path) -> str:
    """A snapshot's name in a message: its id, for its ``files`` directory (``snapshot files: ...``
    named none)."""
    return directory.parent.name if directory.name == "files" else directory.name


def _short(rel: str) -> str:
    """A path as an error message names it: its end, if it is long."""
    return rel if len(rel) <= 120 else "..." + rel[-117:]


def manifest_budget(max_bytes: int) -> int:
    """The most a snapshot's manifest may hold for a sandbox whose disk limit is ``max_bytes``:
    64 MiB, or a sixteenth of the disk if more -- a tmpfs holds ``max_bytes // 4096`` entries
    (:func:`corral.host.mounts.tmpfs_args`), ~180 bytes each with an ordinary path."""
    return max(64 << 20, max_bytes // 16)


def manifest_digest(directory: Path) -> str:
    try:
        return hashlib.sha256((directory / MANIFEST).read_bytes()).hexdigest()
    except OSError as exc:
        raise SnapshotCorrupt(f"snapshot {_named(directory)}: manifest unreadable ({exc.strerror})") from None


def load_manifest(directory: Path, digest: str) -> list[dict[str, Any]]:
    """The manifest's entries, if its sha256 is ``digest`` (else :class:`SnapshotCorrupt`)."""
    try:
        data = (directory / MANIFEST).read_bytes()
    except OSError as exc:
        raise SnapshotCorrupt(f"snapshot {_named(directory)}: manifest unreadable ({exc.strerror})") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise SnapshotCorrupt(f"snapshot {_named(directory)}: its manifest does not match its checksum")
    try:
        body = json.loads(data)
        entries = body["entries"]
        assert body["format"] == FORMAT and isinstance(entries, list)
    except (ValueError, KeyError, AssertionError, TypeError):
        raise SnapshotCorrupt(f"snapshot {_named(directory)}: its manifest is not one Corral wrote") from None
    for entry in entries:
        if not _well_formed(entry):
            raise SnapshotCorrupt(f"snapshot {_named(directory)}: its manifest holds an entry Corral never "
                                  f"writes ({str(entry)[:120]})")
    return entries


_BLOB_NAME = re.compile(r"[0-9a-f]{64}")
_ENTRY_KINDS = frozenset("dhflwp")


def _is_int(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value < high


def _well_formed(entry: object) -> bool:
    """Whether a manifest entry has the fields and types :func:`capture` writes.  Its checksum
    (meta.json's) proves only that the manifest is the one meta.json names: one tampered with
    both gave KeyError, ValueError, OverflowError (a mode of 2**40) at restore, and a blob named
    ``../..`` was opened as a host path before its checksum was checked."""
    if not isinstance(entry, dict):
        return False
    kind = entry.get("y")
    if not (isinstance(entry.get("k"), str) and isinstance(entry.get("p"), str) and kind in _ENTRY_KINDS
            and all(_is_int(entry.get(field), 0, 1 << 32) for field in ("u", "g"))
            and _is_int(entry.get("m"), 0, 0o10000) and _is_int(entry.get("t"), -(1 << 63), 1 << 63)
            and _is_int(entry.get("s", 0), 0, 1 << 63)):
        return False
    if kind == "f" and not (isinstance(entry.get("h"), str) and _BLOB_NAME.fullmatch(entry["h"])):
        return False
    if kind in ("h", "l") and not isinstance(entry.get("l"), str):
        return False
    xattrs = entry.get("x", {})
    if not isinstance(xattrs, dict):
        return False
    for name, value in xattrs.items():
        if not (isinstance(name, str) and isinstance(value, str)):
            return False
        try:
            bytes.fromhex(value)
        except ValueError:
            return False
    return True


def keys(entries: list[dict[str, Any]]) -> set[str]:
    return {str(e["k"]) for e in entries}


def _safe(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and ".." not in parts and "" not in parts


def restore(directory: Path, entries: list[dict[str, Any]], key: str, top: Path, ids: IdMap) -> None:
    """Write the entries of layer ``key`` into ``top`` (a new sandbox's upper or workspace,
    not mounted yet) with the new sandbox's host ids.

    What ``top`` already holds that is not a directory wins: the new sandbox's own identity,
    network and mount-point files.  A content whose sha256 differs from the manifest's raises
    :class:`SnapshotCorrupt` (the caller destroys the half-made sandbox)."""
    blobs = directory / "blobs"
    skipped: list[str] = []
    links: list[str] = []
    files: set[str] = set()  # restored here: what a hard link ("h") may name
    dirs: list[tuple[Path, dict[str, Any]]] = []
    for entry in entries:
        if entry["k"] != key or entry["p"] == ".":
            continue
        rel = str(entry["p"])
        if not _safe(rel):
            raise SnapshotCorrupt(f"snapshot {_named(directory)}: bad path {rel!r} in its manifest")
        if any(rel.startswith(s + "/") for s in links):
            raise SnapshotCorrupt(f"snapshot {_named(directory)}: {rel!r} lies below a symlink")
        if any(rel.startswith(s + "/") for s in skipped):
            continue
        path = top / rel
        kind = entry["y"]
        if os.path.lexists(path) and not (kind == "d" and path.is_dir() and not path.is_symlink()):
            skipped.append(rel)
            continue
        uid, gid = ids.host_id(int(entry["u"])), ids.host_id(int(entry["g"]))
        if kind == "d":
            if not path.is_dir():
                path.mkdir(mode=0o700)
            dirs.append((path, entry))  # mode and times once its children are written
        elif kind == "h":
            if str(entry["l"]) not in files:
                raise SnapshotCorrupt(f"snapshot {_named(directory)}: {rel!r} links to {entry['l']!r}, "
                                      "no file restored before it")
            os.link(top / str(entry["l"]), path, follow_symlinks=False)
            continue  # the inode, its owner, mode and times are its first name's
        elif kind == "f":
            _copy_blob(blobs / str(entry["h"]), path, str(entry["h"]), _named(directory))
            files.add(rel)
        elif kind == "l":
            os.symlink(str(entry["l"]), path)
            links.append(rel)
        elif kind == "w":
            os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        elif kind == "p":
            os.mkfifo(path, 0o600)
        else:
            raise SnapshotCorrupt(f"snapshot {_named(directory)}: unknown entry type {kind!r}")
        os.chown(path, uid, gid, follow_symlinks=False)
        for name, value in entry.get("x", {}).items():
            os.setxattr(path, name, _ids_translated(name, bytes.fromhex(value), ids.host_id), follow_symlinks=False)
        if kind not in ("d", "l"):
            os.chmod(path, int(entry["m"]))  # after chown, which clears set-id bits
        if kind != "d":
            os.utime(path, ns=(int(entry["t"]), int(entry["t"])), follow_symlinks=False)
    for path, entry in reversed(dirs):
        os.chmod(path, int(entry["m"]))
        os.utime(path, ns=(int(entry["t"]), int(entry["t"])))


def _copy_blob(blob: Path, target: Path, digest: str, name: str) -> None:
    hasher = hashlib.sha256()
    try:
        src = open(blob, "rb")  # noqa: SIM115 - closed below, with the target
    except OSError as exc:
        raise SnapshotCorrupt(f"snapshot {name}: content {digest[:12]} is missing ({exc.strerror})") from None
    with src, open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as dst:
        while chunk := src.read(CHUNK):
            hasher.update(chunk)
            dst.write(chunk)
    if hasher.hexdigest() != digest:
        raise SnapshotCorrupt(f"snapshot {name}: content {digest[:12]} does not match its checksum")


def fresh_identity(upper: Path, hostname: str, root: int = 0) -> None:
    """A new machine id and hostname in a restored root's upper (``/etc`` made if need be),
    owned by ``root``: the host id of the sandbox's root."""
    etc = upper / "etc"
    if os.path.lexists(etc) and not stat.S_ISDIR(os.lstat(etc).st_mode):
        return  # the sandbox replaced /etc (a link, a file): nothing is written through it
    if not os.path.lexists(etc):
        etc.mkdir(mode=0o755)
        os.chown(etc, root, root)
    for name, content in (("machine-id", secrets.token_hex(16) + "\n"), ("hostname", hostname + "\n")):
        target = etc / name
        if os.path.lexists(target):
            if stat.S_ISDIR(os.lstat(target).st_mode):
                continue
            target.unlink()
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
        with os.fdopen(fd, "w") as f:
            f.write(content)
            os.fchown(f.fileno(), root, root)


def check_fits(entries: list[dict[str, Any]], disk: int, name: str) -> None:
    """Refuse a restore that cannot fit in the new sandbox's disk (before anything is made)."""
    from ...errors import InvalidSpec

    needed = sum(int(e.get("s", 0)) for e in entries)
    if needed > disk:
        raise InvalidSpec(f"disk: snapshot {name} holds {needed} bytes of files, more than the disk "
                          f"limit of {disk} bytes")
    # each entry but the layers' tops and a file's other names is an inode of the new disk (a
    # restore that ran out of them said "the host is out of capacity": the sandbox's disk was)
    names = sum(1 for e in entries if e["p"] != "." and e.get("y") != "h")
    if names > tmpfs_inodes(disk):
        raise InvalidSpec(f"disk: snapshot {name} holds {names} files and directories, more than a disk of "
                          f"{disk} bytes holds ({tmpfs_inodes(disk)}); make the sandbox's disk larger")


def filler(directory: Path, digest: str, ids: IdMap, hostname: str, disk: int) -> Callable[[str, Path], None]:
    """``build_root``'s ``fill`` for a sandbox made from the snapshot in ``directory``: its
    manifest is checked (and must fit in ``disk``) before anything is written."""
    entries = load_manifest(directory, digest)
    check_fits(entries, disk, _named(directory))

    def fill(key: str, top: Path) -> None:
        restore(directory, entries, key, top, ids)
        if key == "L0":
            fresh_identity(top, hostname, ids.host_id(0))

    return fill
