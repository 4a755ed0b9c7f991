"""A live snapshot's memory image (``vm/ram``): copied out of the converter's memfd sparse and
hashed on the way, and checked before a VM maps it (live.py).

The digest covers every non-zero CHUNK-aligned chunk and its offset, so how much of the file is
a hole does not matter (a hole reads as zeros).  A check is remembered per process and version
of the file (device, inode, size, ctime): a fork after fork does not hash it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import SandboxError

#: a memory image is hashed and kept sparse by chunks of this size
CHUNK = 1 << 16
#: chunks hashed per task of the hashing thread
HASH_BATCH = 64
#: RAM files whose sha256 this process wrote or checked, by (device, inode, size, ctime): checked
#: once per process and version of the file, not at every fork (the store renames its directory)
_checked: set[tuple[int, int, int, int]] = set()
_checked_lock = threading.Lock()


def _chunks(fd: int, size: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of every CHUNK-aligned chunk of the file that is not all zeros; holes
    (SEEK_HOLE) are skipped unread."""
    offset = 0
    zero = bytes(CHUNK)
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:
            return  # nothing but a hole after offset
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        pos = start - start % CHUNK
        while pos < end:
            chunk = os.pread(fd, CHUNK, pos)
            if chunk != zero[: len(chunk)]:
                yield pos, chunk
            pos += CHUNK
        offset = pos


def _hash_chunk(h: Any, offset: int, chunk: bytes) -> None:
    h.update(offset.to_bytes(8, "little"))
    h.update(chunk)


def ram_digest(path: Path) -> str:
    """sha256 of a memory image's non-zero CHUNK-aligned chunks and their offsets (how much of
    it is a hole does not matter: a hole reads as zeros)."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        h.update(size.to_bytes(8, "little"))
        for offset, chunk in _chunks(fd, size):
            _hash_chunk(h, offset, chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def write_sparse(source: int, size: int, target: Path) -> str:
    """Copy a memory image (the converter's memfd) into ``target``, leaving its zero chunks
    holes; returns its :func:`ram_digest`, computed on the way."""
    h = hashlib.sha256()
    h.update(size.to_bytes(8, "little"))
    # hashing (sha256 releases the GIL) overlaps reading and writing: one thread, batches in
    # order.  A plain thread, not an executor: this runs in the background after snapshot()
    # returned, also while the interpreter exits, when an executor refuses work ("can't register
    # atexit after shutdown") and the snapshot the caller was given was removed
    batches: queue.Queue[list[tuple[int, bytes]] | None] = queue.Queue(maxsize=4)

    def hash_batches() -> None:
        while (batch := batches.get()) is not None:
            for offset, chunk in batch:
                _hash_chunk(h, offset, chunk)

    hasher: threading.Thread | None = None
    with contextlib.suppress(RuntimeError):  # no new threads at this interpreter's shutdown: hash here
        thread = threading.Thread(target=hash_batches, name="corral-ram-hash", daemon=True)
        thread.start()
        hasher = thread
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        batch: list[tuple[int, bytes]] = []
        for offset, chunk in _chunks(source, size):
            os.pwrite(fd, chunk, offset)
            batch.append((offset, chunk))
            if len(batch) == HASH_BATCH:
                _hand_over(batch, batches, hasher, h)
                batch = []
        _hand_over(batch, batches, hasher, h)
    finally:
        os.close(fd)
        if hasher is not None:
            batches.put(None)
            hasher.join()
    return h.hexdigest()


def _hand_over(batch: list[tuple[int, bytes]], batches: queue.Queue[list[tuple[int, bytes]] | None],
               hasher: threading.Thread | None, h: Any) -> None:
    if hasher is not None:
        batches.put(batch)
    else:
        for offset, chunk in batch:
            _hash_chunk(h, offset, chunk)


def memfd_of(pid: int) -> int:
    """The converter's guest RAM (its only memfd), opened through /proc."""
    fds = Path(f"/proc/{pid}/fd")
    for entry in fds.iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(entry).startswith("/memfd:"):
                return os.open(entry, os.O_RDONLY | os.O_CLOEXEC)
    raise SandboxError("the snapshot's converter QEMU has no memory file")


def _file_key(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)


def remember(path: Path) -> None:
    """``path`` as it is now was written or checked by this process."""
    with _checked_lock:
        _checked.add(_file_key(path))


def checked(path: Path) -> bool:
    """Whether ``path`` as it is now was written or checked by this process."""
    with _checked_lock:
        return _file_key(path) in _checked
