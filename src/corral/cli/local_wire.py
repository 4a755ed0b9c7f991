"""The local daemon's wire format, shared by ``corral daemon`` and ``corral run``'s fast path.

A root-only Unix socket, ``<state dir>/daemon.sock``.  The client sends one
request: a 4-byte little-endian length, then the ``--timeout`` text (empty for
none), a NUL, and the command's arguments separated by NULs (an argument cannot
hold a NUL).  The daemon answers with frames of one kind byte, a 4-byte length
and the payload: ``s`` (empty: the command is being started), ``o`` stdout bytes, ``e``
stderr bytes, then exactly one of ``r`` (the result: :data:`RESULT_HEAD` then ``corral run
--json``'s line) or ``x`` (an error message, UTF-8).  A client whose daemon goes away before
``s`` runs the command itself; after it, never (it may have run: a second run would repeat
what it did).

No JSON and no :mod:`socket` on the client side: this module runs on every
``corral run`` before anything else, and ``json`` (through ``re``) and
``socket`` (through ``enum``) would cost it milliseconds.
"""

from __future__ import annotations

import os
import struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    from _socket import socket

SOCKET_NAME = "daemon.sock"
DEFAULT_STATE_DIR = "/var/lib/corral"
LENGTH = struct.Struct("<I")
FRAME = struct.Struct("<cI")
#: exit code, timed out, OOM-killed, duration in ms
RESULT_HEAD = struct.Struct("<i??d")
#: a request larger than this is refused (an argv, not a payload)
MAX_REQUEST = 1 << 20

STARTED, STDOUT, STDERR, RESULT, ERROR = b"s", b"o", b"e", b"r", b"x"
#: the command's timeout when ``--timeout`` is not given (the spec's default: tests hold them equal)
DEFAULT_TIMEOUT = 60.0
#: seconds past the command's timeout a client waits for the next frame once the command has
#: started (the daemon's kill and answer take well under a second): a stuck daemon is then an
#: error, not a client that waits for ever
ANSWER_GRACE = 15.0


def answer_deadline(timeout: str | None) -> float:
    """Seconds a client waits for each frame after ``started``."""
    try:
        seconds = float(timeout) if timeout else DEFAULT_TIMEOUT
    except ValueError:
        seconds = DEFAULT_TIMEOUT  # (the daemon refuses it at once)
    return (seconds if 0 < seconds < 1e9 else DEFAULT_TIMEOUT) + ANSWER_GRACE


def socket_path(state_dir: str | None = None) -> str:
    return os.path.join(state_dir or os.environ.get("CORRAL_STATE_DIR") or DEFAULT_STATE_DIR, SOCKET_NAME)


def daemon_is_trusted(peer_credentials: bytes) -> bool:
    """Whether the listener behind ``daemon.sock`` (its ``SO_PEERCRED``: pid, uid, gid) is root
    or this process's own user, as the launcher (``cli/launcher.c``) also checks."""
    uid = struct.unpack("3i", peer_credentials)[1]
    return uid in (0, os.geteuid())


def encode_request(argv: list[str], timeout: str | None) -> bytes:
    body = b"\0".join([os.fsencode(timeout or ""), *(os.fsencode(arg) for arg in argv)])
    return LENGTH.pack(len(body)) + body


def decode_request(body: bytes) -> tuple[list[str], str | None]:
    timeout, *argv = body.split(b"\0")
    return [os.fsdecode(arg) for arg in argv], (os.fsdecode(timeout) if timeout else None)


def read_exact(sock: socket, n: int) -> bytes:
    """``n`` bytes, or fewer only if the peer closed the connection."""
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send_frame(sock: socket, kind: bytes, payload: bytes) -> None:
    sock.sendall(FRAME.pack(kind, len(payload)) + payload)


def read_frame(sock: socket) -> tuple[bytes, bytes] | None:
    """The next frame, or None when the connection ended."""
    header = read_exact(sock, FRAME.size)
    if len(header) < FRAME.size:
        return None
    kind, length = FRAME.unpack(header)
    payload = read_exact(sock, length)
    if len(payload) < length:
        return None
    return kind, payload
