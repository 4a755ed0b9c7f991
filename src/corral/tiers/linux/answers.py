"""Reading the agent's answers to file requests as a guest's root may have written them.

A microVM's agent is the guest's: its root can take the agent's port and answer in its place.
So an answer is bounded as the agent bounds its own (a forged listing of 5.5 million entries
took its owner to 1.8 GB), names no directory holds are dropped, and a malformed answer is a
:class:`~corral.errors.FileError` (an unknown kind byte raised ``UnicodeDecodeError``).
"""

from __future__ import annotations

import errno
import struct

from ...errors import FileError
from ..base import MAX_LIST_ENTRIES, MAX_LIST_PATH_CHARS, FileEntry, listing_too_long, too_many_entries

_TYPES = {"f": "file", "d": "dir", "l": "symlink", "o": "other"}
#: one entry: its kind, size, mode and mtime, then its name and a NUL
_ENTRY = struct.Struct("<cQIq")
#: the most a listing's answer may take: the agent's own bound of entries, each at its longest name
LIST_ANSWER_LIMIT = MAX_LIST_ENTRIES * (_ENTRY.size + 256)
#: the most a stat's answer may take
STAT_ANSWER_LIMIT = _ENTRY.size + 256
#: characters of an error the agent sends that are kept
MAX_ERROR_TEXT = 4096


def _kind(kind: bytes) -> str:
    return _TYPES.get(kind.decode("latin-1"), "other")


def parse_listing(raw: bytes, path: str) -> list[FileEntry]:
    """The entries of a listing's answer ``raw`` for ``path``, sorted by name; at most
    ``MAX_LIST_ENTRIES`` and ``MAX_LIST_PATH_CHARS`` of paths, else ``FileError`` (E2BIG)."""
    entries: list[FileEntry] = []
    pos = 0
    base = path.rstrip("/") or ""
    chars = 0
    while pos + _ENTRY.size < len(raw):
        if len(entries) >= MAX_LIST_ENTRIES:
            raise FileError(too_many_entries(path), errno.E2BIG)
        kind, size, mode, mtime = _ENTRY.unpack_from(raw, pos)
        end = raw.find(b"\0", pos + _ENTRY.size)
        if end < 0:
            raise FileError(f"{path}: the sandbox's agent sent a malformed listing", errno.EPROTO)
        chars += len(base) + 1 + end - pos - _ENTRY.size
        if chars > MAX_LIST_PATH_CHARS:
            raise FileError(listing_too_long(path), errno.E2BIG)
        name = raw[pos + _ENTRY.size : end].decode(errors="surrogateescape")
        pos = end + 1
        if name in ("", ".", "..") or "/" in name:
            continue  # no directory holds such a name: not the agent's own answer
        entries.append(FileEntry(name, f"{base}/{name}", _kind(kind), size, mode, float(mtime)))
    return sorted(entries, key=lambda e: e.name)


def parse_stat(raw: bytes, path: str) -> FileEntry:
    """The entry of a stat's answer ``raw`` for ``path``."""
    if len(raw) < _ENTRY.size:
        raise FileError(f"{path}: the sandbox's agent sent a malformed answer", errno.EPROTO)
    kind, size, mode, mtime = _ENTRY.unpack_from(raw, 0)
    name = path.rstrip("/").rsplit("/", 1)[-1] or "/"
    return FileEntry(name, path, _kind(kind), size, mode, float(mtime))
