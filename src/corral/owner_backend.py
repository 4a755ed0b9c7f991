"""The caller's side of :mod:`corral.owner_link`: another process's embedded sandbox,
driven through the process that owns it (one Unix-socket connection per call)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConnectionLost, SandboxNotFound, StdinNotTaken, error_from_code
from .lifecycle import SandboxInfo
from .owner_link import (
    CONNECT_TIMEOUT,
    MAX_REQUEST,
    STDIN_LINK_FRAME,
    b64,
    b64_size,
    call_to_dict,
    read_frames,
    send_frame,
    socket_path,
    unb64,
)
from .ports import ExposedPort
from .tiers.base import ExecResult, FileEntry
from .transport import INLINE_STDIN, CommandCall, CommandProcess, OutputCallback, SandboxBackend, split_stdin

if TYPE_CHECKING:
    from .commands import CommandInfo
    from .egress.audit import AuditEvent
    from .execution import Execution
    from .snapshots import Snapshot


class _Call:
    """One open call to an owner."""

    def __init__(self, path: Path, sandbox_id: str, op: str, args: dict[str, Any],
                 answer_limit: int = MAX_REQUEST) -> None:
        self.sandbox_id = sandbox_id
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(CONNECT_TIMEOUT)
        try:
            self.sock.connect(str(path))
        except OSError as exc:
            self.sock.close()
            raise SandboxNotFound(f"sandbox {sandbox_id}'s owner does not answer ({exc.strerror})",
                                  sandbox_id=sandbox_id) from None
        self.sock.settimeout(None)  # commands run as long as their own timeout
        self.lock = threading.Lock()
        try:
            send_frame(self.sock, {"id": sandbox_id, "op": op, "args": args})
        except OSError:
            pass  # refused before it read it all (too large): its answer says why, or there is none
        self.frames = read_frames(self.sock, answer_limit)

    def answer(self, on_frame: Callable[[dict[str, Any]], None] | None = None) -> Any:
        """Frames until the final one; its value, or its error raised."""
        with self.sock:
            for frame in self.frames:
                if "ok" in frame:
                    return frame["ok"]
                if "error" in frame:
                    raise error_from_code(frame["error"], frame.get("message", ""), self.sandbox_id)
                if on_frame is not None:
                    on_frame(frame)
        raise ConnectionLost(f"sandbox {self.sandbox_id}'s owner went away during the call",
                             sandbox_id=self.sandbox_id)

    def control(self, frame: dict[str, Any]) -> None:
        try:
            send_frame(self.sock, frame, self.lock)
        except OSError:
            raise ConnectionLost(f"sandbox {self.sandbox_id}'s owner went away", sandbox_id=self.sandbox_id) from None


class OwnerProcess(CommandProcess):
    """A command of another process's sandbox, followed over one owner-link call."""

    def __init__(self, call: _Call, on_output: OutputCallback | None) -> None:
        self._call = call
        self._on_output = on_output
        self._started = threading.Event()
        self._finished = threading.Event()
        self._result: ExecResult | None = None
        self._error: BaseException | None = None
        #: stdin sent that the owner has not written to the command yet, and how much it lets be
        #: under way (None: an owner of an older version, which sends no acks); notified on acks
        self._stdin_unacked = 0
        self._stdin_window: int | None = None
        self._stdin_room = threading.Condition()
        threading.Thread(target=self._read, name="corral-owner-process", daemon=True).start()
        self._started.wait(CONNECT_TIMEOUT)
        if self._error is not None:
            raise self._error

    def _read(self) -> None:
        def frame(data: dict[str, Any]) -> None:
            if "started" in data:
                self.pid = data["started"]
                window = data.get("stdin_window")
                self._stdin_window = window if isinstance(window, int) and window > 0 else None
                self._started.set()
            elif "stdin_ack" in data:
                with self._stdin_room:
                    self._stdin_unacked = max(0, self._stdin_unacked - int(data["stdin_ack"]))
                    self._stdin_room.notify_all()
            elif "out" in data and self._on_output is not None:
                self._on_output(data["out"], unb64(data["data"]))
            elif "stdin_error" in data:
                self._stdin_error = StdinNotTaken(str(data["stdin_error"]), sandbox_id=self._call.sandbox_id)

        try:
            self._result = ExecResult(**self._call.answer(frame))
        except BaseException as exc:  # handed to the waiter
            self._error = exc
        finally:
            self._finished.set()
            self._started.set()
            with self._stdin_room:
                self._stdin_room.notify_all()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    #: stdin sent before that the command did not take (the owner's write gave up): raised by the next call
    _stdin_error: StdinNotTaken | None = None

    def _raise_stdin_error(self) -> None:
        error, self._stdin_error = self._stdin_error, None
        if error is not None:
            raise error

    def write_stdin(self, data: bytes) -> None:
        # in frames the owner takes, each sent once the owner has room for it: a kill or signal
        # sent meanwhile is never held behind stdin the command is slow to take
        self._raise_stdin_error()
        for offset in range(0, len(data), STDIN_LINK_FRAME):
            chunk = data[offset : offset + STDIN_LINK_FRAME]
            with self._stdin_room:
                while not self._room_for(len(chunk)):
                    self._stdin_room.wait()
                self._stdin_unacked += len(chunk)
            self._raise_stdin_error()
            if self.done:
                return  # as a pipe to a command that ended
            try:
                self._call.control({"stdin": b64(chunk)})
            except ConnectionLost:
                # the command ended as this went out (the owner closes the call with its result)
                if self._finished.wait(CONNECT_TIMEOUT) and self._result is not None:
                    return
                raise

    def _room_for(self, size: int) -> bool:
        window = self._stdin_window
        return (window is None or not self._stdin_unacked or self._stdin_unacked + size <= window
                or self.done or self._stdin_error is not None)

    def close_stdin(self) -> None:
        self._raise_stdin_error()
        self._call.control({"close_stdin": True})

    def send_signal(self, signum: int) -> None:
        self._call.control({"signal": signum})

    def kill(self) -> None:
        if not self.done:
            with contextlib.suppress(ConnectionLost):
                self._call.control({"kill": True})

    def resize(self, rows: int, cols: int) -> None:
        self._call.control({"resize": [rows, cols]})

    def wait(self, on_output: OutputCallback | None = None) -> ExecResult:
        self._finished.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        if on_output is not None and self._on_output is None:  # attached late: replayed, as locally
            for stream, text in (("stdout", self._result.stdout), ("stderr", self._result.stderr)):
                if text:
                    on_output(stream, text.encode())
        return self._result


