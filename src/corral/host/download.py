"""Where a sandbox's files land on the host when they are downloaded (``files.download_dir``,
``corral cp SANDBOX:PATH HOSTPATH``): below one host directory, never through a link, never more
than a budget, and never a git directory's configuration.

The tree's names and contents are the sandbox's, and the host directory may hold links someone
else planted (a directory another user can write).  ``Path.write_bytes`` and ``mkdir(parents=True)``
followed them: a sandbox's ``cfg/authorized_keys`` went wherever a host link ``cfg`` pointed, as
root; and each name of a sparse file was fetched and written whole (a sandbox with a 16 MiB disk
wrote 513 MB to the host in 1.6 s with one 32 MiB sparse file and 15 links to it).  So, as
write-back does (:mod:`.workspace`): directories are opened a component at a time with
``O_NOFOLLOW`` (a link or file in the way is replaced by a directory), each file is written to a
new temporary name and renamed over its own (a link or a hard link there is replaced, never written
through), what is written is counted against a budget (the sandbox's disk limit: more cannot be a
copy of what it holds), and what write-back keeps from the host's git (:mod:`.ws_git`) is not written.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Container
from pathlib import Path

from ..errors import InvalidSpec, ResourceLimit
from ..spec import format_size
from .workspace import DirsBeneath, Key, rel_of
from .ws_git import host_keeps, makes_a_git_directory

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class DownloadTarget:
    """The host directory ``root`` (made if missing; the caller's own path, followed as given), and
    what may be written below it: ``names`` is every (directory, name) of the tree being
    downloaded, for the git check; ``max_bytes`` the most its files may hold in all."""

    def __init__(self, root: Path, names: Container[Key], max_bytes: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self._root = os.open(root, _DIR_FLAGS)
        self._dirs = DirsBeneath(self._root, True, os.geteuid(), os.getegid())
        self._names = names
        self.left = max_bytes
        self._max = max_bytes

    def __enter__(self) -> DownloadTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self._dirs.close()
        os.close(self._root)

    def keeps(self, key: Key, kind: str) -> bool:
        """True for what is not written: what write-back leaves as the host has it."""
        return host_keeps(rel_of(key), kind) or makes_a_git_directory(self._names, self._root, key, kind)

    def make_dir(self, key: Key) -> None:
        self._dirs.open(rel_of(key))

    def check(self, key: Key, size: int) -> None:
        """Refuse (``ResourceLimit``) a file of ``size`` bytes past what is left of the budget."""
        if size > self.left:
            raise ResourceLimit(f"download: {rel_of(key)} and what came before it are past {format_size(self._max)}, "
                                "the sandbox's disk limit (sparse files or many names of one file?): copy such "
                                "files with files.read one by one")

    def write(self, key: Key, data: bytes) -> None:
        """The file ``key`` with ``data``, new or replacing what is there (not a directory)."""
        self.check(key, len(data))
        self.left -= len(data)
        write_beside(self._dirs.open(key[0]), key[1], data)


def write_beside(dir_fd: int, name: str, data: bytes) -> None:
    """``name`` in ``dir_fd`` made ``data``: written under a new temporary name and renamed over
    ``name`` (a link or hard link there is replaced, not written through); a directory there is refused."""
    tmp = f".corral-download-{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(exc, IsADirectoryError):
            raise InvalidSpec(f"download: {name!r} is a directory on the host; not replaced by a file") from None
        raise


def write_file(path: Path, data: bytes) -> None:
    """The host file ``path`` (its directory the caller's own, followed as given) made ``data``,
    without writing through a link or hard link at ``path`` itself."""
    directory = os.open(path.parent, _DIR_FLAGS)
    try:
        write_beside(directory, path.name, data)
    finally:
        os.close(directory)
