"""Placing the agent's spares into their cgroups ahead of time (process tier).

Each command runs in its own cgroup leaf (its kill tree), so the host moves
its first process there before it may exec.  A move between cgroups takes a
global lock that, unless a move happened within the last RCU grace period,
first waits for one: ~5 ms on an idle host against ~0.2 ms back to back
(host/grace.py expedites it around Corral's moves where the host lets it;
cgroup2's ``favordynmods`` mount option removes the wait for the whole host,
``corral doctor`` reports it, Corral never sets it).  The first command after
a pause -- every command of a sandbox taken from a warm pool -- would pay it.

So the agent (``corral-agent --spare``) keeps a forked child ready, and this
module moves it into a fresh leaf while the sandbox is idle; the next command
runs in it with nothing left to move.  Placement waits ``SETTLE`` seconds
after the spare appears: a sandbox that runs its next command sooner (the
moves are then back to back, hence fast) or is destroyed meanwhile is not
worth the work, and one background thread serves every sandbox of the process.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

SETTLE = 0.05


class _Placer:
    def __init__(self) -> None:
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def schedule(self, job: Callable[[], None], delay: float = SETTLE) -> None:
        with self._wake:
            heapq.heappush(self._due, (time.monotonic() + delay, next(self._order), job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="corral-spare-placer", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._wake.wait(None if not self._due else self._due[0][0] - time.monotonic())
                _, _, job = heapq.heappop(self._due)
            try:
                job()
            except Exception:  # a spare that cannot be placed is only not used
                pass
            # the last job (its sandbox, and all it holds: its commands and their output) is not
            # kept until another comes, which may be never
            del job


PLACER = _Placer()
