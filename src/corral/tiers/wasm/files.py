"""The files API of a wasm sandbox, carried out on the host without leaving its directories.

A wasm sandbox's whole filesystem is two host directories, preopened into the
guest as ``/workspace`` and ``/tmp``.  Everything else does not exist.  The
guest can plant symlinks in them, so every host-side path walk goes through
``openat2(RESOLVE_IN_ROOT)``: symlinks and ``..`` resolve inside the
directory, as if it were ``/``, never to a host file.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import secrets
import stat as stat_mod
from collections.abc import Callable
from pathlib import Path

from ...errors import FileError, FileNotFoundInSandbox
from ...host.charged import run_here
from ...host.openat2 import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, openat2
from ...host.workspace import remove_beneath
from ...spec import path_bytes
from ..base import MAX_LIST_ENTRIES, MAX_LIST_PATH_CHARS, FileEntry, listing_too_long, too_many_entries


def openat2_in_root(root_fd: int, path: str, flags: int, mode: int = 0) -> int:
    """open ``path`` with ``root_fd`` acting as ``/`` for every step of the resolution."""
    return openat2(root_fd, path_bytes(path), flags | os.O_CLOEXEC, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS, mode)


def _entry(name: str, path: str, st: os.stat_result) -> FileEntry:
    mode = st.st_mode
    kind = ("file" if stat_mod.S_ISREG(mode) else "dir" if stat_mod.S_ISDIR(mode)
            else "symlink" if stat_mod.S_ISLNK(mode) else "other")
    return FileEntry(name, path, kind, st.st_size, stat_mod.S_IMODE(mode), st.st_mtime)


def _too_large(path: str, max_bytes: int) -> FileError:
    return FileError(f"{path}: file is larger than the {max_bytes} byte limit", errno.EFBIG)


def _error(exc: OSError, path: str) -> FileError:
    if exc.errno == errno.ENOENT:
        return FileNotFoundInSandbox(f"{path}: no such file or directory", errno.ENOENT)
    return FileError(f"{path}: {exc.strerror}", exc.errno or 0)


#: runs what allocates on the sandbox's disk (data, names) where it is charged (see ``host/charged.py``)
Charge = Callable[[Callable[[], None]], None]


class SandboxFiles:
    """Files of one sandbox: ``roots`` maps a guest directory (``/workspace``) to its host directory.

    ``charge`` runs each step that allocates on the sandbox's disk: its tmpfs pages are charged
    to whoever writes them, and the owner's group has no limit (the wasm sandbox passes a child
    in its own memory cgroup; without cgroups, the write is done here)."""

    def __init__(self, roots: dict[str, Path], uid: int, gid: int, charge: Charge = run_here) -> None:
        self.roots = roots
        self.uid = uid
        self.gid = gid
        self.charge = charge

    def _split(self, path: str) -> tuple[Path, str]:
        """(host root, path inside it) for a guest path; ENOENT for anything outside the preopens."""
        clean = os.path.normpath("/" + path.lstrip("/"))
        for guest, host in self.roots.items():
            if clean == guest or clean.startswith(guest + "/"):
                return host, clean[len(guest):].lstrip("/") or "."
        raise FileNotFoundInSandbox(
            f"{path}: no such file or directory (a wasm sandbox has only {', '.join(self.roots)})", errno.ENOENT
        )

    def _open(self, path: str, flags: int, mode: int = 0) -> int:
        host, rel = self._split(path)
        root_fd = os.open(host, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return openat2_in_root(root_fd, rel, flags, mode)
        except OSError as exc:
            raise _error(exc, path) from None
        finally:
            os.close(root_fd)

    def _parent(self, path: str, create: bool = False) -> tuple[int, str]:
        """An fd of the parent directory of ``path`` (made with its parents if ``create``) and the last name."""
        clean = os.path.normpath("/" + path.lstrip("/"))
        _, rel = self._split(clean)
        if rel == ".":
            raise FileError(f"{path}: is a directory the sandbox cannot replace", errno.EISDIR)
        parent = os.path.dirname(clean)
        if create:
            self.make_dir(parent)
        return self._open(parent, os.O_RDONLY | os.O_DIRECTORY), os.path.basename(clean)

    def read_file(self, path: str, max_bytes: int) -> bytes:
        fd = self._open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if stat_mod.S_ISDIR(st.st_mode):
                raise FileError(f"{path}: is a directory", errno.EISDIR)
            # refused before any of it is read, as the agent of the other tiers does: a sparse file
            # of a terabyte the guest made took 256 MiB of the owner before it was refused
            size = st.st_size
            if size > max_bytes:
                raise _too_large(path, max_bytes)
            # the file in one buffer of its size, read at once (a list of 1 MiB chunks and their
            # join held it twice); more reads only if it grew meanwhile, still up to the limit
            chunks, total = [], 0
            while chunk := os.read(fd, min(size + 1 - total if total <= size else 1 << 20, max_bytes + 1 - total)):
                total += len(chunk)
                if total > max_bytes:
                    raise _too_large(path, max_bytes)
                chunks.append(chunk)
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        finally:
            os.close(fd)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """The whole of ``data`` at ``path``, or (on any error: a full disk) the file as it was: a
        temporary file beside it, renamed over it once written (before, the file was truncated and
        written in place: a full disk left part of the new data, two writes at once a mix of both).
        As the agent of the other tiers does (files.c, do_fput): ``mode`` is a new file's, a
        replaced one keeps its mode and owner.  A link at the path is refused (ELOOP), as before."""
        dir_fd, name = self._parent(path, create=True)
        try:
            try:
                old: os.stat_result | None = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            except OSError as exc:
                raise _error(exc, path) from None
            if old is not None and not stat_mod.S_ISREG(old.st_mode):
                err = (errno.EISDIR if stat_mod.S_ISDIR(old.st_mode) else errno.ELOOP if stat_mod.S_ISLNK(old.st_mode)
                       else errno.EINVAL)
                raise FileError(f"{path}: {os.strerror(err)}", err)
            temp = f".{name[:100]}.corral-{secrets.token_hex(6)}"
            owner = (old.st_uid, old.st_gid) if old is not None else (self.uid, self.gid)
            file_mode = stat_mod.S_IMODE(old.st_mode) if old is not None else mode & 0o7777

            def write_temp() -> None:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=dir_fd)
                try:
                    os.fchown(fd, *owner)
                    os.fchmod(fd, file_mode)
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)

            try:
                self.charge(write_temp)
                os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException as exc:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=dir_fd)
                if isinstance(exc, OSError):
                    raise _error(exc, path) from None
                raise
        finally:
            os.close(dir_fd)

    def list_dir(self, path: str) -> list[FileEntry]:
        fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        base = os.path.normpath("/" + path.lstrip("/")).rstrip("/")
        entries = []
        try:
            names = os.listdir(fd)
            if len(names) > MAX_LIST_ENTRIES:
                raise FileError(too_many_entries(path), errno.E2BIG)
            if sum(len(name) for name in names) + len(names) * (len(base) + 1) > MAX_LIST_PATH_CHARS:
                raise FileError(listing_too_long(path), errno.E2BIG)
            for name in names:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                entries.append(_entry(name, f"{base}/{name}", st))
        finally:
            os.close(fd)
        return sorted(entries, key=lambda e: e.name)

    def stat(self, path: str) -> FileEntry:
        clean = os.path.normpath("/" + path.lstrip("/"))
        host, rel = self._split(path)
        if rel == ".":
            return _entry(os.path.basename(clean), clean, os.stat(host))
        dir_fd, name = self._parent(path)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError as exc:
            raise _error(exc, path) from None
        finally:
            os.close(dir_fd)
        return _entry(name, clean, st)

    def remove(self, path: str, recursive: bool = False) -> None:
        dir_fd, name = self._parent(path)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat_mod.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=dir_fd)
            elif recursive:
                # never follows a link, and walks without recursion (shutil.rmtree recursed: a
                # chain of 3,000 directories the guest made raised RecursionError, and stayed)
                remove_beneath(dir_fd, name)
            else:
                os.rmdir(name, dir_fd=dir_fd)
        except OSError as exc:
            raise _error(exc, path) from None
        finally:
            os.close(dir_fd)

    def make_dir(self, path: str, mode: int = 0o755) -> None:
        """mkdir -p, inside the sandbox's view."""
        clean = os.path.normpath("/" + path.lstrip("/"))
        _, rel = self._split(clean)
        if rel == ".":
            return
        prefix = clean[: len(clean) - len(rel)].rstrip("/")
        built = prefix
        for part in rel.split("/"):
            built = f"{built}/{part}"
            dir_fd, name = self._parent(built)
            try:
                if not self._is_dir(dir_fd, name):
                    self.charge(functools.partial(self._mkdir, dir_fd, name, mode))
            except FileExistsError:
                # may be a symlink the guest planted: resolve it inside the root only
                try:
                    os.close(self._open(built, os.O_RDONLY | os.O_DIRECTORY))
                except FileError:
                    raise FileError(f"{built}: exists and is not a directory", errno.ENOTDIR) from None
            except OSError as exc:
                raise _error(exc, built) from None
            finally:
                os.close(dir_fd)

    @staticmethod
    def _is_dir(dir_fd: int, name: str) -> bool:
        """An existing directory (not a link) needs no charged child to be "made"."""
        try:
            return stat_mod.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def _mkdir(self, dir_fd: int, name: str, mode: int) -> None:
        os.mkdir(name, mode & 0o7777, dir_fd=dir_fd)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.fchown(fd, self.uid, self.gid)
        finally:
            os.close(fd)
