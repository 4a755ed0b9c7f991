"""Host side of the in-sandbox agent protocol (``src/corral/agent/agent.c``).

Every tier that runs Linux userland (process, gVisor, microVM) starts
``corral-agent`` inside the sandbox and talks to it over a byte stream (pipes,
or a virtio-serial port).  Frames are ``u8 type | u32 id | u32 len | payload``.

Everything the agent says is untrusted: sizes are capped, unknown ids are
ignored, and timeouts are enforced here, by killing the command's cgroup (the
``kill`` hook), never by asking the agent.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ...errors import ContainmentFailed, FileError, FileNotFoundInSandbox, SandboxClosed
from ...images import SANDBOX_UID
from ..base import ExecRequest, ExecResult, FileEntry, OutputCallback, Process
from .pause import PauseClock

#: what root inside holds, within the sandbox's own user namespace only: Docker's default set
#: without MKNOD, SYS_CHROOT (refused by the seccomp filter anyway) and NET_RAW (raw packets are
#: not what package installs need, and the egress rules were not written against forged ones)
ROOT_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
             "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_AUDIT_WRITE", "CAP_SETFCAP")
#: the uid inside of each ``user`` (``spec.USERS``)
USER_IDS = {"root": 0, "user": SANDBOX_UID}

if TYPE_CHECKING:
    pass

T_EXEC, T_GO, T_STDIN, T_STDIN_EOF, T_SIGNAL, T_EXEC_PTY, T_RESIZE, T_EXEC_SPARE = 1, 2, 3, 4, 5, 6, 7, 8
T_FREAD, T_FWRITE, T_FAPPEND, T_FLIST, T_FREMOVE, T_FMKDIR, T_FSTAT = 10, 11, 12, 13, 14, 15, 16
#: the microVM guest around a live snapshot (agent's guest_ops.c)
T_GUEST = 17
#: or'd into a file request's type: run it with the agent's own ids, not the default user's (the
#: host's own requests: the microVM's guest cgroup leaves and network files)
T_AS_AGENT = 0x80
T_READY, T_STARTED, T_STDOUT, T_STDERR, T_EXIT, T_DATA, T_SPARE, T_OK, T_ERR = 100, 101, 102, 103, 104, 105, 106, 110, 111

HEADER = struct.Struct("<BII")
MAX_FRAME = 64 << 20
WRITE_CHUNK = 4 << 20
_TYPES = {"f": "file", "d": "dir", "l": "symlink", "o": "other"}
_ENTRY = struct.Struct("<cQIq")

class _Pending:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.kind = 0
        self.data = bytearray()
        self.limit = MAX_FRAME
        self.overflow = False


class AgentChannel:
    """A framed, multiplexed connection to one agent."""

    def __init__(self, reader: int, writer: int, initial: bytes = b"") -> None:
        self._rfile = os.fdopen(reader, "rb", buffering=1 << 16)
        #: bytes already read from ``reader`` by the caller, read first
        self._initial = initial
        self._wfd = writer
        self._wlock = threading.Lock()
        self._lock = threading.Lock()
        self._next_id = 1
        self._pending: dict[int, _Pending] = {}
        self._execs: dict[int, AgentProcess] = {}
        self.ready = threading.Event()
        self.closed = threading.Event()
        #: called (on the reader thread) with the pid of each spare the agent forks (``--spare``)
        self.on_spare: Callable[[int], None] | None = None
        #: time the sandbox spent paused: commands' timeouts do not run meanwhile
        self.pause_clock = PauseClock()
        #: a request's ``user`` -> the uid the agent makes the command (agents that can switch
        #: users: root of the sandbox's user namespace); a user not here runs as the agent's default
        self.user_ids: dict[str, int] = {}
        self._thread = threading.Thread(target=self._read_loop, name="corral-agent-reader", daemon=True)
        self._thread.start()

    # -- framing -------------------------------------------------------
    def send(self, kind: int, ident: int, payload: bytes = b"") -> None:
        self._write(HEADER.pack(kind, ident, len(payload)) + payload)

    def _write(self, frame: bytes) -> None:
        """Whole frames, in one write where the pipe takes it."""
        if self.closed.is_set():
            raise SandboxClosed("the sandbox is no longer running")
        with self._wlock:
            try:
                view = memoryview(frame)
                while view:
                    n = os.write(self._wfd, view)
                    view = view[n:]
            except OSError as exc:
                raise SandboxClosed(f"the sandbox is no longer running ({exc.strerror})") from None

    def new_id(self) -> int:
        with self._lock:
            ident = self._next_id
            self._next_id = (self._next_id + 1) & 0xFFFFFFFF or 1
            return ident

    def skip_ids(self, past: int) -> None:
        """Number later requests above ``past``: a VM restored from a live snapshot has an agent
        that still holds the requests of the VM it was taken of, under ids up to there."""
        with self._lock:
            self._next_id = max(self._next_id, (past + 1) & 0xFFFFFFFF or 1)

    @property
    def last_id(self) -> int:
        """The id of the latest request sent (see :meth:`skip_ids`)."""
        with self._lock:
            return self._next_id - 1

    def guest(self, *args: str, timeout: float = 60.0) -> None:
        """A microVM guest operation around a live snapshot (the agent's guest_ops.c): "detach"
        or "attach" the workspace, a fresh "identity"; refused ones raise :class:`FileError`."""
        self.call(T_GUEST, b"".join(arg.encode() + b"\0" for arg in args), timeout=timeout)

    def _read_exact(self, n: int) -> bytes | None:
        data = b""
        if self._initial:
            data, self._initial = self._initial[:n], self._initial[n:]
        if len(data) < n:
            more = self._rfile.read(n - len(data))
            if more is None:
                return None
            data += more
        return data if len(data) == n else None

    @contextlib.contextmanager
    def quiesced(self, timeout: float = 60.0) -> Iterator[None]:
        """No request half-sent while the caller works (a microVM's live snapshot): sends from
        other threads wait, and the agent has read every earlier request whole (it answered a
        no-op sent last)."""
        with self._wlock:
            if self.closed.is_set():
                raise SandboxClosed("the sandbox is no longer running")
            ident = self.new_id()
            pending = _Pending()
            self._pending[ident] = pending
            view = memoryview(HEADER.pack(T_FSTAT, ident, 2) + b"/\0")
            try:
                while view:
                    view = view[os.write(self._wfd, view):]
            except OSError as exc:
                self._pending.pop(ident, None)
                raise SandboxClosed(f"the sandbox is no longer running ({exc.strerror})") from None
            self._answer(ident, pending, MAX_FRAME, timeout)
            yield

    def _read_loop(self) -> None:
        try:
            while True:
                header = self._read_exact(HEADER.size)
                if header is None:
                    break
                kind, ident, length = HEADER.unpack(header)
                if length > MAX_FRAME:
                    break  # a confused or hostile agent: drop the channel
                payload = self._read_exact(length) if length else b""
                if payload is None:
                    break
                self._dispatch(kind, ident, payload)
        except (OSError, ValueError):
            pass
        finally:
            self.closed.set()
            for pending in list(self._pending.values()):
                pending.done.set()
            for proc in list(self._execs.values()):
                proc._agent_gone()

    def _dispatch(self, kind: int, ident: int, payload: bytes) -> None:
        if kind == T_READY:
            self.ready.set()
            return
        if kind == T_SPARE:
            if self.on_spare is not None and len(payload) == 4:
                self.on_spare(struct.unpack("<I", payload)[0])
            return
        proc = self._execs.get(ident)
        if proc is not None:
            if kind == T_STARTED and len(payload) == 4:
                proc._started(struct.unpack("<I", payload)[0])
            elif kind in (T_STDOUT, T_STDERR):
                proc._output("stdout" if kind == T_STDOUT else "stderr", payload)
            elif kind == T_EXIT and len(payload) == 4:
                self._execs.pop(ident, None)
                proc._exited(struct.unpack("<i", payload)[0])
            elif kind == T_ERR:
                self._execs.pop(ident, None)
                proc._failed(payload[4:].decode(errors="replace"))
            return
        pending = self._pending.get(ident)
        if pending is None:
            return
        if kind == T_DATA:
            if len(pending.data) + len(payload) > pending.limit:
                pending.overflow = True
            else:
                pending.data += payload
            return
        pending.kind = kind
        if kind == T_OK:
            pending.data += payload
        elif kind == T_ERR:
            pending.data = bytearray(payload)
        pending.done.set()

    def wait_ready(self, timeout: float) -> None:
        # wake up now and then: a channel that closes before "ready" (its
        # process died) fails at once instead of after the whole timeout
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.05):
            if self.closed.is_set() or time.monotonic() > deadline:
                break
        if not self.ready.is_set():
            raise SandboxClosed("the sandbox agent did not start")

    def close(self) -> None:
        try:
            os.close(self._wfd)
        except OSError:
            pass
        self._thread.join(timeout=5)
        try:
            self._rfile.close()
        except OSError:
            pass

    # -- requests --------------------------------------------------------
    def call(self, kind: int, payload: bytes, limit: int = MAX_FRAME, timeout: float = 60.0) -> bytes:
        return self.begin(kind, payload, limit)(timeout)

    def begin(self, kind: int, payload: bytes, limit: int = MAX_FRAME) -> Callable[[float], bytes]:
        """Send a request now; the returned function waits for its answer (or raises).
        The agent answers in order, so requests sent later can go before the wait."""
        ident = self.new_id()
        pending = _Pending()
        pending.limit = limit
        self._pending[ident] = pending
        try:
            self.send(kind, ident, payload)
        except BaseException:
            self._pending.pop(ident, None)
            raise
        return lambda timeout: self._answer(ident, pending, limit, timeout)

    def _answer(self, ident: int, pending: _Pending, limit: int, timeout: float) -> bytes:
        try:
            if not pending.done.wait(timeout):
                raise SandboxClosed("the sandbox agent did not answer in time")
        finally:
            self._pending.pop(ident, None)
        if self.closed.is_set() and pending.kind == 0:
            raise SandboxClosed("the sandbox is no longer running")
        if pending.kind == T_ERR:
            err = struct.unpack("<i", bytes(pending.data[:4]))[0] if len(pending.data) >= 4 else 0
            message = bytes(pending.data[4:]).decode(errors="replace")
            cls = FileNotFoundInSandbox if err == 2 else FileError
            raise cls(message, err)
        if pending.overflow:
            raise FileError(f"file is larger than the {limit} byte limit", 27)
        return bytes(pending.data)

    def read_file(self, path: str, max_bytes: int, *, as_agent: bool = False) -> bytes:
        return self.call(T_FREAD | (T_AS_AGENT if as_agent else 0), path.encode() + b"\0", limit=max_bytes)

    def write_file(self, path: str, data: bytes, mode: int, *, as_agent: bool = False) -> None:
        """``as_agent``: with the agent's own ids (the host's own files), not the default user's."""
        encoded = path.encode() + b"\0"
        first = True
        for offset in range(0, max(len(data), 1), WRITE_CHUNK):
            chunk = data[offset : offset + WRITE_CHUNK]
            kind = (T_FWRITE if first else T_FAPPEND) | (T_AS_AGENT if as_agent else 0)
            self.call(kind, struct.pack("<II", mode, 1) + encoded + chunk)
            first = False

    def list_dir(self, path: str) -> list[FileEntry]:
        raw = self.call(T_FLIST, path.encode() + b"\0")
        entries: list[FileEntry] = []
        pos = 0
        base = path.rstrip("/") or ""
        while pos + _ENTRY.size < len(raw):
            kind, size, mode, mtime = _ENTRY.unpack_from(raw, pos)
            end = raw.index(b"\0", pos + _ENTRY.size)
            name = raw[pos + _ENTRY.size : end].decode(errors="surrogateescape")
            pos = end + 1
            entries.append(FileEntry(name, f"{base}/{name}", _TYPES.get(kind.decode(), "other"), size, mode, float(mtime)))
        return sorted(entries, key=lambda e: e.name)

    def stat(self, path: str) -> FileEntry:
        raw = self.call(T_FSTAT, path.encode() + b"\0")
        kind, size, mode, mtime = _ENTRY.unpack_from(raw, 0)
        name = path.rstrip("/").rsplit("/", 1)[-1] or "/"
        return FileEntry(name, path, _TYPES.get(kind.decode(), "other"), size, mode, float(mtime))

    def remove(self, path: str, recursive: bool) -> None:
        self.call(T_FREMOVE, struct.pack("<I", int(recursive)) + path.encode() + b"\0")

    def make_dir(self, path: str, mode: int) -> None:
        self.call(T_FMKDIR, struct.pack("<I", mode) + path.encode() + b"\0")

    def start(
        self,
        request: ExecRequest,
        on_output: OutputCallback | None,
        place: Callable[[int], bool | None],
        kill: Callable[[], None],
        finish: Callable[[AgentProcess], None] | None = None,
        spare: int | None = None,
    ) -> AgentProcess:
        """Start a command. ``place(nspid)`` runs before it may exec (cgroup placement; False
        or an exception refuses the command);
        ``kill()`` kills its whole tree (called on timeout or :meth:`AgentProcess.kill`);
        ``finish(proc)`` runs once when it ended, before its result is built;
        ``spare``: the pid of a spare already placed and checked, for the agent to run the
        command in at once (no GO: ``place`` is not called for it); if it has died, the agent
        forks as usual and ``place`` gets the new pid."""
        ident = self.new_id()
        proc = AgentProcess(self, ident, request, on_output, place, kill, finish, spare)
        self._execs[ident] = proc
        uid = self.user_ids.get(request.user) if request.user is not None else None
        parts = ["" if uid is None else str(uid), request.cwd, str(len(request.argv)), *request.argv,
                 str(len(request.env))]
        parts += [f"{k}={v}" for k, v in request.env.items()]
        if on_output is None:  # nobody streams it: the agent sends what is kept and one byte more, no more
            parts.append(str(request.max_output))
        payload = b"".join(p.encode() + b"\0" for p in parts)
        kind = T_EXEC
        if request.pty is not None:
            kind = T_EXEC_PTY
            payload = struct.pack("<HH", *request.pty) + payload
        elif spare is not None:
            kind = T_EXEC_SPARE
            payload = struct.pack("<I", spare) + payload
        frame = HEADER.pack(kind, ident, len(payload)) + payload
        if request.stdin_closed:
            frame += HEADER.pack(T_STDIN_EOF, ident, 0)  # with it: the agent reads both in one wake-up
        try:
            self._write(frame)
        except BaseException:
            self._execs.pop(ident, None)
            raise
        proc._eof_sent = request.stdin_closed
        return proc


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
        self._out = {"stdout": bytearray(), "stderr": bytearray()}
        self._truncated = False
        self._status: int | None = None
        self._error = ""
        #: why the command could not be placed in the sandbox's cgroups (it was killed before exec)
        self._unplaced = ""
        #: its process was gone when placed: held before exec, it never ran the user's code
        self._gone_before_placed = False
        #: signals the caller sent (kill() is 9): a held process they ended is not a containment failure
        self._requested_signals: set[int] = set()
        self._timed_out = False
        self.pid: int | None = None
        #: set by the tier's ``finish`` hook (from cgroup counters)
        self.oom_killed = False

    # reader-thread callbacks
    def _started(self, nspid: int) -> None:
        if nspid == self._spare:
            self.pid = nspid  # placed and checked before it was sent; the agent let it go
            return
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
            self._channel.send(T_SIGNAL, self._id, struct.pack("<i", 9))
        # published only now: a signal sent once the pid is known reaches a placed, running process
        self.pid = nspid

    def _output(self, stream: str, chunk: bytes) -> None:
        buf = self._out[stream]
        room = self._request.max_output - len(buf)
        if room < len(chunk):
            self._truncated = True
        if room > 0:
            buf += chunk[:room]
        if self._on_output is not None:
            try:
                self._on_output(stream, chunk)
            except Exception:  # a caller's callback must not kill the reader
                pass

    def _exited(self, status: int) -> None:
        self._status = status
        self._done.set()

    def _failed(self, message: str) -> None:
        self._error = message
        self._done.set()

    def _agent_gone(self) -> None:
        if not self._done.is_set():
            self._error = self._error or "the sandbox stopped while the command ran"
            self._done.set()

    # Process API
    def write_stdin(self, data: bytes) -> None:
        for offset in range(0, len(data), 1 << 20):
            self._channel.send(T_STDIN, self._id, data[offset : offset + (1 << 20)])

    def close_stdin(self) -> None:
        if not self._eof_sent:
            self._eof_sent = True
            self._channel.send(T_STDIN_EOF, self._id)

    def send_signal(self, signum: int) -> None:
        self._requested_signals.add(signum)
        self._channel.send(T_SIGNAL, self._id, struct.pack("<i", signum))

    def kill(self) -> None:
        self._requested_signals.add(9)
        # the cgroup kill below misses a command not yet placed in its leaf; the agent's kill
        # reaches it while it is held, so it never runs
        with contextlib.suppress(OSError, SandboxClosed):
            self._channel.send(T_SIGNAL, self._id, struct.pack("<i", 9))
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
