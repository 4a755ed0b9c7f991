"""Time a sandbox spends paused, so that command timeouts count only time it could run.

A paused sandbox's processes are frozen; a command with ``timeout=10`` that has
run 4 s when the sandbox is paused for an hour still has 6 s after ``resume()``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol


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


class _Ended(Protocol):
    @property
    def done(self) -> bool: ...


def backstop_kill(proc: _Ended, clock: PauseClock, grace: float, closed: Callable[[], bool],
                  stop: Callable[[], None], name: str) -> None:
    """After a command's kill sent through its sandbox's agent (gVisor, microVM: only the agent
    reaches the command's processes): wait up to ``grace`` seconds of the time the agent could run
    for the command's end, then ``stop()`` the whole sandbox (the agent did not obey; a command
    run as root can stop it).  A paused sandbox's agent obeys once resumed: its grace is watched
    from a thread of its own, and the caller returns at once (it returned ``grace`` later, and the
    sandbox was ended for a signal its agent could not yet see)."""

    def running_time() -> float:
        return time.monotonic() - clock.paused_total()

    def watch() -> None:
        end = running_time() + grace
        while not proc.done and not closed() and running_time() < end:
            time.sleep(0.01)
        if not proc.done and not closed():
            stop()

    if clock.paused:
        threading.Thread(target=watch, name=name, daemon=True).start()
    else:
        watch()
