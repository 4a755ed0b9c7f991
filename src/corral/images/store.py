"""The image store: built root filesystems, addressed by their recipe digest.

Layout (``$CORRAL_IMAGE_DIR``, default ``/var/lib/corral/images/built``, 0711 root)::

    <hex>/rootfs/        the image: root-owned, never written after the build
    <hex>/image.json     digest, size, creation time, recipe, package count
    <hex>/logs/          the logs of every build step
    names/<name>.json    name -> digest (written atomically; a rebuild moves it)
    .build-<hex12>-*/    a build in progress (renamed into place only when complete)
    .locks/<hex>.lock    flock held while a digest is being built or removed
    apt-cache/           .deb files kept between builds (never inside an image)
    failed/              logs of failed build steps

The store lives outside the per-run state directory so repeated test runs and
restarts reuse images; it is shared by every sandbox and never written by one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidSpec, ResourceLimit
from ..host import mounts
from . import ImageLayout, image_mark

DEFAULT_IMAGE_DIR = Path("/var/lib/corral/images/built")
FAILED_LOG_DAYS = 7


def image_dir() -> Path:
    path = Path(os.environ.get("CORRAL_IMAGE_DIR") or DEFAULT_IMAGE_DIR)
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o711)
    return path


def is_an_image_dir(path: Path) -> bool:
    """Whether ``path`` has an image store's layout (this instance's or any other's)."""
    if not (path / "names").is_dir():
        return False
    if any((path / name).is_dir() for name in (".locks", "apt-cache", "failed")):
        return True
    try:
        with os.scandir(path) as entries:
            return any(len(entry.name) == 64 and os.path.lexists(os.path.join(entry.path, "image.json"))
                       for entry in entries)
    except OSError:
        return False


def hex_of(digest: str) -> str:
    return digest.removeprefix("sha256:")


@dataclass(frozen=True)
class ImageRecord:
    digest: str
    path: Path
    names: tuple[str, ...]
    size: int
    created: float
    recipe: str
    packages: int

    @property
    def rootfs(self) -> Path:
        return self.path / "rootfs"


