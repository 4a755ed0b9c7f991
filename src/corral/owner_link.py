"""Another process's embedded sandbox, driven through its owner.

An embedded sandbox's agent channel, threads and cgroups belong to the process that
created it.  So that ``Sandbox.connect(id)`` and ``Sandbox.kill(id)`` work from any
process on the host (as they do through a server), each owner listens on a Unix socket
of its own, ``<state>/owners/<pid>.sock`` (directory 0700, socket 0600; the peer's uid is
checked with ``SO_PEERCRED``: only the owner's uid, or root, may drive its sandboxes), and
carries out the calls of :class:`corral.owner_backend.OwnerBackend` on its sandboxes.

One call is one connection: a JSON request line, then JSON answer lines -- output frames
(``out``), the pid of a started command (``started``), and one final ``ok`` or ``error``
(the :mod:`corral.errors` code, raised again as the same class).  A started command's
connection also carries the caller's stdin, signals, kill and resize the other way.
A connection's end never kills a background command; it kills a foreground one the
caller can no longer wait for.  Either way it ends the call at once: a caller gone from a command
it attached to holds none of the owner's threads or connections while the command runs on.
A port forwarded for another process (``expose_port``) has an id its ``close_port`` closes in the
owner; a sandbox keeps at most :data:`MAX_LINK_FORWARDS` of them, and they close with it.

A caller never holds up the owner's sandbox.  A command's output is queued for its caller and sent
by a thread of the call's own (the sandbox's agent reader, which carries every command's output,
never waits on a caller); what is queued is bounded like a server's exec stream holds for a client
that does not read: the sandbox's ``max_output`` per stream.  A caller that falls further behind
loses the rest of that command's output (what was queued still goes, then the result, which says
``truncated``: that much output is more than is kept), and one that takes nothing of a frame for
:data:`LINK_SEND_STALL` seconds is taken for gone: its connection is closed (the end of a
connection, as above).  The link serves at most :data:`MAX_LINK_CONNECTIONS` connections at once (past
it a call is refused: ``resource_limit``), a request line must arrive within
:data:`FIRST_FRAME_TIMEOUT`, and unfinished lines over all connections buffer at most
:data:`MAX_LINK_BUFFERED` bytes past a small size each (past it a call is refused).

The listener runs from this process's first sandbox until the process exits; a killed
owner's socket is removed by ``gc`` (``corral.registry``), which a process's first create runs.
"""

from __future__ import annotations

import atexit
import base64
import collections
import contextlib
import functools
import itertools
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConnectionLost, InvalidSpec, ResourceLimit, SandboxError, SandboxNotFound, StdinNotTaken
from .host.sockets import bind_private
from .lifecycle import LIVE
from .ports import ExposedPort
from .spec import validate_user
from .transport import CommandCall, CommandProcess

if TYPE_CHECKING:
    from .host.portfwd import PortForward
    from .local_backend import LocalBackend, LocalProcess

