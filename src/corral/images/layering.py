"""Derived images (``from = "NAME"``) without copying the parent.

The build works on an overlay whose lower layer is the parent image (never
written: overlayfs does not write lower layers) and whose upper layer is in the
staging directory, mounted with ``metacopy=on`` so that handing the image to the
build uid (a chown of every file) copies metadata only.  At the end the merged
tree is *materialized* as a standalone root: every regular file whose data and
metadata are still the parent's becomes a hard link to the parent's inode
(both images are read-only forever, so sharing is safe), files the build wrote
are taken from the upper layer, and files whose metadata changed are copied.
A derived image therefore costs the disk space of what its build changed.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from ..host import mounts

_METACOPY = "trusted.overlay.metacopy"
_REDIRECT = "trusted.overlay.redirect"
_OPAQUE = "trusted.overlay.opaque"


def mount_derived(lower: Path, upper: Path, work: Path, merged: Path) -> None:
    """Mount the build overlay; OSError if this kernel lacks metacopy (the caller then copies)."""
    for path in (upper, work, merged):
        path.mkdir()
    for p in (lower, upper, work):
        if any(c in str(p) for c in ",:\\"):
            raise OSError(f"overlay path {p} contains a character overlayfs cannot take")
    options = f"lowerdir={lower},upperdir={upper},workdir={work},metacopy=on,redirect_dir=on,index=off"
    mounts.mount("overlay", merged, "overlay", mounts.MS_NOSUID | mounts.MS_NODEV, options)


def _xattr(path: str, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None


def materialize(merged: Path, upper: Path, lower: Path, target: Path) -> None:
    """Write the merged view to ``target`` (same filesystem as ``lower`` and ``upper``)."""
    taken_from_upper: list[str] = []
    # lower_dirs maps a merged directory (relative) to where its lower content lives, or None
    lower_dirs: dict[str, str | None] = {"": str(lower)}
    for dirpath, dirnames, filenames in os.walk(merged):
        rel_dir = os.path.relpath(dirpath, merged)
        rel_dir = "" if rel_dir == "." else rel_dir
        lower_dir = lower_dirs.get(rel_dir)
        out_dir = os.path.join(target, rel_dir)
        if not rel_dir:
            os.mkdir(out_dir)
            _copy_meta(dirpath, out_dir)
        for name in dirnames:
            src = os.path.join(dirpath, name)
            out = os.path.join(out_dir, name)
            if os.path.islink(src):
                _symlink(src, out)
                continue
            os.mkdir(out)
            _copy_meta(src, out)
            up = os.path.join(upper, rel_dir, name)
            redirect = _xattr(up, _REDIRECT)
            if _xattr(up, _OPAQUE) == b"y":
                child_lower = None
            elif redirect is not None:
                text = redirect.decode()
                child_lower = os.path.join(str(lower), text.lstrip("/")) if text.startswith("/") else (
                    os.path.join(lower_dir, text) if lower_dir else None)
            else:
                child_lower = os.path.join(lower_dir, name) if lower_dir else None
            lower_dirs[os.path.join(rel_dir, name) if rel_dir else name] = child_lower
        for name in filenames:
            src = os.path.join(dirpath, name)
            out = os.path.join(out_dir, name)
            st = os.lstat(src)
            if stat.S_ISLNK(st.st_mode):
                _symlink(src, out)
            elif stat.S_ISREG(st.st_mode):
                if _take_file(src, st, os.path.join(upper, rel_dir, name), str(lower), lower_dir, name, out):
                    taken_from_upper.append(out)
            elif stat.S_ISFIFO(st.st_mode):
                os.mkfifo(out, stat.S_IMODE(st.st_mode))
                os.lchown(out, st.st_uid, st.st_gid)
            # sockets and device nodes are not image content
    mounts.umount(merged)
    for path in taken_from_upper:  # overlay bookkeeping must not reach an image used as a lower layer
        for attr in os.listxattr(path, follow_symlinks=False):
            if attr.startswith("trusted.overlay."):
                os.removexattr(path, attr, follow_symlinks=False)


def _take_file(src: str, st: os.stat_result, up: str, lower_root: str, lower_dir: str | None, name: str,
               out: str) -> bool:
    """Link or copy one regular file; True when it was linked from the upper layer."""
    up_st = _lstat(up)
    if up_st is not None and stat.S_ISREG(up_st.st_mode) and _xattr(up, _METACOPY) is None:
        os.link(up, out)  # the build wrote its data: the upper inode is the file
        return True
    lower_path = None
    redirect = _xattr(up, _REDIRECT) if up_st is not None else None
    if redirect is not None:  # a renamed file: absolute from the layer's root, or relative to its directory
        text = redirect.decode()
        lower_path = os.path.join(lower_root, text.lstrip("/")) if text.startswith("/") else (
            os.path.join(lower_dir, text) if lower_dir else None)
    elif lower_dir is not None:
        lower_path = os.path.join(lower_dir, name)
    lower_st = _lstat(lower_path) if lower_path else None
    if lower_st is not None and lower_path is not None and (lower_st.st_mode, lower_st.st_uid, lower_st.st_gid) == (
            st.st_mode, st.st_uid, st.st_gid) and lower_st.st_size == st.st_size:
        os.link(lower_path, out)  # unchanged: share the parent's inode
        return False
    shutil.copyfile(src, out)  # metadata changed: a file of its own
    os.chown(out, st.st_uid, st.st_gid)
    os.chmod(out, stat.S_IMODE(st.st_mode))
    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
    return False


def _lstat(path: str | None) -> os.stat_result | None:
    if path is None:
        return None
    try:
        return os.lstat(path)
    except OSError:
        return None


def _symlink(src: str, out: str) -> None:
    st = os.lstat(src)
    os.symlink(os.readlink(src), out)
    os.lchown(out, st.st_uid, st.st_gid)


def _copy_meta(src: str, out: str) -> None:
    st = os.lstat(src)
    os.lchown(out, st.st_uid, st.st_gid)
    os.chmod(out, stat.S_IMODE(st.st_mode))
