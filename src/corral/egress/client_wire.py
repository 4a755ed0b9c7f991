"""What the egress proxy reads from a sandbox's client before a connection is decided, and how it
refuses: the HTTP request head or the SOCKS5 handshake, each whole by a deadline
(``HANDSHAKE_TIMEOUT``) and at a bounded cost to the owner, the host and port it names, and the
answers of a refusal.
"""

from __future__ import annotations

import socket
import struct
import time

from .policy import Decision

MAX_HEAD = 64 * 1024
#: seconds a client has for its whole request head or SOCKS handshake (and between bytes while
#: it sends one): a byte every few seconds held a proxy thread and a descriptor for as long as
#: the sandbox liked (256 such heads held 256 of the owner's threads), none of it audited
HANDSHAKE_TIMEOUT = 30.0
#: a piece of an unfinished request head smaller than this bytes makes the next read wait
#: DRIBBLE_PAUSE seconds (a client writes its head whole: only a dribbling one waits)
DRIBBLE_PIECE = 512
DRIBBLE_PAUSE = 0.05


class ProxyError(Exception):
    """A client spoke something we do not serve; the connection is dropped."""


class HandshakeTooSlow(ProxyError):
    """A request head or SOCKS handshake did not arrive whole within HANDSHAKE_TIMEOUT."""


def read_head(sock: socket.socket, deadline: float) -> tuple[bytes, bytes]:
    """Read up to the blank line ending an HTTP head, by ``deadline`` (monotonic); return (head
    without it, bytes after it).

    What a piece costs the owner is bounded, not what the sandbox sends: only the new bytes are
    searched (and appended in place), and after a small piece of an unfinished head the next read
    waits DRIBBLE_PAUSE, so a head dribbled a byte at a time is read in few, bigger pieces.  Each
    piece was copied with all before it and all of it searched again: 64 connections dribbling a
    byte a millisecond each took 5.7 s of the owner's CPU in 4 s."""
    data = bytearray()
    while True:
        start = max(0, len(data) - 3)
        chunk = recv_by(sock, 16384, deadline, "request head")
        if not chunk:
            raise ProxyError("client closed before the request head ended")
        data += chunk
        end = data.find(b"\r\n\r\n", start)
        if end >= 0:
            return bytes(data[:end]), bytes(data[end + 4:])
        if len(data) > MAX_HEAD:
            raise ProxyError("request head too large")
        if len(chunk) < DRIBBLE_PIECE:
            time.sleep(min(DRIBBLE_PAUSE, max(0.0, deadline - time.monotonic())))


def recv_by(sock: socket.socket, size: int, deadline: float, what: str) -> bytes:
    """One ``recv`` that returns by ``deadline`` (the socket's own timeout is put back after)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise HandshakeTooSlow(f"the {what} did not arrive whole within {HANDSHAKE_TIMEOUT:g} s")
    before = sock.gettimeout()
    sock.settimeout(left if before is None else min(left, before))
    try:
        return sock.recv(size)
    except TimeoutError:
        if time.monotonic() >= deadline:
            raise HandshakeTooSlow(f"the {what} did not arrive whole within {HANDSHAKE_TIMEOUT:g} s") from None
        raise
    finally:
        sock.settimeout(before)


def split_host_port(text: str, default: int | None) -> tuple[str, int]:
    if text.startswith("["):
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            host, port = text, ""
    if not port:
        if default is None:
            raise ProxyError(f"no port in {text!r}")
        return host, default
    if not (port.isascii() and port.isdigit()):  # "²" is a digit to isdigit(), not to int()
        raise ProxyError(f"bad port in {text!r}")
    return host, int(port)


def send_refusal(conn: socket.socket, decision: Decision) -> None:
    where = f"{decision.host}:{decision.port}" + (f" ({decision.address})" if decision.address else "")
    body = f"corral egress: {where} refused by rule {decision.rule}\n".encode()
    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nConnection: close\r\nContent-Type: text/plain\r\n"
                 b"X-Corral-Refused: " + decision.rule.encode() + b"\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


SOCKS_OK, SOCKS_NOT_ALLOWED, SOCKS_UNREACHABLE, SOCKS_REFUSED, SOCKS_BAD_CMD, SOCKS_BAD_ATYP = 0, 2, 4, 5, 7, 8


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        chunk = recv_by(sock, n - len(data), deadline, "SOCKS handshake")
        if not chunk:
            raise ProxyError("client closed during the SOCKS handshake")
        data += chunk
    return data


def socks_reply(conn: socket.socket, code: int) -> None:
    conn.sendall(struct.pack("!BBBB4sH", 5, code, 0, 1, b"\0\0\0\0", 0))
