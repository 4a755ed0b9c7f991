"""Waiting for descriptors without ``select(2)``: it cannot watch a descriptor numbered 1024 or
above (Python raises ValueError; C code built with fortify aborts the whole process), and an
owner holding many sandboxes, connections and tunnels has thousands."""

from __future__ import annotations

import select
from collections.abc import Sequence
from typing import Protocol, TypeVar


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


T = TypeVar("T", bound="int | _HasFileno")


def _ms(timeout: float | None) -> int | None:
    return None if timeout is None else max(0, round(timeout * 1000))


def readable(watched: Sequence[T], timeout: float | None = None) -> list[T]:
    """Those of ``watched`` (descriptors or objects with ``fileno()``) ready to read -- or at
    their end, or in error, as ``select`` reports them -- within ``timeout`` seconds (None: wait)."""
    poller = select.poll()
    by_fd: dict[int, T] = {}
    for item in watched:
        fd = item if isinstance(item, int) else item.fileno()
        by_fd[fd] = item
        poller.register(fd, select.POLLIN | select.POLLPRI)
    return [by_fd[fd] for fd, _ in poller.poll(_ms(timeout))]


def writable(fd: int, timeout: float | None = None) -> bool:
    """True if ``fd`` may be written (or is in error) within ``timeout`` seconds."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(_ms(timeout)))
