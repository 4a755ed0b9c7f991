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
import dataclasses
import heapq
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import FileError, FileNotFoundInSandbox, SandboxClosed, SandboxError
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


@dataclass(frozen=True)
class Carried:
    """A command running in the guest when a live snapshot was taken, as the snapshot keeps it:
    its guest leaf, the seconds of its timeout left, and what ``commands.list()`` shows of it."""

    leaf: str
    left: float
    pid: int = 0
    argv: tuple[str, ...] = ()
    cwd: str = ""

    @classmethod
    def from_json(cls, data: Any) -> Carried:
        """One entry of a snapshot's ``commands``: its fields (``asdict``), or [leaf, seconds left]
        (what older snapshots kept)."""
        if isinstance(data, dict):
            return cls(str(data["leaf"]), float(data["left"]), int(data.get("pid", 0)),
                       tuple(str(a) for a in data.get("argv", ())), str(data.get("cwd", "")))
        leaf, left = data[:2]
        return cls(str(leaf), float(left))


class CommandDeadlines:
    """When each command running in the guest must end, kept across a live snapshot.

    A command's timeout is the host's to enforce, and the host's side of a command stays with
    the VM that started it: parked (its handle ends: "the sandbox stopped while the command
    ran"), or copied into a fork or a VM made from a snapshot, the command itself is in the VM's
    memory and ran on there with no timeout and no host to kill it.  So a live snapshot (and a
    fork) records each running command's leaf, the time it had left, its pid, argv and cwd
    (:meth:`left`), and every VM restored from it -- the same sandbox back from disk, a fork, a
    new sandbox -- kills each leaf when that time is up (:meth:`restored`), lists the command
    (:meth:`carried`) and kills it on request (:meth:`kill`).  Its output and exit status went
    to the host side of the VM it was started in: a copy cannot wait for it."""

    def __init__(self, kill_leaf: Callable[[str], None]) -> None:
        self._kill_leaf = kill_leaf
        self._lock = threading.Lock()
        #: leaf -> the host's command in it (its deadline moves with in-memory pauses)
        self._running: dict[str, AgentProcess] = {}
        #: leaf -> (monotonic deadline, the command), for commands carried over a live snapshot
        self._carried: dict[str, tuple[float, Carried]] = {}
        self._timers: list[threading.Timer] = []

    def started(self, leaf: str, process: AgentProcess) -> None:
        with self._lock:
            self._running[leaf] = process

    def ended(self, leaf: str) -> None:
        with self._lock:
            self._running.pop(leaf, None)

    def left(self) -> list[Carried]:
        """Every command not ended, with the seconds it has left."""
        now = time.monotonic()
        with self._lock:
            running = [Carried(leaf, process.seconds_left(), process.pid or 0,
                               tuple(process.request.argv), process.request.cwd)
                       for leaf, process in self._running.items() if not process.done]
            carried = [dataclasses.replace(command, left=deadline - now)
                       for deadline, command in self._carried.values()]
        return [dataclasses.replace(command, left=max(0.0, command.left)) for command in running + carried]

    def restored(self, commands: list[Carried]) -> None:
        """The commands a live snapshot carried over: each leaf is killed when its time is up."""
        now = time.monotonic()
        for command in commands:
            with self._lock:
                self._carried[command.leaf] = (now + command.left, command)
            timer = threading.Timer(command.left, self._end, args=(command.leaf,))
            timer.daemon = True
            self._timers.append(timer)
            timer.start()

    def carried(self) -> list[Carried]:
        """The carried commands not ended by their deadline or a kill (one may have exited)."""
        with self._lock:
            return [command for _, command in self._carried.values()]

    def forget(self, leaf: str) -> None:
        """A carried command that exited on its own."""
        with self._lock:
            self._carried.pop(leaf, None)

    def kill(self, pid: int) -> bool:
        """Kill the carried command ``pid`` (its leaf); False if there is none."""
        with self._lock:
            leaf = next((leaf for leaf, (_, command) in self._carried.items() if command.pid == pid), None)
        return leaf is not None and self._end(leaf)

    def _end(self, leaf: str) -> bool:
        with self._lock:
            if self._carried.pop(leaf, None) is None:
                return False
        with contextlib.suppress(SandboxError, OSError):
            self._kill_leaf(leaf)
        return True

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()


def leaf_events(channel: AgentChannel, leaf: str, timeout: float = 60.0) -> list[str]:
    """The lines of a guest command leaf's ``cgroup.events`` as its agent reads them; a leaf
    removed (its command ended) reads as ``populated 0``."""
    try:
        return channel.read_file(f"{leaf}/cgroup.events", 4096, as_agent=True, timeout=timeout).decode().splitlines()
    except FileNotFoundInSandbox:
        return ["populated 0"]


class LeafEnded:
    """Whether a guest leaf is empty, as its agent reports it (``cgroup.events``), asked again and
    again from a thread of its own until it is, the leaf is gone or :meth:`stop`: ``done`` for
    :func:`~..linux.pause.backstop_kill`.  An agent that answers nothing leaves it False (each
    question waits ``ask_timeout`` seconds for its answer, then is asked again)."""

    #: seconds between a "populated 1" answer and the next question
    EVERY = 0.05

    def __init__(self, channel: AgentChannel, leaf: str, closed: Callable[[], bool], ask_timeout: float) -> None:
        self._channel = channel
        self._ask_timeout = ask_timeout
        self._leaf = leaf
        self._closed = closed
        self._done = threading.Event()
        self._stopped = threading.Event()
        threading.Thread(target=self._ask, name="corral-vm-leaf-ended", daemon=True).start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def stop(self) -> None:
        self._stopped.set()

    def _ask(self) -> None:
        while not self._stopped.is_set() and not self._closed() and not self._channel.closed.is_set():
            if self._channel.pause_clock.paused:  # it answers once resumed: ask it then
                self._stopped.wait(self.EVERY)
                continue
            try:
                events = leaf_events(self._channel, self._leaf, self._ask_timeout)
            except (SandboxClosed, FileError):  # no answer in time, or the channel going: asked again
                events = []
            except (SandboxError, OSError):
                return
            if "populated 0" in events:  # (or the leaf removed: its command ended)
                self._done.set()
                return
            self._stopped.wait(self.EVERY)
