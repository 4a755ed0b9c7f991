"""The commands of a server's sandbox as processes: over the exec WebSocket (``start``), or by
pid through ``/commands`` (background commands, found again from anywhere)."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .errors import (
    ConnectionLost,
    InvalidSpec,
    SandboxClosed,
    SandboxError,
    SandboxNotFound,
    StdinNotTaken,
    error_from_code,
)
from .tiers.base import ExecResult
from .transport import CommandProcess, OutputCallback

if TYPE_CHECKING:
    from .http_transport import Client


#: raw stdin bytes per frame of the exec stream (base64 in JSON: a third more; the server's
#: WebSocket messages are bounded) and per POST to a background command (the server's bodies are
#: at most 32 MiB)
STDIN_FRAME = 4 << 20
STDIN_POST = 16 << 20


def stdin_posts(data: bytes) -> Iterator[bytes]:
    """``data`` as the bodies of posts to a background command's stdin (at most STDIN_POST each)."""
    for offset in range(0, len(data), STDIN_POST):
        yield data[offset : offset + STDIN_POST]


def ws_connect(url: str, headers: dict[str, str], max_size: int | None) -> Any:
    """A plain sync WebSocket connection (websockets 17 asks ``legacy=True`` for that; 13-16 know no such flag)."""
    import inspect

    from websockets.sync.client import connect

    extra: dict[str, Any] = {"legacy": True} if "legacy" in inspect.signature(connect).parameters else {}
    return connect(url, additional_headers=headers, open_timeout=30, max_size=max_size, **extra)


def stream_request(call: Any) -> dict[str, Any]:
    """The exec stream's first frame for ``call`` (a ``CommandCall``): on a terminal if it asks
    for one, with stdin acknowledged by the server (``ExecFrames._stdin_window``)."""
    body: dict[str, Any] = call.body()
    if call.pty is not None:
        body["pty"] = list(call.pty)
    body["stdin_acks"] = True
    return body


def result_of(frame: dict[str, Any]) -> ExecResult:
    frame = {k: v for k, v in frame.items() if k not in ("type", "sandbox_id")}
    return ExecResult(**frame)


def output_bytes(frame: dict[str, Any]) -> bytes:
    """An output frame's bytes: exact from ``data_b64`` when the server sent them so (output that
    is not UTF-8), else its text's."""
    raw = frame.get("data_b64")
    if isinstance(raw, str):
        return base64.b64decode(raw)
    return str(frame["data"]).encode()


def printed(result: ExecResult) -> list[tuple[str, bytes]]:
    """What a finished command printed, stream by stream (for a caller that attached late)."""
    return [(stream, getattr(result, stream).encode()) for stream in ("stdout", "stderr") if getattr(result, stream)]


class ExecFrames:
    """What the exec WebSocket says, frame by frame: the thread reader here and the asyncio one
    (corral.async_http) share it and differ only in how they wait and call back."""

    _sandbox_id: str
    _result: ExecResult | None
    _error: SandboxError | None
    pid: int | None

    #: stdin bytes sent that the server has not written to the command yet, and how many it lets
    #: be under way (the ``stdin_window`` of its "started" frame; None: a server that sends no
    #: acks).  Kept within it, stdin never fills the connection: a kill, a signal or the answer
    #: to the server's keepalive ping sent meanwhile go through at once (before, stdin the command
    #: was slow to take held them back, and the server closed the stream after its ping timeout)
    _stdin_unacked = 0
    _stdin_window: int | None = None

    def _take(self, raw: str | bytes) -> tuple[str, bytes | None]:
        """The frame's type, and for output its bytes; the pid, result or error is kept."""
        frame = json.loads(raw)
        kind = str(frame.get("type"))
        if kind == "started":
            self.pid = frame.get("pid")
            window = frame.get("stdin_window")
            self._stdin_window = window if isinstance(window, int) and window > 0 else None
        elif kind == "stdin_ack":
            taken = frame.get("bytes")
            self._stdin_acked(taken if isinstance(taken, int) else 0)
        elif kind in ("stdout", "stderr"):
            return kind, output_bytes(frame)
        elif kind == "result":
            self._result = result_of(frame)
        elif kind == "error" and frame.get("error") == StdinNotTaken.code:
            # the stream goes on: the next stdin call says so (its caller's data was not all sent)
            self._stdin_error = StdinNotTaken(str(frame.get("message", "")), sandbox_id=self._sandbox_id)
        elif kind == "error" and self._result is None:
            self._error = error_from_code(frame.get("error", ""), frame.get("message", ""), self._sandbox_id)
        return kind, None

    _stdin_error: StdinNotTaken | None = None

    def _stdin_acked(self, taken: int) -> None:
        self._stdin_unacked = max(0, self._stdin_unacked - taken)

    def _stdin_room_for(self, size: int) -> bool:
        window = self._stdin_window
        return window is None or self._stdin_unacked == 0 or self._stdin_unacked + size <= window

    def _raise_stdin_error(self) -> None:
        """The error of stdin sent before that the command did not take (the server dropped the
        rest of it), once."""
        error, self._stdin_error = self._stdin_error, None
        if error is not None:
            raise error

    @staticmethod
    def _stdin_chunks(data: bytes) -> Iterator[bytes]:
        for offset in range(0, len(data), STDIN_FRAME):
            yield data[offset : offset + STDIN_FRAME]

    @staticmethod
    def _stdin_frame(chunk: bytes) -> dict[str, Any]:
        # base64: any bytes, not only UTF-8
        return {"type": "stdin", "data_b64": base64.b64encode(chunk).decode()}

    def _lost(self, exc: Exception) -> None:
        if self._result is None and self._error is None:
            self._error = SandboxClosed(f"exec stream lost: {exc}", sandbox_id=self._sandbox_id)

    def _outcome(self) -> ExecResult:
        if self._result is None:
            raise self._error or SandboxClosed("exec stream ended without a result", sandbox_id=self._sandbox_id)
        return self._result