def _names_dir(root: Path) -> Path:
    path = root / "names"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _read_json(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json_atomic(path: Path, data: dict[str, object]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def digest_lock(root: Path, digest: str, blocking: bool = True) -> Iterator[bool]:
    """Hold the lock of one digest (builds and removals of it are serialized)."""
    locks = root / ".locks"
    locks.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(locks / f"{hex_of(digest)}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def name_target(root: Path, name: str) -> str | None:
    data = _read_json(_names_dir(root) / f"{name}.json")
    digest = data.get("digest") if data else None
    return digest if isinstance(digest, str) else None


def set_name(root: Path, name: str, digest: str) -> None:
    write_json_atomic(_names_dir(root) / f"{name}.json", {"digest": digest, "tagged": time.time()})


def read_meta(path: Path) -> dict[str, object]:
    """The image.json of the image at ``path`` ({} if unreadable)."""
    return _read_json(path / "image.json") or {}


def _root_only(path: Path) -> None:
    """An image built before images were 0700 (a set-id file a build step wrote could be run by
    any host user from its 0711 directory) is made so when it is next looked up."""
    try:
        if os.stat(path).st_mode & 0o077 and os.geteuid() == 0:
            os.chmod(path, 0o700)
    except OSError:
        pass


def record(root: Path, digest: str) -> ImageRecord | None:
    path = root / hex_of(digest)
    meta = _read_json(path / "image.json")
    if meta is None or not (path / "rootfs").is_dir():
        return None
    _root_only(path)
    names = tuple(sorted(n for n, d in all_names(root).items() if d == digest))
    return ImageRecord(
        digest=digest, path=path, names=names, size=int(meta.get("size", 0)),  # type: ignore[call-overload]
        created=float(meta.get("created", 0.0)), recipe=str(meta.get("recipe", "")),  # type: ignore[arg-type]
        packages=int(meta.get("packages", 0)),  # type: ignore[call-overload]
    )


def all_names(root: Path) -> dict[str, str]:
    out = {}
    for entry in _names_dir(root).glob("*.json"):
        digest = name_target(root, entry.stem)
        if digest:
            out[entry.stem] = digest
    return out


def lookup(ref: str, root: Path | None = None) -> ImageRecord | None:
    """A built image by name, full digest (``sha256:...``) or unique digest prefix (12+ hex)."""
    root = root or image_dir()
    digest = name_target(root, ref) if not ref.startswith("sha256:") else ref
    if digest is None and len(ref) >= 12 and all(c in "0123456789abcdef" for c in ref):
        matches = [p.name for p in root.iterdir() if p.name.startswith(ref) and len(p.name) == 64]
        digest = "sha256:" + matches[0] if len(matches) == 1 else None
    return record(root, digest) if digest else None


def resolve(name: str, state_dir: Path) -> ImageLayout | None:
    """The hook :func:`corral.images.resolve` calls for names that are not built in."""
    found = lookup(name)
    if found is None:
        return None
    # own_etc: the sandbox identity (passwd, hosts, ...) is written on top of the image's /etc
    return ImageLayout(name, (("/", found.rootfs),), digest=found.digest, own_etc=True, identity=identity_of(found))


def identity_of(rec: ImageRecord) -> str:
    """This build of the image in this store: its rootfs's path, device, inode and change time and
    its creation time (a rebuild of the same digest, or a copy in another store, differs in them)."""
    st = os.stat(rec.rootfs)
    return f"{rec.rootfs}\0{st.st_dev}\0{st.st_ino}\0{st.st_ctime_ns}\0{rec.created!r}"


def list_images(root: Path | None = None) -> list[ImageRecord]:
    root = root or image_dir()
    out = []
    for path in root.iterdir():
        if len(path.name) == 64 and path.is_dir():
            rec = record(root, "sha256:" + path.name)
            if rec is not None:
                out.append(rec)
    return sorted(out, key=lambda r: (r.names or ("~",), -r.created))


def in_use(rec: ImageRecord) -> bool:
    """True while some sandbox's overlay has this image as its lower layer."""
    # a plain overlay names the image's directory; one on an idmapped view of it names the
    # view, whose name carries the digest (tiers/linux/rootfs.py)
    # (tiers/linux/rootfs.py), in whichever mount namespace it was made: the host's, or the
    # sandbox's own (the process tier's, host/mountns.py)
    needles = (f"lowerdir={rec.rootfs}", f"/lower/{image_mark(rec.digest)}-L")
    return any(needle in line for line in mounts.mountinfo_everywhere() for needle in needles)


def remove(ref: str, root: Path | None = None) -> ImageRecord:
    """Forget a name; delete its image when no other name points at it and no sandbox uses it."""
    root = root or image_dir()
    rec = lookup(ref, root)
    if rec is None:
        raise InvalidSpec(f"no built image {ref!r}; see `corral image ls`")
    dropped = [ref] if ref in rec.names else list(rec.names)  # by digest: every name goes
    deleting = not [n for n in rec.names if n not in dropped]
    if deleting and in_use(rec):
        raise ResourceLimit(f"image {ref!r} is in use by a running sandbox; kill it first")
    for name in dropped:
        (_names_dir(root) / f"{name}.json").unlink(missing_ok=True)
    if deleting:
        delete_image(root, rec)
    return rec


def delete_image(root: Path, rec: ImageRecord, *, locked: bool = False) -> bool:
    """Delete an image unless it is being built; ``locked``: the caller holds its digest's lock
    (flock is per open file: taking it again from the same process conflicts with itself, so
    ``build --force`` deleted nothing and its rename onto the old image failed)."""
    if locked:
        _delete_now(root, rec)
        return True
    with digest_lock(root, rec.digest, blocking=False) as got:
        if not got:
            return False  # being rebuilt right now
        _delete_now(root, rec)
    return True


def _delete_now(root: Path, rec: ImageRecord) -> None:
    if in_use(rec):
        raise ResourceLimit(f"image {rec.digest[:19]} is in use by a running sandbox; kill it first")
    trash = root / f".trash-{hex_of(rec.digest)[:12]}-{os.getpid()}"
    os.rename(rec.path, trash)  # atomic: the image disappears whole
    remove_tree(trash)


def remove_tree(path: Path) -> None:
    """rmtree that first unmounts anything below ``path`` (never descends into a mount)."""
    mounts.unmount_all(path)
    if mounts.mounts_under(path):
        raise ResourceLimit(f"cannot remove {path}: something is still mounted below it")
    shutil.rmtree(path, ignore_errors=True)


def prune(root: Path | None = None) -> tuple[list[ImageRecord], int]:
    """Delete images no name points at (and not in use), leftovers of interrupted builds and week-old
    logs of failed steps.

    Returns the deleted images and the number of leftover directories removed.
    """
    root = root or image_dir()
    named = set(all_names(root).values())
    deleted = []
    for rec in list_images(root):
        if rec.digest not in named and not in_use(rec) and delete_image(root, rec):
            deleted.append(rec)
    failed = root / "failed"
    if failed.is_dir():  # logs of failed steps are kept for a week
        for log in failed.iterdir():
            if time.time() - log.stat().st_mtime > FAILED_LOG_DAYS * 86400:
                log.unlink()
    return deleted, remove_leftovers(root)


def leftovers(root: Path, digest: str | None = None, min_age: float = 0.0) -> list[Path]:
    """Staging and trash directories whose build is not running any more (of ``digest`` only,
    if given; at least ``min_age`` seconds old: a build of another digest may have made its
    directory and not yet locked it)."""
    found = []
    now = time.time()
    for path in root.iterdir():
        if not path.name.startswith((".build-", ".trash-")):
            continue
        prefix = path.name.split("-")[1]
        if digest is not None and not hex_of(digest).startswith(prefix):
            continue
        try:
            if now - path.stat().st_mtime < min_age:
                continue
        except FileNotFoundError:
            continue
        owner = path / "owner.lock"
        if owner.exists():
            try:
                fd = os.open(owner, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # renamed into place or removed meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live build holds it
            finally:
                os.close(fd)
        found.append(path)
    return found


#: how old another digest's build leftover must be before a build or ``corral gc`` removes it
STALE_BUILD_AGE = 60.0


def remove_leftovers(root: Path, digest: str | None = None, min_age: float = 0.0) -> int:
    """Remove what interrupted builds left: staging directories, their cgroups and uids."""
    from .buildbox import reap_leftover

    count = 0
    for path in leftovers(root, digest, min_age):
        reap_leftover(path)
        remove_tree(path)
        count += 1
    return count
