"""What a node's host keeps of its commands for pollers: output not yet handed out, and results.

It is the host actor's memory, outside every sandbox's cgroup, so each part of it is bounded:

- output waiting for a poller: per command and stream at most its sandbox's ``max_output`` (and
  MAX_BUFFERED), for the whole host MAX_HOST_BUFFERED (:class:`Budget`); past either the rest of
  that stream is dropped and the poll says ``truncated``;
- an ended command's result (its output up to ``max_output`` per stream): once handed to a poller
  its output is let go of (a later poller, found by pid, gets the result with no output and
  ``truncated``); not handed out, a sandbox's newest results are kept up to twice its
  ``max_output`` together, the older ones' output let go of; all of it FORGET_AFTER after the
  end.  The output an ended command's process kept for its result goes at its end: only its pid
  stays.  (Every result was kept whole for 60 s, beside its process's copy of it, charged to
  nothing: 8 commands' results held 1.5 GB of a host.)
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field

from ...local_backend import LocalProcess
from ...tiers.base import ExecResult

#: an ended command's output and result stay this long for late pollers
FORGET_AFTER = 60.0
#: output kept per command and stream for pollers, at most (and at most its sandbox's max_output);
#: past it, chunks are dropped (the result still has the output)
MAX_BUFFERED = 64 << 20
#: output kept for pollers by all the commands of one host together
MAX_HOST_BUFFERED = 256 << 20


class Budget:
    """Bytes of output a host holds for pollers, across its commands, up to ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        #: when output was last let go of (monotonic): the host's heap is trimmed for a while after
        self.freed_at = 0.0
        self._lock = threading.Lock()

    def take(self, size: int) -> int:
        """Up to ``size`` bytes of the bound (what is left of it): how many were granted."""
        with self._lock:
            granted = max(0, min(size, self.limit - self.held))
            self.held += granted
            return granted

    def give(self, size: int) -> None:
        with self._lock:
            self.held -= size


class EndedProcess:
    """What stays of an ended command's process: its pid, by which it is found again.  A signal,
    stdin or a resize sent to it reaches nothing, as it would reach nothing of the ended one."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid

    def _reaches_nothing(self, *_: object) -> None:
        pass

    write_stdin = close_stdin = send_signal = kill = resize = _reaches_nothing


@dataclass
class Command:
    """A command started through the host: its output not yet polled, for pollers."""

    #: set right after the start (output may arrive before it is); at its end, what stays of it
    process: LocalProcess | EndedProcess = field(default=None)  # type: ignore[assignment]
    #: output not handed out yet; the first is chunk number ``base`` of the command's output
    chunks: list[tuple[str, bytes]] = field(default_factory=list)
    base: int = 0
    #: bytes held per stream, at most ``limit`` each
    held: dict[str, int] = field(default_factory=dict)
    limit: int = MAX_BUFFERED
    #: the host's, shared by its commands
    budget: Budget | None = None
    #: some output was dropped, not kept for pollers
    truncated: bool = False
    #: the streams that output was dropped from (nothing more of them is kept)
    cut: set[str] = field(default_factory=set)
    result: ExecResult | None = None
    error: BaseException | None = None
    changed: threading.Condition = field(default_factory=threading.Condition)
    #: when it ended (monotonic): ended commands are forgotten after FORGET_AFTER
    ended_at: float | None = None
    forgotten: bool = False
    #: characters of output its result holds (none once handed out or let go of)
    kept: int = 0

    def feed(self, stream: str, data: bytes) -> None:
        """Keep what fits of ``data`` for pollers.  A stream cut once keeps nothing after: a
        poller gets a prefix of it, never output with a hole (a chunk that did not fit whole
        was dropped and a smaller one after it kept)."""
        with self.changed:
            if self.forgotten:
                return
            held = self.held.get(stream, 0)
            room = 0 if stream in self.cut else max(0, self.limit - held)
            keep = len(data) if room >= len(data) else room
            if keep and self.budget is not None:
                keep = self.budget.take(keep)
            if keep:
                self.chunks.append((stream, data if keep == len(data) else data[:keep]))
                self.held[stream] = held + keep
            if keep < len(data):
                self.truncated = True
                self.cut.add(stream)
            self.changed.notify_all()

    @property
    def end(self) -> int:
        """The number of the chunk after the last one kept."""
        return self.base + len(self.chunks)

    def drop(self, upto: int) -> None:
        """Let go of the chunks before number ``upto`` (handed out); the caller holds ``changed``."""
        gone = self.chunks[:max(0, upto - self.base)]
        if not gone:
            return
        del self.chunks[:len(gone)]
        self.base += len(gone)
        for stream, data in gone:
            self.held[stream] -= len(data)
        if self.budget is not None:
            self.budget.give(sum(len(data) for _, data in gone))

    def forget(self) -> None:
        """Let go of everything it holds (its sandbox was destroyed, or nobody came for it)."""
        with self.changed:
            self.forgotten = True
            self.drop(self.end)
            self.result = self.error = None  # (an error's traceback holds the frames that raised it)
            if self.ended_at is not None:
                # the process (and the output it kept for the result) and this command hold each
                # other (its output callback): a cycle Python frees only at its next collection
                self.process = None  # type: ignore[assignment]
            self.changed.notify_all()
        if self.budget is not None:
            self.budget.freed_at = time.monotonic()

    def finish(self) -> None:
        process = self.process
        assert isinstance(process, LocalProcess), "finish() waits for the live process, once"
        try:
            result = process.wait()
        except BaseException as exc:  # handed to the poller, raised there
            with self.changed:
                self.error, self.ended_at = exc, time.monotonic()
                self.changed.notify_all()
        else:
            with self.changed:
                self.result, self.ended_at = result, time.monotonic()
                self.kept = len(result.stdout) + len(result.stderr)
                self.changed.notify_all()
            del result
        with self.changed:
            # what the process kept for the result (its bytes, beside the result's text) goes now
            if self.process is not None:
                self.process = EndedProcess(process.pid)
        del process
        if self.forgotten:  # its sandbox was destroyed: nobody will poll it
            self.forget()

    def let_go_of_output(self) -> None:
        """Keep its result without the output (handed out, or past its sandbox's bound); the
        caller holds ``changed``.  The result object is a new one: one handed out stays whole."""
        if self.result is not None and self.kept:
            self.result = dataclasses.replace(self.result, stdout="", stderr="", truncated=True)
        self.kept = 0


@dataclass
class Poll:
    """What a poll hands back: new output from the cursor, the pid once known, the end."""

    chunks: list[tuple[str, bytes]]
    cursor: int
    pid: int | None
    done: bool
    result: ExecResult | None
    #: output was dropped before it was polled (the host's or the command's bound)
    truncated: bool = False




def bound_kept_results(commands: list[Command], limit: int) -> None:
    """Let go of the output of the oldest ended results not handed out, past ``limit``
    characters of output kept by all of them together (the newest first)."""
    ended = sorted((c for c in commands if c.kept and c.ended_at is not None),
                   key=lambda c: c.ended_at or 0.0, reverse=True)
    total = 0
    for command in ended:
        with command.changed:
            total += command.kept
            if total > limit:
                command.let_go_of_output()
