"""The guest's command leaves, removed once their command has ended and they are empty.

Each command runs in a leaf of the guest's ``sandbox`` cgroup, removed as the command ends.  A
leaf a background child of the command still lives in cannot go then (``EBUSY``), and stayed
for good once the child ended: a session of such commands left a leaf each (~22 KB of the
guest's kernel memory, outside the commands' limit).  So a removal's answer is read at the next
command's end (by then it has come: the agent answers in order, the command's exit after it), and
a leaf still busy is tried again, at longer and longer intervals counted in commands, until it
goes (or :data:`TRIES` tries: its child is a daemon of the sandbox's life).
"""

from __future__ import annotations

import contextlib
import heapq
import struct
import threading
import time
from collections.abc import Callable

from ...errors import FileError, FileNotFoundInSandbox, SandboxError
from ..linux.agent import AgentChannel
from ..linux.agent_process import AgentProcess
from ..linux.frames import T_AS_AGENT, T_FREMOVE

#: tries of a busy leaf, the n-th after 2**n more commands (the last ~2,000 commands after the first)
TRIES = 11


class LeftLeaves:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # commands of several threads end at once
        #: removals sent and not yet read: (leaf, its answer, tries so far)
        self._sent: list[tuple[str, Callable[[float], bytes], int]] = []
        #: busy leaves to try again: (the command count due, leaf, tries so far)
        self._later: list[tuple[int, str, int]] = []

    def remove(self, channel: AgentChannel, leaf: str, count: int) -> None:
        """``leaf``'s command (the ``count``-th) has ended: remove it, and tend earlier ones."""
        with self._lock:
            self._tend(channel, leaf, count)

    def _tend(self, channel: AgentChannel, leaf: str, count: int) -> None:
        sent, self._sent = self._sent, []
        for old, answer, tries in sent:
            try:
                answer(0.0)
            except FileNotFoundInSandbox:
                pass  # gone already
            except FileError:  # still populated: later
                if tries + 1 < TRIES:
                    heapq.heappush(self._later, (count + (1 << tries), old, tries + 1))
            except SandboxError:  # no answer yet (or the channel went): try it again at the next end
                if tries + 1 < TRIES:
                    heapq.heappush(self._later, (count + 1, old, tries + 1))
        self._send(channel, leaf, 0)
        while self._later and self._later[0][0] <= count:
            _, old, tries = heapq.heappop(self._later)
            self._send(channel, old, tries)

    def _send(self, channel: AgentChannel, leaf: str, tries: int) -> None:
        answer = channel.begin(T_FREMOVE | T_AS_AGENT, struct.pack("<I", 0) + leaf.encode() + b"\0")
        self._sent.append((leaf, answer, tries))


class CommandDeadlines:
    """When each command running in the guest must end, kept across a pause to disk.

    A command's timeout is the host's to enforce, and the host's side of a command is gone once
    its VM is parked (its handle ends: "the sandbox stopped while the command ran"); the command
    itself is in the VM's saved memory and ran on after ``resume()`` with no timeout and no host
    to kill it.  So a live snapshot records each running command's leaf and the time it had left
    (:meth:`left`), and the same sandbox restored from it kills each leaf when that time is up
    (:meth:`restored`); a copy (a new sandbox, a fork) keeps them running, as documented."""

    def __init__(self, kill_leaf: Callable[[str], None]) -> None:
        self._kill_leaf = kill_leaf
        self._lock = threading.Lock()
        #: leaf -> the host's command in it (its deadline moves with in-memory pauses)
        self._running: dict[str, AgentProcess] = {}
        #: leaf -> monotonic deadline, for commands carried over a pause to disk
        self._carried: dict[str, float] = {}
        self._timers: list[threading.Timer] = []

    def started(self, leaf: str, process: AgentProcess) -> None:
        with self._lock:
            self._running[leaf] = process

    def ended(self, leaf: str) -> None:
        with self._lock:
            self._running.pop(leaf, None)

    def left(self) -> list[tuple[str, float]]:
        """(leaf, seconds left) of every command not ended."""
        now = time.monotonic()
        with self._lock:
            running = [(leaf, process.seconds_left()) for leaf, process in self._running.items() if not process.done]
            carried = [(leaf, deadline - now) for leaf, deadline in self._carried.items()]
        return [(leaf, max(0.0, left)) for leaf, left in running + carried]

    def restored(self, commands: list[tuple[str, float]]) -> None:
        """The commands a pause to disk carried over: each leaf is killed when its time is up."""
        now = time.monotonic()
        for leaf, seconds in commands:
            with self._lock:
                self._carried[leaf] = now + seconds
            timer = threading.Timer(seconds, self._end, args=(leaf,))
            timer.daemon = True
            self._timers.append(timer)
            timer.start()

    def _end(self, leaf: str) -> None:
        with self._lock:
            if self._carried.pop(leaf, None) is None:
                return
        with contextlib.suppress(SandboxError, OSError):
            self._kill_leaf(leaf)

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
