"""Another process's embedded sandbox, driven through its owner.

An embedded sandbox's agent channel, threads and cgroups belong to the process that
created it.  So that ``Sandbox.connect(id)`` and ``Sandbox.kill(id)`` work from any
process on the host (as they do through a server), each owner listens on a Unix socket
of its own, ``<state>/owners/<pid>.sock`` (directory 0700, socket 0600; the peer's uid is
checked with ``SO_PEERCRED``: only the owner's uid, or root, may drive its sandboxes), and
carries out the calls of :class:`OwnerBackend` on its sandboxes.

One call is one connection: a JSON request line, then JSON answer lines -- output frames
(``out``), the pid of a started command (``started``), and one final ``ok`` or ``error``
(the :mod:`corral.errors` code, raised again as the same class).  A started command's
connection also carries the caller's stdin, signals, kill and resize the other way.
A connection's end never kills a background command; it kills a foreground one the
caller can no longer wait for.

The listener runs from this process's first sandbox until the process exits; a killed
owner's socket is removed by ``gc`` (``corral.registry``), which a process's first create runs.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConnectionLost, InvalidSpec, SandboxError, SandboxNotFound, error_from_code
from .lifecycle import LIVE, SandboxInfo
from .ports import ExposedPort
from .tiers.base import ExecResult, FileEntry
from .transport import CommandCall, CommandProcess, OutputCallback, SandboxBackend

if TYPE_CHECKING:
    from .commands import CommandInfo
    from .egress.audit import AuditEvent
    from .interpreter import Execution
    from .local_transport import LocalBackend

#: a request line (a file written through the link is in it, base64): a server's upload cap
MAX_REQUEST = 96 << 20
#: how long an exiting owner waits for a kill by id it is carrying out
KILL_GRACE = 10.0
#: how long a caller waits to be accepted and answered by a live owner before giving up
CONNECT_TIMEOUT = 10.0


def owners_dir(root: Path) -> Path:
    return root / "owners"


def socket_path(root: Path, pid: int) -> Path:
    return owners_dir(root) / f"{pid}.sock"


# -- wire -----------------------------------------------------------------------------------
def _send(sock: socket.socket, frame: dict[str, Any], lock: threading.Lock | None = None) -> None:
    data = json.dumps(frame, separators=(",", ":")).encode() + b"\n"
    if lock is None:
        sock.sendall(data)
    else:
        with lock:
            sock.sendall(data)


def _lines(sock: socket.socket, limit: int = MAX_REQUEST) -> Iterator[dict[str, Any]]:
    """The JSON frames a peer sends, until it closes its side."""
    buffer = b""
    while True:
        newline = buffer.find(b"\n")
        if newline >= 0:
            line, buffer = buffer[:newline], buffer[newline + 1:]
            yield json.loads(line)
            continue
        if len(buffer) > limit:
            raise InvalidSpec(f"a request over {limit} bytes")
        chunk = sock.recv(1 << 16)
        if not chunk:
            return
        buffer += chunk


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def call_to_dict(call: CommandCall) -> dict[str, Any]:
    body = call.body()
    if call.pty is not None:
        body["pty"] = list(call.pty)
    return body


def call_of(body: dict[str, Any]) -> CommandCall:
    pty = body.get("pty")
    return CommandCall(body["cmd"], body.get("timeout"), body.get("env"), body.get("cwd"),
                       (int(pty[0]), int(pty[1])) if pty else None)


# -- the owner's side ---------------------------------------------------------------------
class OwnerListener:
    """This process's socket: serves calls on its sandboxes (``LIVE``) to other processes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pid = os.getpid()
        self.path = socket_path(root, self.pid)
        owners_dir(root).mkdir(mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            self._sock.bind(str(self.path))
        finally:
            os.umask(old)
        self._sock.listen(64)
        self._closed = False
        #: kills by id in progress: the process's exit waits for them (a teardown cut short
        #: by the exit would leave the sandbox to the next gc)
        self._kills = 0
        self._kills_done = threading.Condition()
        threading.Thread(target=self._accept, name="corral-owner-link", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with self._kills_done:
            self._kills_done.wait_for(lambda: self._kills == 0, timeout=KILL_GRACE)
        if os.getpid() == self.pid:  # a forked child's exit must not remove its parent's socket
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="corral-owner-call", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid not in (0, os.geteuid()):
                return  # the directory is 0700 already: this is a second lock on the door
            frames = _lines(conn)
            lock = threading.Lock()
            try:
                request = next(frames)
                backend = LIVE.get(str(request.get("id")))
                if backend is None or backend.inner is None:
                    raise SandboxNotFound(f"no live sandbox {request.get('id')} in process {os.getpid()}")
                op = str(request.get("op"))
                if op == "close":
                    with self._kills_done:
                        self._kills += 1
                try:
                    result = serve_call(backend, op, request.get("args") or {}, conn, frames, lock)
                    _send(conn, {"ok": result}, lock)
                finally:
                    if op == "close":
                        with self._kills_done:
                            self._kills -= 1
                            self._kills_done.notify_all()
            except SandboxError as exc:
                with contextlib.suppress(OSError):
                    _send(conn, {"error": exc.code, "message": str(exc)}, lock)
            except (OSError, StopIteration, ValueError, KeyError, TypeError) as exc:
                with contextlib.suppress(OSError):
                    _send(conn, {"error": "invalid_spec", "message": f"bad owner-link request: {exc}"}, lock)


def serve_call(backend: LocalBackend, op: str, args: dict[str, Any], conn: socket.socket,
               frames: Iterator[dict[str, Any]], lock: threading.Lock) -> Any:
    """Carry out one call of another process on ``backend``; the answer's ``ok`` value."""
    simple: dict[str, Callable[[], Any]] = {
        "hello": lambda: {"spec": backend.spec.to_dict(), "metadata": backend.metadata},
        "commands": lambda: [c.to_dict() for c in backend.commands()],
        "kill_command": lambda: backend.kill_command(int(args["pid"])),
        "read_file": lambda: _b64(backend.read_file(args["path"], int(args["max_bytes"]))),
        "write_file": lambda: backend.write_file(args["path"], _unb64(args["data"]), int(args["mode"])),
        "list_dir": lambda: [e.to_dict() for e in backend.list_dir(args["path"])],
        "stat": lambda: backend.stat(args["path"]).to_dict(),
        "remove": lambda: backend.remove(args["path"], bool(args["recursive"])),
        "make_dir": lambda: backend.make_dir(args["path"], int(args["mode"])),
        "info": lambda: backend.info().to_dict(),
        "set_timeout": lambda: backend.set_timeout(float(args["seconds"])),
        "alive": backend.alive,
        "paused": lambda: backend.paused,
        "pause": backend.pause,
        "resume": backend.resume,
        "create_code_context": lambda: backend.create_code_context(args["language"], args.get("cwd")),
        "audit": lambda: [event.to_dict() for event in backend.audit()],
        "expose_port": lambda: _expose(backend, int(args["port"]), bool(args["unix"])),
        "close": backend.close,
    }
    if op in simple:
        return simple[op]()
    if op == "run_code":
        front = backend.front() if backend.front is not None else None
        if front is None:
            raise SandboxNotFound(f"sandbox {backend.id}'s owner no longer holds it")
        return backend.run_code(front, args["code"], language=args.get("language"), context=args.get("context"),
                                timeout=args.get("timeout"), envs=args.get("envs"), callbacks={}).to_dict()

    def forward(stream: str, data: bytes) -> None:
        with contextlib.suppress(OSError):  # a caller gone: the command goes on, its output is dropped
            _send(conn, {"out": stream, "data": _b64(data)}, lock)

    stdin = _unb64(args["stdin"]) if args.get("stdin") is not None else None
    if op == "run":
        return backend.run(call_of(args["call"]), stdin, forward if args.get("stream") else None).to_dict()
    if op == "start":
        process: CommandProcess = backend.start(call_of(args["call"]), forward)
    elif op == "start_background":
        process = backend.start_background(call_of(args["call"]), stdin, forward)
    elif op == "attach":
        process = backend.command(int(args["pid"]))
    else:
        raise InvalidSpec(f"unknown owner-link call {op!r}")
    _send(conn, {"started": process.pid}, lock)
    done = threading.Event()
    threading.Thread(target=_follow_controls, args=(process, frames, op == "start", done), daemon=True).start()
    try:
        return process.wait().to_dict()
    finally:
        done.set()


def _follow_controls(process: CommandProcess, frames: Iterator[dict[str, Any]], kill_on_hangup: bool,
                     done: threading.Event) -> None:
    try:
        for frame in frames:
            if "stdin" in frame:
                process.write_stdin(_unb64(frame["stdin"]))
            elif "close_stdin" in frame:
                process.close_stdin()
            elif "signal" in frame:
                process.send_signal(int(frame["signal"]))
            elif "kill" in frame:
                process.kill()
            elif "resize" in frame:
                process.resize(int(frame["resize"][0]), int(frame["resize"][1]))
    except (OSError, SandboxError, ValueError, NotImplementedError):
        pass
    if kill_on_hangup and not done.is_set() and not process.done:
        with contextlib.suppress(SandboxError, OSError):
            process.kill()


def _expose(backend: LocalBackend, port: int, unix: bool) -> dict[str, Any]:
    exposed, _ = backend.expose_port(port, unix)  # the forward closes with the sandbox, in its owner
    return exposed.to_dict()


_listeners: dict[Path, OwnerListener] = {}
_listeners_lock = threading.Lock()


def serve(root: Path) -> None:
    """Make sure this process listens for calls on its sandboxes of state directory ``root``
    (from its first sandbox until it exits: starting one costs ~0.6 ms, too much per create)."""
    with _listeners_lock:
        listener = _listeners.get(root)
        if listener is None or listener.pid != os.getpid():  # (a forked child listens for itself)
            if not _listeners:
                atexit.register(_close_all)
            _listeners[root] = OwnerListener(root)


def _close_all() -> None:
    with _listeners_lock:
        for listener in _listeners.values():
            listener.close()
        _listeners.clear()




# -- the caller's side -----------------------------------------------------------------------
class _Call:
    """One open call to an owner."""

    def __init__(self, path: Path, sandbox_id: str, op: str, args: dict[str, Any]) -> None:
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
        _send(self.sock, {"id": sandbox_id, "op": op, "args": args})
        self.frames = _lines(self.sock)

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
            _send(self.sock, frame, self.lock)
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
        threading.Thread(target=self._read, name="corral-owner-process", daemon=True).start()
        self._started.wait(CONNECT_TIMEOUT)
        if self._error is not None:
            raise self._error

    def _read(self) -> None:
        def frame(data: dict[str, Any]) -> None:
            if "started" in data:
                self.pid = data["started"]
                self._started.set()
            elif "out" in data and self._on_output is not None:
                self._on_output(data["out"], _unb64(data["data"]))

        try:
            self._result = ExecResult(**self._call.answer(frame))
        except BaseException as exc:  # handed to the waiter
            self._error = exc
        finally:
            self._finished.set()
            self._started.set()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def write_stdin(self, data: bytes) -> None:
        self._call.control({"stdin": _b64(data)})

    def close_stdin(self) -> None:
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

    def _open(self, op: str, **args: Any) -> _Call:
        return _Call(self.path, self.id, op, args)

    def _call(self, op: str, **args: Any) -> Any:
        return self._open(op, **args).answer()

    # -- commands ---------------------------------------------------------------
    def start(self, call: CommandCall, on_output: OutputCallback | None) -> OwnerProcess:
        return OwnerProcess(self._open("start", call=call_to_dict(call)), on_output)

    def run(self, call: CommandCall, stdin: bytes | None, on_output: OutputCallback | None) -> ExecResult:
        def frame(data: dict[str, Any]) -> None:
            if "out" in data and on_output is not None:
                on_output(data["out"], _unb64(data["data"]))

        opened = self._open("run", call=call_to_dict(call), stdin=_b64(stdin) if stdin is not None else None,
                            stream=on_output is not None)
        return ExecResult(**opened.answer(frame))

    def start_background(self, call: CommandCall, stdin: bytes | None,
                         on_output: OutputCallback | None) -> OwnerProcess:
        return OwnerProcess(self._open("start_background", call=call_to_dict(call),
                                       stdin=_b64(stdin) if stdin is not None else None), on_output)

    def commands(self) -> list[CommandInfo]:
        from .commands import CommandInfo

        return [CommandInfo(**c) for c in self._call("commands")]

    def command(self, pid: int) -> OwnerProcess:
        return OwnerProcess(self._open("attach", pid=pid), None)

    def kill_command(self, pid: int) -> bool:
        return bool(self._call("kill_command", pid=pid))

    # -- files --------------------------------------------------------------------
    def read_file(self, path: str, max_bytes: int) -> bytes:
        return _unb64(self._call("read_file", path=path, max_bytes=max_bytes))

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        self._call("write_file", path=path, data=_b64(data), mode=mode)

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

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def run_code(self, sandbox: Any, code: str, *, language: str | None, context: str | None,
                 timeout: float | None, envs: dict[str, str] | None, callbacks: dict[str, Any]) -> Execution:
        from .interpreter import Execution, replay_callbacks

        execution = Execution.from_dict(self._call("run_code", code=code, language=language, context=context,
                                                   timeout=timeout, envs=envs))
        replay_callbacks(execution, callbacks)
        return execution

    def create_code_context(self, language: str, cwd: str | None) -> str:
        return str(self._call("create_code_context", language=language, cwd=cwd))

    def audit(self) -> list[AuditEvent]:
        from .egress.audit import AuditEvent

        return [AuditEvent(**event) for event in self._call("audit")]

    def expose_port(self, port: int, unix: bool) -> tuple[ExposedPort, Callable[[], None]]:
        return ExposedPort(**self._call("expose_port", port=port, unix=unix)), lambda: None

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
