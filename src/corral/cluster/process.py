"""A command of a cluster sandbox: its output long-polled from the node's host actor.

Each poll is one actor call that returns the output produced since the caller's cursor, as soon
as there is some (or after a second without any), so output reaches ``on_output`` within a round
trip of being produced, and a node lost mid-command ends the wait with :class:`SandboxLost`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ..tiers.base import ExecResult
from ..transport import CommandProcess, OutputCallback

if TYPE_CHECKING:
    from .transport import ClusterBackend

#: how long one poll waits on the node for output or the end
POLL_WAIT = 1.0


class ClusterProcess(CommandProcess):
    def __init__(self, backend: ClusterBackend, handle: int, pid: int | None,
                 on_output: OutputCallback | None) -> None:
        self._backend = backend
        self._handle = handle
        self.pid = pid
        self._result: ExecResult | None = None
        self._error: BaseException | None = None
        self._reader: threading.Thread | None = None
        if on_output is not None:
            self._reader = threading.Thread(target=self._stream, args=(on_output,), name="corral-cluster-exec",
                                            daemon=True)
            self._reader.start()

    def _poll(self, cursor: int, wait: float, output: bool) -> Any:
        poll = self._backend.call("poll", self._handle, cursor, wait, output)
        if poll.pid is not None:
            self.pid = poll.pid
        return poll

    def _stream(self, on_output: OutputCallback) -> None:
        cursor = 0
        try:
            while True:
                poll = self._poll(cursor, POLL_WAIT, True)
                for stream, data in poll.chunks:
                    on_output(stream, data)
                cursor = poll.cursor
                if poll.done:
                    self._result = poll.result
                    return
        except BaseException as exc:  # raised by wait()
            self._error = exc

    @property
    def done(self) -> bool:
        if self._result is not None or self._error is not None:
            return True
        if self._reader is not None:
            return not self._reader.is_alive()
        poll = self._poll(0, 0.0, False)
        if poll.done:
            self._result = poll.result
        return bool(poll.done)

    def write_stdin(self, data: bytes) -> None:
        self._backend.call("stdin", self._handle, bytes(data))

    def close_stdin(self) -> None:
        self._backend.call("stdin", self._handle, None)

    def send_signal(self, signum: int) -> None:
        self._backend.call("signal", self._handle, signum)

    def kill(self) -> None:
        self._backend.call("kill_handle", self._handle)

    def resize(self, rows: int, cols: int) -> None:
        self._backend.call("resize", self._handle, rows, cols)

    def wait(self, on_output: OutputCallback | None = None) -> ExecResult:
        if self._reader is not None:
            self._reader.join()
        elif self._result is None:
            cursor = 0
            while True:  # attached late with a callback: everything it printed, then what comes
                poll = self._poll(cursor, POLL_WAIT, on_output is not None)
                if on_output is not None:
                    for stream, data in poll.chunks:
                        on_output(stream, data)
                cursor = poll.cursor
                if poll.done:
                    self._result = poll.result
                    break
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