#: a request line (a file written through the link is in it, base64): a server's upload cap
MAX_REQUEST = 96 << 20
#: stdin bytes a caller may have sent over one call that the command does not have yet (the
#: caller keeps within it, chunk by chunk acknowledged; see _StdinWriter)
STDIN_LINK_WINDOW = 8 << 20
#: raw stdin bytes per frame (base64 in JSON: a third more)
STDIN_LINK_FRAME = 4 << 20
#: how long an exiting owner waits for a kill by id it is carrying out
KILL_GRACE = 10.0
#: how long a caller waits to be accepted and answered by a live owner before giving up
CONNECT_TIMEOUT = 10.0
#: how long a send to a caller may make no progress before the caller is taken for gone and its
#: connection closed (its output meanwhile is queued, up to ``max_output`` per stream, then dropped)
LINK_SEND_STALL = 30.0
#: connections the owner serves at once (a running command's call holds one, and up to four threads)
MAX_LINK_CONNECTIONS = 128
#: how long a connection's request line may take to arrive, from its accept
FIRST_FRAME_TIMEOUT = 10.0
#: bytes of unfinished frames all connections buffer at once past :data:`FREE_BUFFER` each: two
#: requests of the largest size (a file written through the link) at a time
MAX_LINK_BUFFERED = 2 * MAX_REQUEST
#: what a connection may buffer of an unfinished frame without counting against MAX_LINK_BUFFERED
FREE_BUFFER = 1 << 20
#: a frame after the request: a control, or a chunk of stdin (STDIN_LINK_FRAME bytes, base64)
MAX_CONTROL_FRAME = 4 * ((STDIN_LINK_FRAME + 2) // 3) + 4096


def owners_dir(root: Path) -> Path:
    return root / "owners"


def socket_path(root: Path, pid: int) -> Path:
    return owners_dir(root) / f"{pid}.sock"


# -- wire -----------------------------------------------------------------------------------
def send_frame(sock: socket.socket, frame: dict[str, Any], lock: threading.Lock | None = None) -> None:
    data = json.dumps(frame, separators=(",", ":")).encode() + b"\n"
    if lock is None:
        sock.sendall(data)
    else:
        with lock:
            sock.sendall(data)


def read_frames(sock: socket.socket, limit: int = MAX_REQUEST) -> Iterator[dict[str, Any]]:
    """The JSON frames a peer sends, until it closes its side; one longer than ``limit`` bytes
    is refused.  (A frame can hold a whole file: the buffer grows in place and each byte is
    scanned for the newline once.)"""
    buffer = bytearray()
    scanned = 0
    while True:
        newline = buffer.find(b"\n", scanned)
        if newline >= 0:
            line = bytes(buffer[:newline])
            del buffer[:newline + 1]
            scanned = 0
            yield json.loads(line)
            continue
        scanned = len(buffer)
        if scanned > limit:
            raise InvalidSpec(f"a frame over {limit} bytes")
        chunk = sock.recv(1 << 20)
        if not chunk:
            return
        buffer += chunk


def _set_socket_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    """``SO_SNDTIMEO``/``SO_RCVTIMEO``: one direction's wait bounded (0: none), the socket staying
    blocking for the other (``settimeout`` would make the descriptor non-blocking for both)."""
    whole = int(seconds)
    micro = int((seconds - whole) * 1_000_000) if seconds > 0 else 0
    if seconds > 0 and not whole and not micro:
        micro = 1
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, micro))


