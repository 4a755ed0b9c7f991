"""The thread that starts every sandbox's bubblewrap (process tier).

bwrap runs with ``--die-with-parent`` (``PR_SET_PDEATHSIG``), which the kernel
ties to the *thread* that forked it, not the process: a sandbox started from a
short-lived thread (an asyncio/anyio worker, a pool's refill thread) would be
killed when that thread ends.  So the tier forks bwrap from one long-lived
thread of its own and callers may create sandboxes from any thread.  Only the
fork happens there (~1 ms, vfork); the rest of a create stays on the caller's
thread, so creates still overlap.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class _Launcher:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def run(self, spawn: Callable[[], T]) -> T:
        """``spawn()`` called on the launcher thread; its result or exception, here."""
        thread = self._ensure_thread()
        if threading.current_thread() is thread:
            return spawn()
        future: Future[T] = Future()
        self._jobs.put((spawn, future))
        return future.result()

    def _ensure_thread(self) -> threading.Thread:
        with self._lock:
            # a forked child has no copy of the thread: start its own
            if self._thread is None or self._pid != os.getpid():
                self._jobs = queue.SimpleQueue()
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, args=(self._jobs,), name="corral-launcher",
                                                daemon=True)
                self._thread.start()
            return self._thread

    @staticmethod
    def _loop(jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
        while True:
            spawn, future = jobs.get()
            try:
                future.set_result(spawn())
            except BaseException as exc:  # handed to the caller, who raises it
                future.set_exception(exc)


LAUNCHER = _Launcher()