class StreamProcess(ExecFrames, CommandProcess):
    """A command streaming over the exec WebSocket: output to ``on_output`` as it comes."""

    def __init__(self, client: Client, sandbox_id: str, request: dict[str, Any],
                 on_output: OutputCallback | None) -> None:
        self._on_output = on_output
        self._sandbox_id = sandbox_id
        self._result: ExecResult | None = None
        self._error: SandboxError | None = None
        self._done = threading.Event()
        self._started = threading.Event()
        #: notified on each stdin ack and when the stream ends
        self._stdin_room = threading.Condition()
        self.pid = None
        try:
            self._ws = ws_connect(client.ws_url(f"{client.sandbox_path(sandbox_id)}/exec/stream"),
                                  client.headers, 64 << 20)
        except Exception as exc:
            raise ConnectionLost(f"cannot open the exec stream at {client.url}: {exc}",
                                 sandbox_id=sandbox_id) from exc
        try:
            self._ws.send(json.dumps(request))
        except Exception:
            pass  # refused before the request was read (not found, unauthorized): the reader gets the error frame
        self._reader = threading.Thread(target=self._read, name="corral-remote-exec", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for raw in self._ws:
                kind, data = self._take(raw)
                if kind == "started":
                    self._started.set()
                elif data is not None and self._on_output is not None:
                    self._on_output(kind, data)
        except Exception as exc:
            self._lost(exc)
        finally:
            self._started.set()
            self._done.set()
            with self._stdin_room:
                self._stdin_room.notify_all()

    def _stdin_acked(self, taken: int) -> None:
        with self._stdin_room:
            super()._stdin_acked(taken)
            self._stdin_room.notify_all()

    def wait_started(self, timeout: float) -> None:
        self._started.wait(timeout)

    def _send(self, frame: dict[str, Any]) -> None:
        if self._done.is_set():
            return
        try:
            self._ws.send(json.dumps(frame))
        except Exception:
            pass

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def write_stdin(self, data: bytes) -> None:
        self._raise_stdin_error()
        self._started.wait()  # the server's window comes with "started"
        for chunk in self._stdin_chunks(data):
            with self._stdin_room:
                while not self._stdin_room_for(len(chunk)) and not self._done.is_set() and self._stdin_error is None:
                    self._stdin_room.wait()
                self._stdin_unacked += len(chunk)
            self._raise_stdin_error()
            self._send(self._stdin_frame(chunk))

    def close_stdin(self) -> None:
        self._send({"type": "stdin_close"})

    def send_signal(self, signum: int) -> None:
        self._send({"type": "signal", "signal": int(signum)})

    def kill(self) -> None:
        self._send({"type": "kill"})

    def resize(self, rows: int, cols: int) -> None:
        self._send({"type": "resize", "rows": int(rows), "cols": int(cols)})

    def wait(self, on_output: OutputCallback | None = None) -> ExecResult:
        self._done.wait()
        self._ws.close()
        result = self._outcome()
        if on_output is not None:  # asked for after the fact: what it printed
            for stream, data in printed(result):
                on_output(stream, data)
        return result


class BackgroundProcess(CommandProcess):
    """A command running in the background on the server, by pid (``/v1/sandboxes/ID/commands/PID``)."""

    def __init__(self, client: Client, sandbox_id: str, pid: int, on_output: OutputCallback | None = None) -> None:
        self._client = client
        self._path = f"{client.sandbox_path(sandbox_id)}/commands/{pid}"
        self._sandbox_id = sandbox_id
        self.pid = pid
        self._result: ExecResult | None = None
        self._lock = threading.Lock()
        self._follower: threading.Thread | None = None
        self._error: SandboxError | None = None
        if on_output is not None:  # the caller's callbacks get its output as it comes, as a local start gives it
            self._follower = threading.Thread(target=self._follow, args=(on_output,), daemon=True,
                                              name="corral-remote-background")
            self._follower.start()

    def _follow(self, on_output: OutputCallback) -> None:
        try:
            self._attach(on_output)
        except SandboxError as exc:
            self._error = exc

    @property
    def done(self) -> bool:
        if self._result is not None:
            return True
        return all(c.pid != self.pid for c in self._commands())

    def _commands(self) -> list[Any]:
        from .commands import CommandInfo

        data = self._client.request("GET", self._path.rsplit("/", 1)[0])
        return [CommandInfo(**c) for c in data["commands"]]

    def write_stdin(self, data: bytes) -> None:
        try:
            for body in stdin_posts(data):
                self._client.request("POST", f"{self._path}/stdin", content=body,
                                     headers={"content-type": "application/octet-stream"})
        except SandboxNotFound as exc:
            raise InvalidSpec(str(exc), sandbox_id=self._sandbox_id) from None

    def close_stdin(self) -> None:
        self._client.request("POST", f"{self._path}/stdin", params={"close": "true"}, content=b"",
                             headers={"content-type": "application/octet-stream"})

    def send_signal(self, signum: int) -> None:
        self._client.request("POST", f"{self._path}/signal", json={"signal": int(signum)})

    def kill(self) -> None:
        self.kill_if_running()

    def kill_if_running(self) -> bool:
        """Kill it (its whole tree); False if it had already ended."""
        try:
            self._client.request("DELETE", self._path)
            return True
        except SandboxNotFound:
            return False

    def resize(self, rows: int, cols: int) -> None:
        raise InvalidSpec("resize: a background command has no terminal", sandbox_id=self._sandbox_id)

    def wait(self, on_output: OutputCallback | None = None) -> ExecResult:
        """Attach, get what it printed so far and then as it comes (to ``on_output``), and its result."""
        if self._follower is not None:
            self._follower.join()
            if self._error is not None:
                raise self._error
        if self._result is None or on_output is not None:
            self._attach(on_output)
        assert self._result is not None
        return self._result

    def _attach(self, on_output: OutputCallback | None) -> None:
        try:
            ws = ws_connect(self._client.ws_url(f"{self._path}/stream"), self._client.headers, None)
        except Exception as exc:
            raise ConnectionLost(f"cannot attach to command {self.pid}: {exc}", sandbox_id=self._sandbox_id) from exc
        from websockets.exceptions import ConnectionClosed

        with ws:
            try:
                for raw in ws:
                    kind, data, result = attached_frame(raw, self._sandbox_id)
                    if result is not None:
                        self._result = result
                        return
                    if data is not None and on_output is not None:
                        on_output(kind, data)
            except (ConnectionClosed, OSError) as exc:  # the server went, or the line to it
                raise lost_attachment(self.pid, self._sandbox_id, exc) from exc
        raise SandboxClosed("the command's stream ended without a result", sandbox_id=self._sandbox_id)


def attached_frame(raw: str | bytes, sandbox_id: str) -> tuple[str, bytes | None, ExecResult | None]:
    """One frame of an attached background command: (stream, its bytes, None) for output,
    (kind, None, the result) at the end, (kind, None, None) for others; an error frame is raised."""
    frame: dict[str, Any] = json.loads(raw)
    kind = str(frame.get("type"))
    if kind in ("stdout", "stderr"):
        return kind, output_bytes(frame), None
    if kind == "result":
        return kind, None, result_of(frame)
    if kind == "error":
        raise error_from_code(frame.get("error", ""), frame.get("message", ""), sandbox_id)
    return kind, None, None


def lost_attachment(pid: int | None, sandbox_id: str, exc: BaseException) -> ConnectionLost:
    return ConnectionLost(f"lost the stream of command {pid}: {exc}", sandbox_id=sandbox_id)
