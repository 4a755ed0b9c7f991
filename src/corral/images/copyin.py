"""What an image build copies into an image's tree from the host (npm's packages, a recipe's files),
written as host root into a tree an earlier build's commands made: never by path.

Every directory is opened from a descriptor of the image's root (:func:`open_dir_in_tree`), a link
on the way resolving inside the image as its own commands would see it; every file or link lands
under a fresh name in that directory and is renamed over the old entry, so a link already at a
file's name is replaced, never written through.  By path, a parent image's ``/usr/local/lib ->
/tmp/x`` put a derived build's npm packages (owned by root) in the host's ``/tmp/x``, and a
``/srv/app/conf -> /etc/...`` link made a directory copy create that host file.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from pathlib import Path

from ..host.openat2 import open_dir_in_tree

_SET_ID = stat.S_ISUID | stat.S_ISGID


class CopyIn:
    """Writes into one image's tree through a descriptor of its root; owns that descriptor."""

    def __init__(self, rootfs: Path) -> None:
        self._root_fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def close(self) -> None:
        os.close(self._root_fd)

    def __enter__(self) -> CopyIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def directory(self, dest: str, mode: int | None = None) -> int:
        """A descriptor of the image's directory ``dest`` (made if missing, root's); the caller closes it."""
        fd = open_dir_in_tree(self._root_fd, dest, links_in_root=True, create=True)
        try:
            if mode is not None:
                os.fchown(fd, 0, 0)
                os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def file(self, src: Path, dest: str, mode: int) -> None:
        """The regular file ``src`` at ``dest`` in the image, root's, with ``mode``."""
        parent, name = _split(dest)
        dir_fd = self.directory(parent)
        try:
            _place_file(dir_fd, name, src, mode)
        finally:
            os.close(dir_fd)

    def tree(self, src: Path, dest: str) -> None:
        """The directory ``src`` copied onto ``dest`` in the image (merged with what is there, as
        ``cp -a``): its files, directories and links (copied as links), all root's; set-id bits are
        not copied."""
        for dirpath, dirnames, filenames in os.walk(src):
            rel = os.path.relpath(dirpath, src)
            here = dest if rel == "." else f"{dest.rstrip('/')}/{rel}"
            dir_fd = self.directory(here, stat.S_IMODE(os.lstat(dirpath).st_mode) & ~_SET_ID)
            try:
                for name in list(dirnames):
                    if os.path.islink(os.path.join(dirpath, name)):
                        dirnames.remove(name)  # copied as a link, not descended into
                        filenames.append(name)
                for name in filenames:
                    path = os.path.join(dirpath, name)
                    st = os.lstat(path)
                    if stat.S_ISLNK(st.st_mode):
                        _place_link(dir_fd, name, os.readlink(path))
                    elif stat.S_ISREG(st.st_mode):
                        _place_file(dir_fd, name, Path(path), stat.S_IMODE(st.st_mode) & ~_SET_ID)
                    else:
                        raise OSError(f"{path} is not a file, a directory or a link")
            finally:
                os.close(dir_fd)


def _split(dest: str) -> tuple[str, str]:
    parent, _, name = dest.strip("/").rpartition("/")
    return parent, name


def _fresh_name() -> str:
    return f".corral-copy-{secrets.token_hex(8)}"


def _place_file(dir_fd: int, name: str, src: Path, mode: int) -> None:
    tmp = _fresh_name()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            with open(src, "rb") as source, os.fdopen(os.dup(fd), "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
            st = os.stat(src)
            os.fchown(fd, 0, 0)
            os.fchmod(fd, mode)  # after the chown, which would clear a set-id bit the mode asks for
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(fd)
        _rename_over(dir_fd, tmp, name)
    except BaseException:
        _discard(dir_fd, tmp)
        raise


def _place_link(dir_fd: int, name: str, target: str) -> None:
    tmp = _fresh_name()
    os.symlink(target, tmp, dir_fd=dir_fd)
    try:
        os.chown(tmp, 0, 0, dir_fd=dir_fd, follow_symlinks=False)
        _rename_over(dir_fd, tmp, name)
    except BaseException:
        _discard(dir_fd, tmp)
        raise


def _rename_over(dir_fd: int, tmp: str, name: str) -> None:
    """A file or link already at ``name`` is replaced, never followed; a directory there is not
    (IsADirectoryError)."""
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _discard(dir_fd: int, tmp: str) -> None:
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