class _Budget:
    """Bytes of unfinished frames the link buffers over all its connections."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.total:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


def caller_frames(sock: socket.socket, budget: _Budget) -> Generator[dict[str, Any], None, None]:
    """A caller's frames as its owner reads them (:func:`read_frames`, bounded): the request
    within :data:`FIRST_FRAME_TIMEOUT` and up to :data:`MAX_REQUEST` bytes, each later one up to
    :data:`MAX_CONTROL_FRAME`; an unfinished frame's bytes past :data:`FREE_BUFFER` are counted
    against ``budget`` (out of it: ``ResourceLimit``)."""
    buffer = bytearray()
    scanned = 0
    held = 0  # of the budget
    deadline: float | None = time.monotonic() + FIRST_FRAME_TIMEOUT
    limit = MAX_REQUEST
    try:
        while True:
            newline = buffer.find(b"\n", scanned)
            if newline >= 0:
                line = bytes(buffer[:newline])
                buffer = buffer[newline + 1:]  # (a new buffer: a large one's memory goes with the frame)
                scanned = 0
                if deadline is not None:  # the request is in: the connection lasts as long as its call
                    deadline = None
                    limit = MAX_CONTROL_FRAME
                    _set_socket_timeout(sock, socket.SO_RCVTIMEO, 0)
                want = max(0, len(buffer) - FREE_BUFFER)
                if want < held:
                    budget.give(held - want)
                    held = want
                yield json.loads(line)
                continue
            scanned = len(buffer)
            if scanned > limit:
                raise InvalidSpec(f"a frame over {limit} bytes")
            want = max(0, len(buffer) - FREE_BUFFER)
            if want > held:
                if not budget.take(want - held):
                    raise ResourceLimit(f"the owner is reading other large requests ({budget.total} bytes at "
                                        "once): try again")
                held = want
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise InvalidSpec(f"no request line within {FIRST_FRAME_TIMEOUT:g} s")
                _set_socket_timeout(sock, socket.SO_RCVTIMEO, left)
            try:
                chunk = sock.recv(1 << 20)
            except BlockingIOError:  # SO_RCVTIMEO: the request's time is up
                raise InvalidSpec(f"no request line within {FIRST_FRAME_TIMEOUT:g} s") from None
            if not chunk:
                return
            buffer += chunk
    finally:
        budget.give(held)


def b64_size(n: int) -> int:
    """How long ``n`` bytes are in base64."""
    return 4 * ((n + 2) // 3)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def call_to_dict(call: CommandCall) -> dict[str, Any]:
    body = call.body()
    if call.pty is not None:
        body["pty"] = list(call.pty)
    if not call.keep_output:
        body["keep_output"] = False
    return body


def call_of(body: dict[str, Any]) -> CommandCall:
    """The call a linked process asked for, every field of it (the command's ``user`` was dropped:
    ``run(..., user="user")`` in a ``user="root"`` sandbox ran as root)."""
    pty = body.get("pty")
    user = body.get("user")
    return CommandCall(body["cmd"], body.get("timeout"), body.get("env"), body.get("cwd"),
                       (int(pty[0]), int(pty[1])) if pty else None,
                       validate_user(user) if user is not None else None, body.get("keep_output", True) is not False)


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
        bind_private(self._sock, self.path)
        self._sock.listen(64)
        self._closed = False
        #: connections being served, and the bytes of unfinished frames they hold
        self._connections = 0
        self._connections_lock = threading.Lock()
        self._budget = _Budget(MAX_LINK_BUFFERED)
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
            with self._connections_lock:
                full = self._connections >= MAX_LINK_CONNECTIONS
                if not full:
                    self._connections += 1
            if full:
                _refuse(conn, ResourceLimit(f"the owner serves {MAX_LINK_CONNECTIONS} owner-link calls at once: "
                                            "try again when some have ended"))
                continue
            try:
                threading.Thread(target=self._serve_counted, args=(conn,), name="corral-owner-call",
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had
                self._served()
                _refuse(conn, ResourceLimit("the owner cannot start a thread for the call"))

    def _served(self) -> None:
        with self._connections_lock:
            self._connections -= 1

    def _serve_counted(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            self._served()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid not in (0, os.geteuid()):
                return  # the directory is 0700 already: this is a second lock on the door
            # a caller that takes nothing for this long is gone: no send waits on it longer
            _set_socket_timeout(conn, socket.SO_SNDTIMEO, LINK_SEND_STALL)
            frames = caller_frames(conn, self._budget)
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
                    result = serve_call(backend, op, request.get("args") or {}, conn, frames)
                    send_frame(conn, {"ok": result})
                finally:
                    if op == "close":
                        with self._kills_done:
                            self._kills -= 1
                            self._kills_done.notify_all()
            except SandboxError as exc:
                with contextlib.suppress(OSError):
                    send_frame(conn, {"error": exc.code, "message": str(exc)})
            except (OSError, StopIteration, ValueError, KeyError, TypeError) as exc:
                with contextlib.suppress(OSError):
                    send_frame(conn, {"error": "invalid_spec", "message": f"bad owner-link request: {exc}"})
            finally:
                with contextlib.suppress(ValueError):  # (still read by a call's control thread: it ends it)
                    frames.close()  # its share of the budget back now, not when collected


def _refuse(conn: socket.socket, exc: SandboxError) -> None:
    """Answer a connection the owner does not serve with ``exc`` without waiting on it (the answer
    fits in the socket's buffer, or is dropped), and close it."""
    with conn:
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            send_frame(conn, {"error": exc.code, "message": str(exc)})
            conn.shutdown(socket.SHUT_WR)


def serve_call(backend: LocalBackend, op: str, args: dict[str, Any], conn: socket.socket,
               frames: Iterator[dict[str, Any]]) -> Any:
    """Carry out one call of another process on ``backend``; the answer's ``ok`` value."""
    simple: dict[str, Callable[[], Any]] = {
        "hello": lambda: {"spec": backend.spec.to_dict(), "metadata": backend.metadata},
        "commands": lambda: [c.to_dict() for c in backend.commands()],
        "kill_command": lambda: backend.kill_command(int(args["pid"])),
        "read_file": lambda: b64(backend.read_file(args["path"], int(args["max_bytes"]))),
        "write_file": lambda: backend.write_file(args["path"], unb64(args["data"]), int(args["mode"])),
        "list_dir": lambda: [e.to_dict() for e in backend.list_dir(args["path"])],
        "stat": lambda: backend.stat(args["path"]).to_dict(),
        "remove": lambda: backend.remove(args["path"], bool(args["recursive"])),
        "make_dir": lambda: backend.make_dir(args["path"], int(args["mode"])),
        "info": lambda: backend.info().to_dict(),
        "set_timeout": lambda: backend.set_timeout(float(args["seconds"])),
        "alive": backend.alive,
        "paused": lambda: backend.paused,
        "pause": lambda: backend.pause(to_disk=bool(args.get("to_disk"))),
        "resume": backend.resume,
        "create_code_context": lambda: backend.create_code_context(args["language"], args.get("cwd")),
        "code_contexts": lambda: [list(c) for c in backend.code_contexts()],
        "remove_code_context": lambda: backend.remove_code_context(str(args["name"])),
        "audit": lambda: [event.to_dict() for event in backend.audit()],
        "expose_port": lambda: _expose(backend, int(args["port"]), bool(args["unix"]),
                                       [int(uid) for uid in args.get("other_users", ())], bool(args.get("closable"))),
        "close_port": lambda: LINK_FORWARDS.close(backend, int(args["forward"])),
        "snapshot": lambda: backend.snapshot().to_dict(),
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

    if op not in ("run", "start", "start_background", "attach"):
        raise InvalidSpec(f"unknown owner-link call {op!r}")
    # every frame of a command's call goes out through this, in order, from a thread of its own:
    # its output comes on the sandbox's agent reader, which must never wait on a caller
    sender = _Sender(conn, backend.spec.limits.max_output)
    try:
        result = _serve_command(backend, op, args, frames, sender)
    finally:
        sender.close()  # what is queued goes out (or the caller is given up) before the answer
    if sender.cut:
        result["truncated"] = True  # what it streamed was cut (see _Sender)
    return result


def _serve_command(backend: LocalBackend, op: str, args: dict[str, Any], frames: Iterator[dict[str, Any]],
                   sender: _Sender) -> dict[str, Any]:
    stdin = unb64(args["stdin"]) if args.get("stdin") is not None else None
    if op == "run":
        # the caller sends nothing more on a run: the end of its frames is the caller gone, and
        # its command goes with it (it would run on to its timeout, up to days)
        running: list[CommandProcess] = []
        finished = threading.Event()
        threading.Thread(target=_kill_on_hangup, args=(frames, running, finished), name="corral-owner-hangup",
                         daemon=True).start()
        try:
            return backend.run(call_of(args["call"]), stdin, sender.output if args.get("stream") else None,
                               running.append).to_dict()
        finally:
            finished.set()
    if op == "start":
        process: LocalProcess = backend.start(call_of(args["call"]), sender.output)
    elif op == "start_background":
        process = backend.start_background(call_of(args["call"]), stdin, sender.output)
    else:
        process = backend.command(int(args["pid"]))
    sender.send({"started": process.pid, "stdin_window": STDIN_LINK_WINDOW})
    # the call lasts until the command ends or its caller hangs up: a caller gone from a command it
    # attached to or started in the background leaves it running, and holds none of the owner's
    # threads or connections (20 SIGKILLed attachers held 65 threads until the command's end)
    over = threading.Event()
    forget = process.on_end(over.set)
    hangup = functools.partial(_kill_quietly, process) if op == "start" else over.set
    done = threading.Event()
    writer = _StdinWriter(process, sender.send)
    threading.Thread(target=_follow_controls, args=(process, frames, hangup, done, writer),
                     name="corral-owner-controls", daemon=True).start()
    try:
        over.wait()
        if not process.done:
            raise ConnectionLost(f"the caller of command {process.pid} hung up: it runs on, unattached")
        return process.wait().to_dict()
    finally:
        forget()
        done.set()
        writer.stop()


class _Sender:
    """The frames of one command's call to its caller, sent in order by a thread of their own.

    ``output`` is called on the sandbox's agent reader thread, which carries every command's
    output and file answers: it only queues.  What is queued is bounded as a server's exec stream
    holds for a client that does not read, ``max_output`` per stream; a caller that falls further
    behind than that loses the rest of the command's output (``cut``: what is queued still goes,
    and the result says ``truncated`` -- which it is, that much output being more than is kept).
    A send that makes no progress for :data:`LINK_SEND_STALL` (the connection's ``SO_SNDTIMEO``)
    gives the caller up: the connection is shut, which its call takes as the caller's hangup."""

    def __init__(self, conn: socket.socket, room: int) -> None:
        self._conn = conn
        self._room = room
        self._frames: collections.deque[tuple[str, bytes] | dict[str, Any]] = collections.deque()
        self._queued = {"stdout": 0, "stderr": 0}
        #: the rest of the output is dropped (the caller fell behind); the caller was given up;
        #: no more frames come
        self.cut = False
        self.gone = False
        self._closing = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._send_all, name="corral-owner-send", daemon=True)
        self._thread.start()

    def output(self, stream: str, data: bytes) -> None:
        with self._changed:
            if self.cut or self.gone:
                return
            if self._queued[stream] and self._queued[stream] + len(data) > self._room:
                self.cut = True
                return
            self._queued[stream] += len(data)
            self._frames.append((stream, data))
            self._changed.notify_all()

    def send(self, frame: dict[str, Any]) -> None:
        with self._changed:
            if not self.gone:
                self._frames.append(frame)
                self._changed.notify_all()

    def close(self) -> None:
        """Wait until everything queued is sent, or the caller is given up."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()
        with self._changed:  # output of a command that runs on after its call is no one's to queue
            self.gone = True
            self._frames.clear()

    def _send_all(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closing or bool(self._frames))
                if not self._frames:
                    return
                item = self._frames.popleft()
            try:
                if isinstance(item, dict):
                    send_frame(self._conn, item)
                else:
                    send_frame(self._conn, {"out": item[0], "data": b64(item[1])})
            except OSError:  # gone, or taking nothing for LINK_SEND_STALL: its call ends as at a hangup
                with self._changed:
                    self.gone = True
                    self._frames.clear()
                with contextlib.suppress(OSError):
                    self._conn.shutdown(socket.SHUT_RDWR)
                return
            finally:
                if isinstance(item, tuple):
                    with self._changed:
                        self._queued[item[0]] -= len(item[1])


class _StdinWriter:
    """A command's stdin from the link, written in order on a thread of its own while the call's
    reader goes on with signals and kills (a write waits while the command does not read, as a
    pipe's writer does; a kill must not wait behind it).  Each chunk written (or dropped after a
    ``StdinNotTaken``) is acknowledged (``stdin_ack``); what is queued is bounded by
    :data:`STDIN_LINK_WINDOW`, past which the reader waits for room."""

    def __init__(self, process: CommandProcess, send: Callable[[dict[str, Any]], None]) -> None:
        self._process = process
        self._send = send
        #: chunks not yet written (None: close stdin), their bytes, and whether to stop
        self._queue: collections.deque[bytes | None] = collections.deque()
        self._queued = 0
        self._stopped = False
        self._changed = threading.Condition()
        threading.Thread(target=self._write_all, name="corral-owner-stdin", daemon=True).start()

    def put(self, item: bytes | None) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._stopped or item is None or not self._queued
                                   or self._queued + len(item) <= STDIN_LINK_WINDOW)
            self._queue.append(item)
            self._queued += len(item or b"")
            self._changed.notify_all()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def _write_all(self) -> None:
        with contextlib.suppress(OSError, SandboxError):  # the caller or the command is gone
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self._stopped or bool(self._queue))
                    if self._stopped:
                        return
                    item = self._queue[0]
                try:
                    if item is None:
                        self._process.close_stdin()
                    else:
                        self._process.write_stdin(item)
                    taken = len(item or b"")
                except StdinNotTaken as exc:
                    # what is queued behind it is dropped too, and the caller's next stdin call says so
                    self._send({"stdin_error": str(exc)})
                    with self._changed:
                        taken = self._queued
                        self._queue = collections.deque(c for c in self._queue if c is None)
                        self._queued = 0
                        self._changed.notify_all()
                    self._send({"stdin_ack": taken})
                    continue
                with self._changed:
                    self._queue.popleft()
                    self._queued -= taken
                    self._changed.notify_all()
                if item is not None:
                    self._send({"stdin_ack": taken})


def _follow_controls(process: CommandProcess, frames: Iterator[dict[str, Any]], hangup: Callable[[], None],
                     done: threading.Event, stdin: _StdinWriter) -> None:
    """Carry out the caller's controls until it hangs up (or sends what no caller sends); then
    ``hangup``, unless the call has ended."""
    try:
        for frame in frames:
            if "stdin" in frame:
                stdin.put(unb64(frame["stdin"]))
            elif "close_stdin" in frame:
                stdin.put(None)
            elif "signal" in frame:
                process.send_signal(int(frame["signal"]))
            elif "kill" in frame:
                process.kill()
            elif "resize" in frame:
                process.resize(int(frame["resize"][0]), int(frame["resize"][1]))
    except (OSError, SandboxError, ValueError, NotImplementedError):
        pass
    if not done.is_set():
        hangup()


def _kill_quietly(process: CommandProcess) -> None:
    """A foreground command's end when its caller, the one who could wait for it, is gone."""
    if not process.done:
        with contextlib.suppress(SandboxError, OSError):
            process.kill()


def _kill_on_hangup(frames: Iterator[dict[str, Any]], running: list[CommandProcess], finished: threading.Event) -> None:
    with contextlib.suppress(OSError, ValueError, SandboxError):  # (a frame too long: the caller is no client)
        for _ in frames:
            pass
    if not finished.is_set():
        for process in running:
            with contextlib.suppress(SandboxError, OSError):
                process.kill()


def _expose(backend: LocalBackend, port: int, unix: bool, other_users: list[int], closable: bool) -> dict[str, Any]:
    """A new forward's ``ExposedPort``; for a caller that closes forwards (``closable``), with the
    id ``close_port`` takes: ``{"port": ..., "forward": id}``."""
    exposed, forward_id = LINK_FORWARDS.expose(backend, port, unix, other_users)
    return {"port": exposed.to_dict(), "forward": forward_id} if closable else exposed.to_dict()


class LinkForwards:
    """The forwards other processes made into this process's sandboxes, by id: ``close_port``
    closes one at once (a caller's ``ports.close`` closed nothing, and 300 expose+close held 301
    listeners and 300 threads), and each still closes with its sandbox (the tier sandbox closes
    every forward it made).  A sandbox keeps at most :data:`MAX_LINK_FORWARDS` of them open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, dict[int, PortForward]] = {}
        self._ids = itertools.count(1)

    def expose(self, backend: LocalBackend, port: int, unix: bool, other_users: list[int]) -> tuple[ExposedPort, int]:
        with self._lock:
            self._drop_closed()
            forwards = self._open.setdefault(backend.id, {})
            if len(forwards) >= MAX_LINK_FORWARDS:
                raise ResourceLimit(f"sandbox {backend.id} already has {MAX_LINK_FORWARDS} ports forwarded through "
                                    "its owner: close one first")
            forward = backend.forward_port(port, unix, other_users)
            forward_id = next(self._ids)
            forwards[forward_id] = forward
        return ExposedPort.of(forward), forward_id

    def close(self, backend: LocalBackend, forward_id: int) -> None:
        """Close one (one closed already, or with its sandbox, is nothing to close)."""
        with self._lock:
            forward = self._open.get(backend.id, {}).pop(forward_id, None)
        if forward is not None:
            forward.close()

    def _drop_closed(self) -> None:
        for sandbox_id in list(self._open):
            still = {i: forward for i, forward in self._open[sandbox_id].items() if not forward.closed}
            if still and sandbox_id in LIVE:
                self._open[sandbox_id] = still
            else:
                del self._open[sandbox_id]


#: forwards into one sandbox that other processes keep open through the link, as many as a server
#: keeps (``server.port_routes.MAX_FORWARDS_PER_SANDBOX``): each holds a listener and a thread
MAX_LINK_FORWARDS = 16
LINK_FORWARDS = LinkForwards()


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
