"""One command run by the agent, seen from the host (:class:`AgentProcess`): its output,
its exit, and what the host sends it (stdin, signals, a terminal's size)."""

from __future__ import annotations

import os
import signal
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...errors import ContainmentFailed, SandboxPaused, StdinNotTaken
from ..base import ExecRequest, ExecResult, OutputCallback, Process, keep_output
from .frames import STDIN_WINDOW, T_GO, T_RESIZE, T_SIGNAL, T_STDIN, T_STDIN_EOF

if TYPE_CHECKING:
    from .agent import AgentChannel


class AgentProcess(Process):
    def __init__(
        self,
        channel: AgentChannel,
        ident: int,
        request: ExecRequest,
        on_output: OutputCallback | None,
        place: Callable[[int], bool | None],
        kill: Callable[[], None],
        finish: Callable[[AgentProcess], None] | None = None,
        spare: int | None = None,
    ) -> None:
        self._channel = channel
        #: the placed spare the command was sent to: the agent lets it go without a GO
        self._spare = spare
        #: stdin's end of file went to the agent (with the command, or by close_stdin)
        self._eof_sent = False
        self._finish = finish
        self._finished = threading.Lock()
        self._result: ExecResult | None = None
        self._id = ident
        self._request = request
        self._on_output = on_output
        self._place = place
        self._kill = kill
        self._start = time.monotonic()
        self._paused_before = channel.pause_clock.paused_total()
        self._done = threading.Event()
        #: stdin bytes sent and not yet acknowledged by the agent (at most STDIN_WINDOW)
        self._stdin_unacked = 0
        self._stdin_room = threading.Condition()
        self._out = {"stdout": bytearray(), "stderr": bytearray()}
        self._truncated = False
        self._status: int | None = None
        self._error = ""
        #: why the command could not be placed in the sandbox's cgroups (it was killed before exec)
        self._unplaced = ""
        #: its process was gone when placed: held before exec, it never ran the user's code
        self._gone_before_placed = False
        #: T_STARTED came: the command was placed (or refused) once, and is never placed again
        self._started_once = False
        #: signals the caller sent (kill() is 9): a held process they ended is not a containment failure
        self._requested_signals: set[int] = set()
        #: send_signal's signals, and those the agent said it delivered (T_SIGNALED); under
        #: _stdin_room, which the command's end notifies too
        self._signals_sent = 0
        self._signals_delivered = 0
        self._timed_out = False
        self.pid: int | None = None
        #: set by the tier's ``finish`` hook (from cgroup counters)
        self.oom_killed = False

    # reader-thread callbacks: each says whether the frame changed anything (AgentChannel holds
    # those that did not to STRAY_FRAME_RATE, as frames for no request)
    def _started(self, nspid: int) -> bool:
        if self._started_once:
            # a guest root repeating it for its own command: each one was placed again (the
            # microVM sent a cgroup write and a GO back for every 9 bytes it wrote)
            return False
        self._started_once = True
        if nspid == self._spare:
            self.pid = nspid  # placed and checked before it was sent; the agent let it go
            return True
        reason = "its process is gone"
        try:
            # None means "nothing to place" (a tier whose kill tree lives elsewhere)
            placed = self._place(nspid) is not False
            self._gone_before_placed = not placed
        except ProcessLookupError:
            placed, self._gone_before_placed = False, True
        except Exception as exc:  # any failure to place means the command must not run
            placed, reason = False, str(exc)
        if placed:
            self._channel.send(T_GO, self._id)
        else:
            # fail closed: a command outside its cgroups would escape the limits and outlive a timeout
            self._unplaced = f"could not place the command in the sandbox's cgroups ({reason}); it was not run"
            self._send_signal_frame(9)
        # published only now: a signal sent once the pid is known reaches a placed, running process
        self.pid = nspid
        return True

    def _output(self, stream: str, chunk: bytes) -> bool:
        kept = self._out[stream]
        if self._on_output is None and self._truncated and len(kept) >= self._request.max_output:
            return False  # (the agent sends one byte past the cap, no more: the rest is forged)
        if keep_output(kept, chunk, self._request.max_output):
            self._truncated = True
        if self._on_output is not None:
            try:
                self._on_output(stream, chunk)
            except Exception:  # a caller's callback must not kill the reader
                pass
        return True

    def _stdin_taken(self, count: int) -> int:
        """The bytes of stdin this acknowledges: 0 if none was waiting for it."""
        with self._stdin_room:
            taken = min(count, self._stdin_unacked)
            if taken:
                self._stdin_unacked -= taken
                self._stdin_room.notify_all()
            return taken

    def _signal_delivered(self) -> bool:
        with self._stdin_room:
            if self._signals_delivered >= self._signals_sent:
                return False  # the agent answers each signal sent once: this answers none
            self._signals_delivered += 1
            self._stdin_room.notify_all()
            return True

    def _set_done(self) -> None:
        self._done.set()
        with self._stdin_room:  # a writer waiting for room stops: nobody will read what it holds
            self._stdin_room.notify_all()

    def _exited(self, status: int) -> None:
        self._status = status
        self._set_done()

    def _failed(self, message: str) -> None:
        self._error = message
        self._set_done()

    def _agent_gone(self) -> None:
        if not self._done.is_set():
            self._error = self._error or "the sandbox stopped while the command ran"
            self._set_done()

    def stopped_by_host(self, why: str) -> None:
        """The host is ending the sandbox under this command (a tier's backstop): ``why`` is what
        its result says, rather than only that the sandbox stopped."""
        if not self._done.is_set():
            self._error = self._error or f"the sandbox was stopped: {why}"

    # Process API
    def write_stdin(self, data: bytes) -> None:
        """Send ``data`` to the command's stdin, waiting as a pipe's writer does while the command
        has not taken what was sent before (at most ``STDIN_WINDOW`` bytes wait in the sandbox).
        The wait ends with the command, and at its timeout (which then ends it); what it did not
        take by then is dropped, as a pipe's is when its reader goes away.  Without any progress
        for ``WRITE_TIMEOUT``: ``StdinNotTaken``."""
        from .agent import WRITE_TIMEOUT  # (read at each call: tests shorten it)

        if self._channel.pause_clock.paused:  # its agent is frozen: as every other call, not a wait
            raise SandboxPaused("the sandbox is paused: resume() it first")
        view = memoryview(data)
        while view and not self._done.is_set():
            with self._stdin_room:
                unacked, progress = self._stdin_unacked, time.monotonic()
                while (room := STDIN_WINDOW - self._stdin_unacked) <= 0 and not self._done.is_set():
                    now = time.monotonic()
                    if self._stdin_unacked < unacked or self._channel.pause_clock.paused:
                        unacked, progress = self._stdin_unacked, now  # (paused: not the command's doing)
                    if now - progress > WRITE_TIMEOUT:
                        raise StdinNotTaken(f"the command took none of its stdin for {WRITE_TIMEOUT:.0f} s: "
                                            f"{len(view)} bytes were not sent")
                    remaining = self._deadline() - now
                    if remaining <= 0:
                        return  # wait() ends it as timed out
                    self._stdin_room.wait(min(remaining, 1.0, WRITE_TIMEOUT))
                if self._done.is_set():
                    return
                chunk = bytes(view[:room])
                self._stdin_unacked += len(chunk)
            self._channel.send(T_STDIN, self._id, chunk)
            view = view[len(chunk):]

    def close_stdin(self) -> None:
        if not self._eof_sent:
            self._eof_sent = True
            self._channel.send(T_STDIN_EOF, self._id)

    def send_signal(self, signum: int) -> None:
        """A caller's signal: refused while the sandbox is paused (its agent is frozen, and the
        caller's thread would wait for it: a server's threads did, every tenant's work with them)."""
        if self._channel.pause_clock.paused:
            raise SandboxPaused("the sandbox is paused: resume() it first")
        self.deliver_signal(signum)

    def deliver_signal(self, signum: int) -> None:
        """The tier's own signal (a kill's): sent even while the sandbox is paused, when the agent
        delivers it at the resume."""
        self._requested_signals.add(signum)
        self._send_signal_frame(signum)

    def _send_signal_frame(self, signum: int, wait: bool = True) -> bool:
        """T_SIGNAL, counted: the agent answers every one it gets with T_SIGNALED, so a kill's
        answer must not count as that of a signal sent before it.  ``wait`` False: not sent (False)
        when the agent reads nothing now."""
        with self._stdin_room:
            self._signals_sent += 1
        frame = struct.pack("<i", signum)
        sent = True
        if wait:
            self._channel.send(T_SIGNAL, self._id, frame)
        else:
            sent = self._channel.try_send(T_SIGNAL, self._id, frame)
        if not sent:
            with self._stdin_room:
                self._signals_sent -= 1
        return sent

    def signals_delivered(self, timeout: float) -> bool:
        """The agent delivers a signal when it next runs, and it runs in the sandbox's cgroups: a
        command keeping their CPU quota spent kept it from doing so for up to 8.5 s (at 0.25 CPU)."""
        if not self._channel.acks_signals:
            return True  # (an older agent, that does not say)
        deadline = time.monotonic() + timeout
        with self._stdin_room:
            while self._signals_delivered < self._signals_sent and not self._done.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or self._channel.closed.is_set():
                    return False
                self._stdin_room.wait(left)
        return True

    def kill(self) -> None:
        self._requested_signals.add(9)
        # the cgroup kill below misses a command not yet placed in its leaf; the agent's kill
        # reaches it while it is held, so it never runs (an agent that reads nothing now is not
        # waited for: the cgroup kill does not need it)
        self._send_signal_frame(9, wait=False)
        self._kill()

    def _containment_failed(self) -> bool:
        """Placement failed, and not because the caller's own signal ended the held process."""
        if not self._unplaced:
            return False
        status = self._status
        ended_by_caller = (
            self._gone_before_placed and status is not None and os.WIFSIGNALED(status)
            and os.WTERMSIG(status) in self._requested_signals
        )
        return not ended_by_caller

    def resize(self, rows: int, cols: int) -> None:
        self._channel.send(T_RESIZE, self._id, struct.pack("<HH", rows, cols))

    def killed_unasked(self) -> bool:
        """It ended by SIGKILL -- or with 137, a shell's word for a child of its killed so -- that
        neither its timeout nor its caller sent: what the kernel's OOM killer does to a command
        (a tier's ``finish`` hook reads this beside the sandbox's OOM count, which any process of
        the sandbox raises: a background process left by another command, a command of another
        thread)."""
        status = self._status
        if status is None or self._timed_out or signal.SIGKILL in self._requested_signals:
            return False
        if os.WIFSIGNALED(status):
            return os.WTERMSIG(status) == signal.SIGKILL
        return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGKILL

    @property
    def request(self) -> ExecRequest:
        return self._request

    def seconds_left(self) -> float:
        """Of its timeout (negative once past it); the sandbox's paused time does not count."""
        return self._deadline() - time.monotonic()

    def _deadline(self) -> float:
        # moved on by every second the sandbox spent paused since the command started
        paused = self._channel.pause_clock.paused_total() - self._paused_before
        return self._start + self._request.timeout + paused

    def wait(self) -> ExecResult:
        while not self._done.is_set():
            remaining = self._deadline() - time.monotonic()
            if remaining <= 0:
                break
            self._done.wait(remaining)
        if not self._done.is_set():
            self._timed_out = True
            self._kill()
            if not self._done.wait(5.0):
                self._error = "the command did not stop after being killed"
        with self._finished:
            if self._result is None:
                if self._finish is not None:
                    self._finish(self)
                self._result = self.result()
        if self._containment_failed():
            raise ContainmentFailed(self._unplaced, self._result)
        return self._result

    def kept_output(self) -> dict[str, bytes]:
        return {stream: bytes(data) for stream, data in self._out.items()}

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> ExecResult:
        status = self._status
        signal_number: int | None = None
        if status is None:
            exit_code = -1
        elif os.WIFSIGNALED(status):
            signal_number = os.WTERMSIG(status)
            exit_code = 128 + signal_number
        else:
            exit_code = os.WEXITSTATUS(status)
        stderr = self._out["stderr"].decode(errors="replace")
        unplaced = self._unplaced if self._containment_failed() else ""
        error = unplaced or self._error
        if error and (status is None or unplaced):
            stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + f"corral: {error}\n"
        if self._timed_out:
            exit_code = 124
        return ExecResult(
            exit_code=exit_code,
            stdout=self._out["stdout"].decode(errors="replace"),
            stderr=stderr,
            duration_ms=round((time.monotonic() - self._start) * 1000, 3),
            timed_out=self._timed_out,
            oom_killed=self.oom_killed,
            signal=signal_number,
            truncated=self._truncated,
        )
