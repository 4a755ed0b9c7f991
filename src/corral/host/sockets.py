"""Listening sockets: binding a Unix socket only its owner may connect to, and closing a
listener with the connections it accepted (the egress proxy, port forwards, owner links, the daemon)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from .procs import named_process_lives, process_start_time

#: the staging directories of :func:`bind_private`
STAGING_PREFIX = ".bind-"
#: a staging directory not named for a process (made before they were) is left this long
STAGING_OF_UNKNOWN_FORM_KEPT = 60.0


def staging_of_dead_processes(directory: Path) -> list[Path]:
    """The staging directories :func:`bind_private` left in ``directory`` whose process is gone
    (and those of no process's name, made before they had one, once old)."""
    try:
        entries = [entry for entry in directory.iterdir() if entry.name.startswith(STAGING_PREFIX)]
    except OSError:
        return []
    gone = []
    for entry in entries:
        lives = named_process_lives(entry.name.removeprefix(STAGING_PREFIX).split("-", 1)[0])
        if lives is None:
            try:
                lives = time.time() - entry.lstat().st_mtime < STAGING_OF_UNKNOWN_FORM_KEPT
            except OSError:
                continue
        if not lives:
            gone.append(entry)
    return gone


def bind_private(sock: socket.socket, path: Path) -> None:
    """Bind ``sock`` (AF_UNIX) to ``path`` as mode 0600 from the moment it appears there.

    The socket is bound in a fresh 0700 directory beside ``path``, made 0600 and linked into
    place (a link, not a rename: like ``bind``, it fails with EADDRINUSE if ``path`` exists).  A temporary ``umask(0o177)`` around ``bind`` would do the same in one thread, but the
    umask is the process's: a sandbox being built meanwhile in another thread got 0600
    directories (its ``/usr`` and ``/workspace`` mount points), and nothing ran in it.

    The directory is named for this process (``.bind-PID.START-...``, :data:`STAGING_PREFIX`):
    a process killed in between leaves it, and ``gc`` removes those of processes that are gone
    (:func:`staging_of_dead_processes`)."""
    pid = os.getpid()
    private = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{STAGING_PREFIX}{pid}.{process_start_time(pid) or 0}-"))
    staged = private / "s"
    try:
        # bound through the directory's descriptor: a socket's path has room for 107 bytes, and the
        # staging directory's is longer than ``path`` (seven-digit pids in a test's state
        # directory made it 109)
        dir_fd = os.open(private, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            sock.bind(f"/proc/self/fd/{dir_fd}/s")
        finally:
            os.close(dir_fd)
        os.chmod(staged, 0o600)
        try:
            os.link(staged, path)
        except FileExistsError:
            raise OSError(errno.EADDRINUSE, f"{path} exists") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
        private.rmdir()


def close_listener(listener: socket.socket, connections: Iterable[socket.socket], thread: threading.Thread) -> None:
    """Stop ``listener`` accepting, cut every connection (their relay threads then end), and wait
    (bounded) for the accept thread.  A shutdown first: close alone does not wake a blocked accept."""
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    for sock in connections:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    thread.join(timeout=5)
