"""Host side of the in-sandbox agent protocol (``src/corral/agent/agent.c``).

Every tier that runs Linux userland (process, gVisor, microVM) starts
``corral-agent`` inside the sandbox and talks to it over a byte stream (pipes,
or a virtio-serial port).  Frames are ``u8 type | u32 id | u32 len | payload``.

Everything the agent says is untrusted: sizes are capped, unknown ids are
ignored, and timeouts are enforced here, by killing the command's cgroup (the
``kill`` hook), never by asking the agent -- or, where only the agent can reach
that cgroup (gVisor, microVM), by a backstop that ends the whole sandbox when
the agent does not obey within a few seconds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator

from ...egress.tunnel import ConnectionRate
from ...errors import FileError, FileNotFoundInSandbox, SandboxClosed
from ...host import fdwait
from ...images import SANDBOX_UID
from ...spec import path_bytes
from ..base import (
    ExecRequest,
    FileEntry,
    OutputCallback,
    too_many_entries,
)
from .agent_process import AgentProcess
from .answers import LIST_ANSWER_LIMIT, MAX_ERROR_TEXT, STAT_ANSWER_LIMIT, parse_listing, parse_stat
from .frames import (
    HEADER,
    MAX_FRAME,
    PUT_ABORT,
    PUT_MORE,
    PUT_PARENTS,
    T_AS_AGENT,
    T_DATA,
    T_ERR,
    T_EXEC,
    T_EXEC_PTY,
    T_EXEC_SPARE,
    T_EXIT,
    T_FLIST,
    T_FMKDIR,
    T_FPUT,
    T_FREAD,
    T_FREMOVE,
    T_FSTAT,
    T_GUEST,
    T_OK,
    T_READY,
    T_SIGNALED,
    T_SPARE,
    T_STARTED,
    T_STDERR,
    T_STDIN_ACK,
    T_STDIN_EOF,
    T_STDOUT,
)
from .pause import PauseClock

#: what root inside holds, within the sandbox's own user namespace only: Docker's default set
#: without MKNOD, SYS_CHROOT (refused by the seccomp filter anyway) and NET_RAW (raw packets are
#: not what package installs need, and the egress rules were not written against forged ones)
ROOT_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
             "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_AUDIT_WRITE", "CAP_SETFCAP")
#: the uid inside of each ``user`` (``spec.USERS``)
USER_IDS = {"root": 0, "user": SANDBOX_UID}
#: the uid inside of the egress relay (``network="allow"``; agent.c's RELAY_UID): one no command
#: runs as, so the default user's commands cannot stop, kill or stand in for it
RELAY_UID = 65533

#: how long a frame may wait for the agent to read it.  The agent reads between requests, so
#: only an agent stuck in one (or gone) makes a writer wait; a write never blocks for ever, as
#: it did when a fifo at a written path held the agent (and a server's event loop with it)
WRITE_TIMEOUT = 60.0
WRITE_CHUNK = 4 << 20
#: the most a request that is not a read or a listing is answered with: nothing, or (a T_FPUT
#: with more to come) the target's and its temporary file's paths.  A guest root that answered
#: each command's leaf mkdir with 63 MiB of T_DATA had the owner keep it all (the default limit
#: was MAX_FRAME) for the command's timeout: 8 background commands took the owner to 534 MiB
SMALL_ANSWER_LIMIT = 16 << 10
#: frames that answer nothing the host asked (an unknown id, a read's T_DATA for another request,
#: a malformed frame) are read at most this fast, past a burst: the reader waits, so the agent's
#: port waits too.  Some are expected (a request given up, a fired one, the output of commands a
#: live snapshot carried into a VM); a guest root that wrote 9-byte frames for no request at full
#: speed cost the owner 5-6 s of CPU in 10.5 s, parsed in Python and charged to no cgroup
#: (another sandbox's `true` p50 2.5 -> 8.5-11.4 ms)
STRAY_FRAME_BURST = 16384
STRAY_FRAME_RATE = 4096.0
#: a frame of a request's or a command's data (output, a read's T_DATA, a stdin acknowledgement)
#: carrying less than this is held to STRAY_FRAME_RATE too, as is one for a running command that
#: changes nothing (a T_STARTED again, a T_SIGNALED for no signal sent, output past a kept cap
#: nobody streams).  Those were free for the ids of the guest's own commands (small and numbered
#: in order): a guest root writing them for its own command at full speed cost the owner 11.5-13.8 s
#: of CPU in 25-33 s (another sandbox's `true` p50 2.3 -> 4.8-11 ms, max 266 ms), 1-byte output
#: up to a 16 MiB cap 16 million frames.  The agent reads a command's output (and a file) in
#: chunks of up to 64 KiB, and while the host holds it its pipes fill: a held stream comes in
#: bigger frames, not fewer bytes
SMALL_FRAME = 4096
#: the least a reader held by STRAY_FRAME_RATE waits: frames pass in batches, not a sleep each
STRAY_HOLD = 0.05


class _Pending:
    def __init__(self, limit: int, takes_data: bool) -> None:
        self.done = threading.Event()
        self.kind = 0
        self.data = bytearray()
        self.limit = limit
        #: only a read is answered with T_DATA frames; any other request's are forged
        self.takes_data = takes_data
        self.overflow = False


class AgentChannel:
    """A framed, multiplexed connection to one agent."""

    def __init__(self, reader: int, writer: int, initial: bytes = b"") -> None:
        self._rfile = os.fdopen(reader, "rb", buffering=1 << 16)
        #: bytes already read from ``reader`` by the caller, read first
        self._initial = initial
        self._wfd = writer
        #: a socket's other descriptors (the reader's) share its O_NONBLOCK: it is sent to with
        #: MSG_DONTWAIT instead; a pipe's write end is ours alone and is made non-blocking
        self._wsock = socket.socket(fileno=os.dup(writer)) if stat.S_ISSOCK(os.fstat(writer).st_mode) else None
        if self._wsock is None:
            os.set_blocking(writer, False)
        self._wlock = threading.Lock()
        #: half a frame went out before the agent stopped reading: nothing more can be sent
        self._broken = False
        self._closing = False
        #: close() was called: the write descriptors are closed by whoever holds ``_wlock`` last
        #: (:meth:`_unlock_writer`), never under a writer (see :meth:`_retire_writer`)
        self._retired = False
        self._write_fds_open = True
        self._retire_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next_id = 1
        self._pending: dict[int, _Pending] = {}
        self._execs: dict[int, AgentProcess] = {}
        self.ready = threading.Event()
        #: the agent says when it has delivered a signal (T_SIGNALED: "corral-agent 2" and later)
        self.acks_signals = False
        self.closed = threading.Event()
        #: called (on the reader thread) with the pid of each spare the agent forks (``--spare``)
        self.on_spare: Callable[[int], None] | None = None
        #: time the sandbox spent paused: commands' timeouts do not run meanwhile
        self.pause_clock = PauseClock()
        #: a request's ``user`` -> the uid the agent makes the command (agents that can switch
        #: users: root of the sandbox's user namespace); a user not here runs as the agent's default
        self.user_ids: dict[str, int] = {}
        self._strays = ConnectionRate(rate=STRAY_FRAME_RATE, burst=STRAY_FRAME_BURST)  # (the reader's only)
        self._thread = threading.Thread(target=self._read_loop, name="corral-agent-reader", daemon=True)
        self._thread.start()

    # -- framing -------------------------------------------------------
    def send(self, kind: int, ident: int, payload: bytes = b"") -> None:
        self._write(HEADER.pack(kind, ident, len(payload)) + payload)

    def try_send(self, kind: int, ident: int, payload: bytes = b"") -> bool:
        """Send a small frame only if the agent can take it now (a kill's signal: the cgroup kill
        after it does not wait for an agent that reads nothing); False if it was not sent."""
        if self.closed.is_set() or self._broken or not self._wlock.acquire(blocking=False):
            return False
        try:
            return self._write_locked(HEADER.pack(kind, ident, len(payload)) + payload, 0.0)
        except SandboxClosed:
            return False
        finally:
            self._unlock_writer()

    def _write(self, frame: bytes) -> None:
        """Whole frames, in one write where the pipe takes it; SandboxClosed if the agent has read
        none of it within WRITE_TIMEOUT (it is stuck: the channel is given up)."""
        timeout = WRITE_TIMEOUT
        if self.closed.is_set() or self._broken:
            raise SandboxClosed("the sandbox is no longer running")
        while not self._wlock.acquire(timeout=timeout):
            if not self.pause_clock.paused:  # (another writer waits for a paused agent: so does this one)
                raise SandboxClosed(f"the sandbox's agent has read nothing sent to it for {timeout:.0f} s")
        try:
            if self._broken:  # given up while this waited its turn
                raise SandboxClosed("the sandbox's agent stopped reading what was sent to it")
            if not self._write_locked(frame, timeout):
                self._broken = True
                raise SandboxClosed(f"the sandbox's agent has read nothing sent to it for {timeout:.0f} s")
        finally:
            self._unlock_writer()

    def _write_locked(self, frame: bytes, timeout: float) -> bool:
        """Write ``frame``; False if none of it could be written within ``timeout``.  Half a frame
        followed by ``timeout`` of nothing breaks the channel (SandboxClosed)."""
        view = memoryview(frame)
        # time the sandbox spends paused does not count: its agent is frozen, not stuck
        deadline = time.monotonic() + timeout - self.pause_clock.paused_total()
        if self._retired:
            raise SandboxClosed("the sandbox is no longer running")
        try:
            while view:
                try:
                    sent = (self._wsock.send(view, socket.MSG_DONTWAIT) if self._wsock is not None
                            else os.write(self._wfd, view))
                except BlockingIOError:
                    if self._retired:  # closed meanwhile: its descriptor now polls ready at once
                        raise SandboxClosed("the sandbox is no longer running") from None
                    left = deadline - time.monotonic() + self.pause_clock.paused_total()
                    if left <= 0 and len(view) == len(frame):
                        return False
                    if left <= 0:
                        self._broken = True
                        raise SandboxClosed("the sandbox's agent stopped reading in the middle of a request") from None
                    fdwait.writable(self._wfd, left)
                    continue
                view = view[sent:]
        except OSError as exc:
            raise SandboxClosed(f"the sandbox is no longer running ({exc.strerror})") from None
        return True

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
        self._wlock.acquire()
        try:
            if self.closed.is_set():
                raise SandboxClosed("the sandbox is no longer running")
            ident = self.new_id()
            pending = _Pending(STAT_ANSWER_LIMIT, takes_data=False)
            self._pending[ident] = pending
            try:
                if not self._write_locked(HEADER.pack(T_FSTAT, ident, 2) + b"/\0", timeout):
                    raise SandboxClosed(f"the sandbox's agent has read nothing sent to it for {timeout:.0f} s")
            except SandboxClosed:
                self._pending.pop(ident, None)
                raise
            self._answer(ident, pending, STAT_ANSWER_LIMIT, timeout)
            yield
        finally:
            self._unlock_writer()

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
                if not self._dispatch(kind, ident, payload):
                    self._hold_strays()  # (a stray, or too small for what it costs: see SMALL_FRAME)
        except (OSError, ValueError):
            pass
        finally:
            self.closed.set()
            for pending in list(self._pending.values()):
                if pending.kind == 0:  # never answered now (SandboxClosed): what came of it goes
                    pending.data = bytearray()
                pending.done.set()
            # their waiters get SandboxClosed; a command that never started keeps its request's
            # waiter, and the sandbox object keeps the channel: neither keeps what was sent for it
            self._pending.clear()
            for proc in list(self._execs.values()):
                proc._agent_gone()
            # nothing is dispatched to them now: the channel (which its sandbox object keeps, and
            # that may outlive the sandbox) does not keep them, nor the output each holds
            self._execs.clear()
            if self._closing:  # close() left the file to this thread, which held it
                with contextlib.suppress(OSError):
                    self._rfile.close()

    def _hold_strays(self) -> None:
        while (wait := self._strays.take()) and not self._closing:
            time.sleep(max(wait, STRAY_HOLD))

    def _dispatch(self, kind: int, ident: int, payload: bytes) -> bool:
        """Act on one frame; False: it is held to STRAY_FRAME_RATE (it answers nothing asked, or
        changes nothing, or carries less than SMALL_FRAME bytes of a stream)."""
        if kind == T_READY:
            if self.ready.is_set():
                return False
            name, _, version = payload.partition(b" ")
            self.acks_signals = name == b"corral-agent" and version.isdigit() and int(version) >= 2
            self.ready.set()
            return True
        if kind == T_SPARE:
            if self.on_spare is None or len(payload) != 4:
                return False
            self.on_spare(struct.unpack("<I", payload)[0])
            return True
        proc = self._execs.get(ident)
        if proc is not None:
            return self._exec_frame(proc, kind, ident, payload)
        pending = self._pending.get(ident)
        if pending is None:
            return False  # (a late T_SIGNALED, a fired request's answer: strays within the budget)
        if pending.done.is_set():
            return False  # answered already
        if kind == T_DATA:
            if not pending.takes_data or pending.overflow:
                pending.overflow = True
                return False
            if len(pending.data) + len(payload) > pending.limit:
                pending.overflow = True
            else:
                pending.data += payload
            return len(payload) >= SMALL_FRAME
        if kind not in (T_OK, T_ERR):
            return False
        pending.kind = kind
        if kind == T_OK:
            # the answer's bound holds for all of it (a microVM guest's root answers for its agent:
            # a T_OK of 32 MiB came back from a read of max_bytes=1024)
            if len(pending.data) + len(payload) > pending.limit:
                pending.overflow = True
            else:
                pending.data += payload
        else:
            pending.data = bytearray(payload[:4 + MAX_ERROR_TEXT])
        pending.done.set()
        return True

    def _exec_frame(self, proc: AgentProcess, kind: int, ident: int, payload: bytes) -> bool:
        """As :meth:`_dispatch`, for a running command's frames (whose ids a guest can guess)."""
        if kind == T_STARTED and len(payload) == 4:
            return proc._started(struct.unpack("<I", payload)[0])
        if kind in (T_STDOUT, T_STDERR) and payload:  # (the agent never sends an empty one)
            return proc._output("stdout" if kind == T_STDOUT else "stderr", payload) and len(payload) >= SMALL_FRAME
        if kind == T_STDIN_ACK and len(payload) == 4:
            return proc._stdin_taken(struct.unpack("<I", payload)[0]) >= SMALL_FRAME
        if kind == T_SIGNALED:
            return proc._signal_delivered()
        if kind == T_EXIT and len(payload) == 4:
            self._execs.pop(ident, None)
            proc._exited(struct.unpack("<i", payload)[0])
        elif kind == T_ERR:
            self._execs.pop(ident, None)
            proc._failed(payload[4:].decode(errors="replace"))
        else:
            return False
        return True

    def wait_ready(self, timeout: float) -> None:
        # wake up now and then: a channel that closes before "ready" (its
        # process died) fails at once instead of after the whole timeout
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.05):
            if self.closed.is_set() or time.monotonic() > deadline:
                break
        if not self.ready.is_set():
            raise SandboxClosed("the sandbox agent did not start")

    def _retire_writer(self) -> None:
        """Stop every write now, and close the write descriptors once no writer can use them.

        close() used to close the descriptor under writers blocked in their wait for it (a
        paused sandbox's, a slow reader's): their ``os.write`` then went to whatever the number
        was reused for -- the server's registry database (its first page overwritten with a
        tenant's frames, every create then failed) or another client's connection.  Now the
        number is first made a pipe nobody reads (``dup2``: it stays taken, and a write fails with
        EPIPE at once), and it is closed by whoever holds the write lock last."""
        with self._retire_lock:
            if self._retired:
                return
            self._retired = True
            broken_r, broken_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            os.close(broken_r)
            try:
                os.dup2(broken_w, self._wfd, inheritable=False)
            except OSError:
                pass
            finally:
                os.close(broken_w)
            if not self._wlock.acquire(blocking=False):
                return  # a writer holds it: it closes them as it lets go (_unlock_writer)
        try:
            self._close_write_fds()
        finally:
            self._wlock.release()

    def _unlock_writer(self) -> None:
        with self._retire_lock:
            if self._retired:
                self._close_write_fds()
            self._wlock.release()

    def _close_write_fds(self) -> None:
        if not self._write_fds_open:
            return
        self._write_fds_open = False
        with contextlib.suppress(OSError):
            os.close(self._wfd)
        if self._wsock is not None:
            self._wsock.close()

    def hang_up(self) -> None:
        """Close the host's end of the requests: the agent reads its end and exits (as the
        sandbox's pid 1, its namespace with it); :meth:`close` then finds the reader done."""
        self._retire_writer()

    def close(self) -> None:
        self._retire_writer()
        self._closing = True
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            # an agent that neither reads nor exits (stopped, stuck): the reader holds the file's
            # lock in its read, and closing the file here would wait for it for ever; the
            # tier's kill ends the agent, the read, and the reader closes the file itself
            return
        try:
            self._rfile.close()
        except OSError:
            pass

    # -- requests --------------------------------------------------------
    def call(self, kind: int, payload: bytes, limit: int = SMALL_ANSWER_LIMIT, timeout: float = 60.0) -> bytes:
        return self.begin(kind, payload, limit)(timeout)

    def begin(self, kind: int, payload: bytes, limit: int = SMALL_ANSWER_LIMIT) -> Callable[[float], bytes]:
        """Send a request now; the returned function waits for its answer (or raises).
        The agent answers in order, so requests sent later can go before the wait.
        ``limit``: the most its answer may hold (a read's ``max_bytes``, a listing's bound)."""
        ident = self.new_id()
        pending = _Pending(limit, takes_data=(kind & ~T_AS_AGENT) == T_FREAD)
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
            if err == errno.EFBIG:
                raise FileError(f"{message}: file is larger than the {limit} byte limit", err)
            if err == errno.E2BIG:
                raise FileError(too_many_entries(message), err)
            cls = FileNotFoundInSandbox if err == 2 else FileError
            raise cls(message, err)
        if pending.overflow:
            raise FileError(f"file is larger than the {limit} byte limit", 27)
        return bytes(pending.data)

    def read_file(self, path: str, max_bytes: int, *, as_agent: bool = False, timeout: float = 60.0) -> bytes:
        # the limit goes with the request: the agent refuses a larger file instead of sending it
        request = path_bytes(path) + b"\0" + str(max_bytes).encode() + b"\0"
        return self.call(T_FREAD | (T_AS_AGENT if as_agent else 0), request, limit=max_bytes, timeout=timeout)

    def write_file(self, path: str, data: bytes, mode: int, *, as_agent: bool = False) -> None:
        """The whole of ``data`` at ``path``, or (on any error) the file as it was: the agent writes
        a temporary file beside it, in chunks, and renames it over ``path`` with the last one
        (files.c, do_fput: modes, owners and links there).  ``as_agent``: with the agent's own ids
        (the host's own files), not the default user's."""
        kind = T_FPUT | (T_AS_AGENT if as_agent else 0)
        target, temp = path_bytes(path), b""
        for offset in range(0, max(len(data), 1), WRITE_CHUNK):
            more = offset + WRITE_CHUNK < len(data)
            head = struct.pack("<II", mode, PUT_PARENTS | (PUT_MORE if more else 0)) + target + b"\0" + temp + b"\0"
            try:
                answer = self.call(kind, head + data[offset : offset + WRITE_CHUNK])
            except FileError:
                raise  # the agent removed its temporary file
            except BaseException:
                if temp:  # (a timeout, a KeyboardInterrupt): the agent removes it when it gets here
                    self.try_send(kind, self.new_id(), struct.pack("<II", mode, PUT_ABORT) + target + b"\0" + temp + b"\0")
                raise
            if more and not temp:
                target, temp = answer.split(b"\0")[:2]

    def list_dir(self, path: str) -> list[FileEntry]:
        """The entries of ``path``, read as a guest's root may have written them (:mod:`.answers`)."""
        try:
            raw = self.call(T_FLIST, path_bytes(path) + b"\0", limit=LIST_ANSWER_LIMIT)
        except FileError as exc:
            if exc.errno != errno.EFBIG:
                raise
            raise FileError(too_many_entries(path), errno.E2BIG) from None
        return parse_listing(raw, path)

    def stat(self, path: str) -> FileEntry:
        return parse_stat(self.call(T_FSTAT, path_bytes(path) + b"\0", limit=STAT_ANSWER_LIMIT), path)

    def remove(self, path: str, recursive: bool) -> None:
        self.call(T_FREMOVE, struct.pack("<I", int(recursive)) + path_bytes(path) + b"\0")

    def make_dir(self, path: str, mode: int) -> None:
        self.call(T_FMKDIR, struct.pack("<I", mode) + path_bytes(path) + b"\0")

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