class OwnerBackend(SandboxBackend):
    """A sandbox of another live process of this host, driven through that process."""

    def __init__(self, root: Path, owner_pid: int, sandbox_id: str) -> None:
        from .spec import SandboxSpec

        self.id = sandbox_id
        self.owner_pid = owner_pid
        self.path = socket_path(root, owner_pid)
        hello = self._call("hello")
        self.spec = SandboxSpec.from_dict(hello["spec"])
        self._metadata: dict[str, str] = dict(hello["metadata"])
        self.closed = False

    def _open(self, op: str, answer_limit: int = MAX_REQUEST, **args: Any) -> _Call:
        return _Call(self.path, self.id, op, args, answer_limit)

    def _call(self, op: str, answer_limit: int = MAX_REQUEST, **args: Any) -> Any:
        return self._open(op, answer_limit, **args).answer()

    # -- commands ---------------------------------------------------------------
    def start(self, call: CommandCall, on_output: OutputCallback | None) -> OwnerProcess:
        return OwnerProcess(self._open("start", call=call_to_dict(call)), on_output)

    def run(self, call: CommandCall, stdin: bytes | None, on_output: OutputCallback | None,
            started: Callable[[CommandProcess], None] | None = None) -> ExecResult:
        if started is not None or (stdin is not None and len(stdin) > INLINE_STDIN):
            return super().run(call, stdin, on_output, started)  # started, then stdin in frames

        def frame(data: dict[str, Any]) -> None:
            if "out" in data and on_output is not None:
                on_output(data["out"], unb64(data["data"]))

        opened = self._open("run", call=call_to_dict(call), stdin=b64(stdin) if stdin is not None else None,
                            stream=on_output is not None)
        return ExecResult(**opened.answer(frame))

    def start_background(self, call: CommandCall, stdin: bytes | None,
                         on_output: OutputCallback | None) -> OwnerProcess:
        inline, after = split_stdin(stdin)
        process = OwnerProcess(self._open("start_background", call=call_to_dict(call),
                                          stdin=b64(inline) if inline is not None else None), on_output)
        if after is not None:
            process.write_stdin(after)
        return process

    def commands(self) -> list[CommandInfo]:
        from .commands import CommandInfo

        return [CommandInfo(**c) for c in self._call("commands")]

    def command(self, pid: int) -> OwnerProcess:
        return OwnerProcess(self._open("attach", pid=pid), None)

    def kill_command(self, pid: int) -> bool:
        return bool(self._call("kill_command", pid=pid))

    # -- files --------------------------------------------------------------------
    def read_file(self, path: str, max_bytes: int) -> bytes:
        # the answer is the file in base64: as long as the largest file the caller accepts
        return unb64(self._call("read_file", b64_size(max_bytes) + 4096, path=path, max_bytes=max_bytes))

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        self._call("write_file", path=path, data=b64(data), mode=mode)

    def list_dir(self, path: str) -> list[FileEntry]:
        return [FileEntry(**e) for e in self._call("list_dir", path=path)]

    def stat(self, path: str) -> FileEntry:
        return FileEntry(**self._call("stat", path=path))

    def remove(self, path: str, recursive: bool) -> None:
        self._call("remove", path=path, recursive=recursive)

    def make_dir(self, path: str, mode: int) -> None:
        self._call("make_dir", path=path, mode=mode)

    # -- the sandbox --------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def info(self) -> SandboxInfo:
        return SandboxInfo(**self._call("info"))

    def set_timeout(self, seconds: float) -> None:
        self._call("set_timeout", seconds=seconds)

    def alive(self) -> bool:
        if self.closed:
            return False
        try:
            return bool(self._call("alive"))
        except SandboxNotFound:
            return False

    @property
    def paused(self) -> bool:
        return not self.closed and bool(self._call("paused"))

    def pause(self, to_disk: bool = False) -> None:
        self._call("pause", to_disk=to_disk)

    def resume(self) -> None:
        self._call("resume")

    def run_code(self, sandbox: Any, code: str, *, language: str | None, context: str | None,
                 timeout: float | None, envs: dict[str, str] | None, callbacks: dict[str, Any]) -> Execution:
        from .execution import Execution
        from .interpreter import replay_callbacks

        execution = Execution.from_dict(self._call("run_code", code=code, language=language, context=context,
                                                   timeout=timeout, envs=envs))
        replay_callbacks(execution, callbacks)
        return execution

    def create_code_context(self, language: str, cwd: str | None) -> str:
        return str(self._call("create_code_context", language=language, cwd=cwd))

    def code_contexts(self) -> list[tuple[str, str, str | None]]:
        return [(name, language, cwd) for name, language, cwd in self._call("code_contexts")]

    def remove_code_context(self, name: str) -> None:
        self._call("remove_code_context", name=name)

    def audit(self) -> list[AuditEvent]:
        from .egress.audit import AuditEvent

        return [AuditEvent(**event) for event in self._call("audit")]

    def expose_port(self, port: int, unix: bool, other_users: Sequence[int] = ()) -> tuple[ExposedPort, Callable[[], None]]:
        answer = self._call("expose_port", port=port, unix=unix, other_users=list(other_users), closable=True)
        if "forward" not in answer:  # an owner of an older version: its forwards close with the sandbox only
            return ExposedPort(**answer), lambda: None
        forward_id = int(answer["forward"])
        return ExposedPort(**answer["port"]), lambda: self._close_port(forward_id)

    def _close_port(self, forward_id: int) -> None:
        with contextlib.suppress(SandboxNotFound):  # the sandbox is gone, and its forwards with it
            self._call("close_port", forward=forward_id)

    def snapshot(self) -> Snapshot:
        from .snapshots import Snapshot

        return Snapshot.from_dict(self._call("snapshot"))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._call("close")
        except SandboxNotFound:
            pass
        except ConnectionLost:
            # the owner may exit as soon as its sandbox is gone, before it answers: that is a success
            if self._owner_alive():
                raise

    def _owner_alive(self) -> bool:
        try:
            os.kill(self.owner_pid, 0)
        except ProcessLookupError:
            return False
        return self.path.exists()
