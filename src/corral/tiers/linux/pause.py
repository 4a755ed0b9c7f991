"""Time a sandbox spends paused, so that command timeouts count only time it could run.

A paused sandbox's processes are frozen; a command with ``timeout=10`` that has
run 4 s when the sandbox is paused for an hour still has 6 s after ``resume()``.
"""

from __future__ import annotations

import threading
import time


class PauseClock:
    """Seconds spent paused, in total and including a pause in progress."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0.0
        self._since: float | None = None

    @property
    def paused(self) -> bool:
        return self._since is not None

    def pause(self) -> None:
        with self._lock:
            if self._since is None:
                self._since = time.monotonic()

    def resume(self) -> None:
        with self._lock:
            if self._since is not None:
                self._total += time.monotonic() - self._since
                self._since = None

    def paused_total(self) -> float:
        with self._lock:
            ongoing = time.monotonic() - self._since if self._since is not None else 0.0
            return self._total + ongoing
