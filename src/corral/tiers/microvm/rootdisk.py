"""The image as a read-only disk: one EROFS file per image, shared by its VMs.

Why a disk and not 9p: QEMU refuses to migrate a VM while a 9p export is
mounted in it, so 9p image layers could only be mounted *after* every
restore — ~100 ms of fresh TCG translation (9p client, overlay, identity
files, the root switch) per sandbox.  A block device does not block
migration: the template mounts the image and its overlay, switches root and
is snapshotted with all of that done, and every restored VM inherits it.
The template is therefore per image (its key includes :attr:`ImageDisk.key`).

The image's layers (e.g. the host skeleton at ``/`` and the host's ``/usr``)
are merged into one tree by bind mounts in a private mount namespace and
written by ``mkfs.erofs`` (erofs-utils): a read-only filesystem made for
this, built from the host's 5.4 GB ``/usr`` in 30 s where ``mkfs.ext4 -d``
took 120 s (measured), and with a simpler read path for the guest to run.
Files keep their owners, modes, times and extended attributes.

A disk is built once under a lock into a temporary directory and renamed into
place, never written afterwards (a VM holds it open read-only; deleting an
unused one leaves running VMs their open file).  Its key:

- a built image (store): its content digest and which build of it this is
  (:attr:`ImageLayout.identity`: its store's path, the rootfs's inode and change
  time, its creation time).  Keyed by the digest alone, a disk outlived the
  image: after ``corral image rm`` and a rebuild of the same recipe (a Debian
  security update: same digest, new bytes) the other tiers ran the new image and
  the microVM the old one, and two stores holding one digest shared the first
  one's disk;
- otherwise (the ``host`` image) each layer's content: small trees (the
  skeleton) by every entry's metadata and bytes; large ones (the host's
  ``/usr``) by dpkg's database, the mtimes of their directories three levels
  deep and of Python's package directories — what apt, pip, ``npm -g`` and
  ``make install`` change.  A file edited in place is not noticed (delete
  ``disks/`` in the microVM cache to rebuild).  Computing that costs ~20 ms,
  so it is reused for :data:`KEY_TTL` seconds.

Each disk also carries a random build id in its key: a template's guest has
the disk's metadata in its page cache, so it must never meet a rebuilt disk
with the same content key but another layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ... import progress
from ...errors import HostNotSupported, SandboxError
from ...images import ImageLayout
from .guest import cache_dir, cache_lock, sweep_stale_builds

#: bump when the disk's format or build options change
DISK_VERSION = "1"
#: a tree with more entries is keyed by its directories' mtimes, not its contents
SMALL_TREE = 4000
DIR_DEPTH = 3
KEY_TTL = 10.0
#: a disk nobody used for this long is deleted when another is built
UNUSED_TTL = 3600.0
BUILD_TIMEOUT = 1800.0
#: merge the layers by bind mounts (private namespace: nothing outlives mkfs), then build
_MERGE_AND_BUILD = (
    'root=$1; shift; mount --bind "$1" "$root" || exit 1; shift; '
    'while [ "$1" != -- ]; do mount --bind "$2" "$root$1" || exit 1; shift 2; done; shift; exec "$@"'
)


@dataclass(frozen=True)
class ImageDisk:
    path: Path
    #: content key + build id: what a template built on this disk is keyed by
    key: str


_keys: dict[tuple[tuple[str, str], ...], tuple[float, str]] = {}
_keys_lock = threading.Lock()


def _small_tree_key(root: Path, h: hashlib._Hash) -> bool:
    """Hash every entry (metadata and bytes) of a tree; False if it has more than SMALL_TREE."""
    count, pending = 0, [str(root)]
    while pending:  # counted first, cheaply: a large tree is neither sorted nor read
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                count += 1
                if count > SMALL_TREE:
                    return False
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
    paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        paths += [os.path.join(dirpath, name) for name in sorted([".", *dirnames, *filenames])]
    for path in paths:
        st = os.lstat(path)
        h.update(f"{os.path.relpath(path, root)}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0{st.st_mtime_ns}"
                 f"\0{st.st_size}\0".encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(path).encode())
        elif stat.S_ISREG(st.st_mode):
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return True


def _dirs_key(root: Path, h: hashlib._Hash, depth: int) -> None:
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            h.update(f"{entry.path}\0{entry.stat(follow_symlinks=False).st_mtime_ns}\0".encode())
            if depth > 1:
                _dirs_key(Path(entry.path), h, depth - 1)


def _large_tree_key(root: Path, h: hashlib._Hash) -> None:
    for marker in (Path("/var/lib/dpkg/status"), root):
        try:
            st = marker.stat()
            h.update(f"{marker}\0{st.st_mtime_ns}\0{st.st_size}\0".encode())
        except OSError:
            pass
    _dirs_key(root, h, DIR_DEPTH)
    for packages in sorted([*root.glob("local/lib/python3*/dist-packages"), *root.glob("lib/python3*/dist-packages"),
                            *root.glob("local/lib/python3*/site-packages")]):
        h.update(f"{packages}\0{packages.stat().st_mtime_ns}\0".encode())


def content_key(layout: ImageLayout) -> str:
    """What the disk of this image depends on (see the module's docstring)."""
    ident = (*((point, str(host)) for point, host in layout.layers), ("identity", layout.identity))
    now = time.monotonic()
    with _keys_lock:
        cached = _keys.get(ident)
        if cached is not None and now - cached[0] < KEY_TTL:
            return cached[1]
    h = hashlib.sha256(f"{DISK_VERSION}\0{layout.digest}\0{layout.identity}\0".encode())
    for point, host in layout.layers:
        h.update(f"layer\0{point}\0".encode())
        if layout.digest:
            continue  # content-addressed: the digest says it all
        sub = hashlib.sha256()
        if not _small_tree_key(host, sub):
            sub = hashlib.sha256()
            _large_tree_key(host, sub)
        h.update(sub.digest())
    key = h.hexdigest()[:24]
    with _keys_lock:
        _keys[ident] = (now, key)
    return key


def image_disk(layout: ImageLayout) -> ImageDisk:
    """The disk of this image, building it the first time (minutes for the host image)."""
    root = cache_dir() / "disks"
    final = root / content_key(layout)
    meta = final / "meta.json"
    if not meta.is_file():
        with progress.step(f"building the microVM disk of image {layout.name!r}",
                           "first use, or the image's files changed; about a minute for the host image"), \
                cache_lock("disk"):
            if not meta.is_file():
                _build(final, layout)
    info = json.loads(meta.read_text())
    try:
        os.utime(meta)  # last use, for pruning
    except OSError:
        pass
    return ImageDisk(final / "root.erofs", f"{final.name}-{info['build_id']}")


def _build(final: Path, layout: ImageLayout) -> None:
    mkfs = shutil.which("mkfs.erofs")
    if mkfs is None:
        raise HostNotSupported("mkfs.erofs is missing: apt-get install erofs-utils (or `make install`)")
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    sweep_stale_builds(root)
    _prune(root, keep=final)
    work = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    try:
        image = work / "root.erofs"
        build = [mkfs, "--quiet", "--preserve-mtime", str(image)]
        (point0, top), *others = layout.layers
        if point0 != "/":
            raise SandboxError(f"image {layout.name!r}: its first layer is not the root")
        start = time.monotonic()
        if not others:
            argv = [*build, str(top)]
        else:
            merged = work / "merged"
            merged.mkdir()
            pairs = [item for point, host in others for item in (point, str(host))]
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _MERGE_AND_BUILD,
                    "corral-disk", str(merged), str(top), *pairs, "--", *build, str(merged)]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT, cwd="/")
        if result.returncode != 0:
            raise SandboxError(f"building the disk of image {layout.name!r} failed: "
                               f"{(result.stderr or result.stdout).strip()[-600:]}")
        if others:
            (work / "merged").rmdir()
        (work / "meta.json").write_text(json.dumps({
            "build_id": uuid.uuid4().hex[:12], "image": layout.name, "digest": layout.digest,
            "layers": [[point, str(host)] for point, host in layout.layers],
            "build_seconds": round(time.monotonic() - start, 1), "size": image.stat().st_size,
        }))
        os.chmod(image, 0o644)  # QEMU reads it as the sandbox's uid
        os.chmod(work / "meta.json", 0o644)
        os.chmod(work, 0o755)
        os.rename(work, final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _prune(root: Path, keep: Path) -> None:
    """Delete disks unused for UNUSED_TTL (a running VM keeps reading its open file)."""
    now = time.time()
    for directory in root.iterdir():
        if directory.name.startswith(".") or directory == keep:
            continue
        try:
            if now - (directory / "meta.json").stat().st_mtime > UNUSED_TTL:
                shutil.rmtree(directory, ignore_errors=True)
        except OSError:
            continue
