"""Closing a listener and the connections it accepted, shared by the egress proxy and port forwards."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterable


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
