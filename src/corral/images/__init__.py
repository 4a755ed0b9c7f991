"""Image lookup: a name becomes the read-only lower layers of a sandbox's root.

An :class:`ImageLayout` lists ``(path inside the sandbox, host directory)``
pairs.  Each is the lower layer of an overlay whose upper layer is on the
sandbox's own size-limited tmpfs, so sandboxes share the image and never
write it.

Built-in: ``host`` — a read-only view of the host's ``/usr`` (with the usual
``/bin``, ``/lib``, ``/lib64``, ``/sbin`` links) under a synthetic root with a
minimal ``/etc``.  Built images (recipes) plug in through
:func:`register_resolver`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidSpec
from ..host.openat2 import read_in_tree

#: the uid/gid of the sandbox user inside every sandbox (its host uid is its range's base + this)
from ..host.uids import SANDBOX_UID as SANDBOX_UID

SANDBOX_USER = "user"
SANDBOX_HOME = "/home/user"


@dataclass(frozen=True)
class ImageLayout:
    name: str
    #: (mount point inside the sandbox, read-only host directory), "/" first
    layers: tuple[tuple[str, Path], ...]
    digest: str = ""
    #: True when the image brings its own /etc (identity files are added on top)
    own_etc: bool = False
    #: which copy of the image this is: a rebuild under the same digest (a Debian update) or
    #: another image store holding the digest has other bytes, and a cache of its files (the
    #: microVM tier's disk) must not be taken for this one
    identity: str = ""


def image_mark(digest: str) -> str:
    """The name by which a sandbox's mounts say they use the image ``digest`` (the image store's
    ``in_use`` looks for it in ``/proc/self/mountinfo``)."""
    return "image-" + (digest.partition(":")[2] or digest or "unknown")


Resolver = Callable[[str, Path], "ImageLayout | None"]
_resolvers: list[Resolver] = []


def register_resolver(resolver: Resolver) -> None:
    """Let a later layer (built images) answer for names the built-ins do not know."""
    if resolver not in _resolvers:
        _resolvers.append(resolver)


def resolve(name: str, state_dir: Path) -> ImageLayout:
    if name == "host":
        return host_image(state_dir)
    for resolver in _resolvers:
        layout = resolver(name, state_dir)
        if layout is not None:
            return layout
    from . import store  # built images (imported here: store imports this module)

    layout = store.resolve(name, state_dir)
    if layout is not None:
        return layout
    from .recipe import builtin_names

    hint = f"; build it with `corral image build {name}`" if name in builtin_names() else ""
    raise InvalidSpec(f"image {name!r} is not built{hint} (built-in: host; see `corral image ls`)")


def identity_files(hostname: str = "sandbox") -> dict[str, str]:
    """The synthetic identity of every sandbox, relative to its root."""
    return {
        "etc/passwd": (
            "root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"{SANDBOX_USER}:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox user:{SANDBOX_HOME}:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        ),
        "etc/group": f"root:x:0:\n{SANDBOX_USER}:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
        "etc/hosts": f"127.0.0.1 localhost\n::1 localhost\n127.0.1.1 {hostname}\n",
        "etc/hostname": f"{hostname}\n",
        "etc/resolv.conf": "# no network by default; the egress layer rewrites this when allowed\n",
        "etc/nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n",
    }


#: the identity files an image may bring, which every sandbox's own are merged with
IMAGE_ID_FILES = ("etc/passwd", "etc/group", "etc/shadow")
#: the most of each that is read (Debian's are a few kB)
ID_FILE_LIMIT = 4 << 20


def image_id_files(rootfs: Path) -> dict[str, str | None]:
    """An image's :data:`IMAGE_ID_FILES` (None: it has none), read on the host as root from a tree
    a build's commands wrote, so never by name (:func:`corral.host.openat2.read_in_tree`): by name,
    ``/etc/shadow -> ../../../../etc/shadow`` there was the host's own, copied into every sandbox
    of the image, and a fifo hung every create.  :class:`corral.host.openat2.UnsafeFile` names a
    link, a file that is not regular, or one past :data:`ID_FILE_LIMIT`."""
    found: dict[str, str | None] = {}
    for rel in IMAGE_ID_FILES:
        try:
            found[rel] = read_in_tree(rootfs, rel, ID_FILE_LIMIT).decode("utf-8", "surrogateescape")
        except FileNotFoundError:
            found[rel] = None
    return found


_HOST_SKELETON_VERSION = "5"
#: every skeleton entry gets this mtime: skeletons built in different state dirs are then
#: identical, so the microVM tier's disk of the host image (keyed by content) is shared
_SKELETON_MTIME = 1_700_000_000


_skeleton_lock = threading.Lock()


def host_image(state_dir: Path) -> ImageLayout:
    skeleton = state_dir / "images" / f"host-skeleton-v{_HOST_SKELETON_VERSION}"
    if not skeleton.is_dir():
        # a burst of first creates would otherwise all build it at once (other processes still may:
        # the build renames into place atomically and a loser discards its copy)
        with _skeleton_lock:
            if not skeleton.is_dir():
                _build_host_skeleton(skeleton)
    layers: list[tuple[str, Path]] = [("/", skeleton), ("/usr", Path("/usr"))]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host_path = Path("/") / top
        if host_path.is_dir() and not host_path.is_symlink():
            layers.append((f"/{top}", host_path))  # a host without merged /usr
    return ImageLayout("host", tuple(layers))


def _build_host_skeleton(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(target.parent, 0o711)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".host-skeleton-"))
    try:
        for d in ("usr", "etc/ssl/certs", "etc/alternatives", "proc", "dev", "home", "root", "run",
                  "var/tmp", "var/lib", "workspace", "mnt", "opt", "srv"):
            (tmp / d).mkdir(parents=True, exist_ok=True)
        for d in ("tmp", "var/tmp"):
            (tmp / d).mkdir(parents=True, exist_ok=True)
            os.chmod(tmp / d, 0o1777)
        # the sandbox's own /root is empty and readable, so a look shows the host's is not there
        # (a 0700 directory would answer "Permission denied" whether or not it held anything)
        os.chmod(tmp / "root", 0o755)
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host_path = Path("/") / top
            if host_path.is_symlink():
                os.symlink(os.readlink(host_path), tmp / top)
            elif host_path.is_dir():
                (tmp / top).mkdir()
        for rel, content in identity_files().items():
            (tmp / rel).write_text(content)
        ca = Path("/etc/ssl/certs/ca-certificates.crt")
        if ca.is_file():
            shutil.copyfile(ca, tmp / "etc/ssl/certs/ca-certificates.crt")
        # /etc/alternatives is only symlinks naming programs: no secrets, and
        # without it awk, editor, pager & co. do not resolve
        alternatives = Path("/etc/alternatives")
        if alternatives.is_dir():
            for entry in alternatives.iterdir():
                if entry.is_symlink():
                    os.symlink(os.readlink(entry), tmp / "etc/alternatives" / entry.name)
        for name in ("ld.so.cache", "ld.so.conf", "localtime", "mime.types"):
            src = Path("/etc") / name
            if src.is_file():
                shutil.copyfile(src, tmp / "etc" / name)
        os.chmod(tmp, 0o755)
        for dirpath, dirnames, filenames in os.walk(tmp, topdown=False):
            for name in (*dirnames, *filenames):
                os.utime(os.path.join(dirpath, name), (_SKELETON_MTIME, _SKELETON_MTIME), follow_symlinks=False)
        os.utime(tmp, (_SKELETON_MTIME, _SKELETON_MTIME))
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if target.is_dir():
            return  # a concurrent builder won
        raise
