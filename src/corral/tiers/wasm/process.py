"""A command of the wasm tier: its worker process seen from the host.

The worker's stdout and stderr are pipes read here as output is produced; its
control socket reports how the guest ended (exit code, trap, fuel, memory).
The host keeps its own deadline a little past the guest's epoch timeout: a
guest blocked in a host call (``time.sleep``) cannot be interrupted by an
epoch tick, so its worker is SIGKILLed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from ...host import fdwait
from ...spec import MiB
from ..base import ExecRequest, ExecResult, OutputCallback, Process, keep_output
from .runtime import Worker

if TYPE_CHECKING:
    from .sandbox import WasmSandbox

#: how long past its timeout a guest blocked in a host call may take before it is killed
KILL_GRACE = 0.5
SIGXCPU = 24
#: a control message is under 1 KiB (exit, trap, fuel, memory, CPU): a line longer than this is
#: a worker taken over (a flaw in wasmtime), whose unbounded line the owner held and rescanned
MAX_CONTROL_LINE = 64 * 1024
_MEMORY_ERROR = re.compile(rb"^(MemoryError\b|Fatal Python error: .*(memory|MemoryError))", re.MULTILINE)


class RefusedProcess(Process):
    """A command that cannot exist in this tier: exit 127 with the reason, like a shell's 'not found'."""

    pid = 0

    def __init__(self, message: str, on_output: OutputCallback | None) -> None:
        self._stderr = f"corral: {message}\n"
        if on_output is not None:
            try:
                on_output("stderr", self._stderr.encode())
            except Exception:
                pass

    def write_stdin(self, data: bytes) -> None:
        pass

    def close_stdin(self) -> None:
        pass

    def send_signal(self, signum: int) -> None:
        pass

    def kill(self) -> None:
        pass

    def wait(self) -> ExecResult:
        return ExecResult(exit_code=127, stderr=self._stderr)

    @property
    def done(self) -> bool:
        return True


class WasmProcess(Process):
    """One command in its own worker process; output read straight from the worker's pipes."""

    pid = 0  # a guest is not a process the sandbox could see

    def __init__(self, sandbox: WasmSandbox, worker: Worker, request: ExecRequest,
                 on_output: OutputCallback | None, job: dict[str, Any], launch: bytes | None = None) -> None:
        self.worker = worker
        self._sandbox = sandbox
        self._request = request
        self._on_output = on_output
        self._memory_limit = int(job["memory"])
        self._start = time.monotonic()
        self._done = threading.Event()
        self._out = {"stdout": bytearray(), "stderr": bytearray()}
        self._stderr_tail = bytearray()
        self._truncated = False
        self._outcome: dict[str, Any] | None = None
        self._timed_out = False
        self._killed_by: int | None = None
        #: the worker sent what no worker of ours sends (see _control): it was killed
        self._broken_protocol = False
        self._result: ExecResult | None = None
        self._result_lock = threading.Lock()
        self._stdin_lock = threading.Lock()
        self._oom_before = sandbox.oom_kills()
        if launch is not None:
            # a pre-started guest: the command goes to its stdin, then the clock starts.  An
            # OSError from the stdin write is a guest gone before it had its command (the caller
            # starts a fresh one); once it has it, it may have run it already (a short command
            # can end before the "go"): never run again, the reader sees how it ended, and the
            # host's own deadline holds (a full run saw `os.makedirs` find its directory made)
            self.write_stdin(launch)
            with contextlib.suppress(OSError):
                worker.control.sendall(json.dumps({"go": request.timeout}).encode() + b"\n")
        self._reader = threading.Thread(target=self._read_loop, name=f"corral-wasm-{worker.pid}", daemon=True)
        self._reader.start()

    # -- reader thread -------------------------------------------------------
    def _read_loop(self) -> None:
        sel = selectors.DefaultSelector()
        worker = self.worker
        sel.register(worker.stdout_r, selectors.EVENT_READ, "stdout")
        sel.register(worker.stderr_r, selectors.EVENT_READ, "stderr")
        sel.register(worker.control.fileno(), selectors.EVENT_READ, "control")
        control = bytearray()
        open_streams = 3
        try:
            while open_streams:
                for key, _ in sel.select():
                    stream = key.data
                    try:
                        chunk = os.read(key.fd, 65536)
                    except OSError:
                        chunk = b""
                    if not chunk:
                        sel.unregister(key.fd)
                        open_streams -= 1
                        continue
                    if stream == "control":
                        if not self._control(control, chunk):
                            # a worker that breaks its protocol is not trusted to say how it ended
                            self._broken_protocol = True
                            worker.kill()
                            sel.unregister(key.fd)
                            open_streams -= 1
                    else:
                        self._output(stream, chunk)
        finally:
            sel.close()
            if not worker.reap(5.0):
                worker.kill()
            self._done.set()

    def _control(self, pending: bytearray, chunk: bytes) -> bool:
        """Take ``chunk`` of the control socket (``pending``: the line so far); False if the
        worker broke its protocol: a line past :data:`MAX_CONTROL_LINE` or not an outcome.
        Only the new chunk is searched for a line's end (the whole buffer was rescanned on
        every read: 64 MiB without a newline cost the owner 27 s of CPU and 95 MiB)."""
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            pending += chunk[start:end]
            start = end + 1
            if len(pending) > MAX_CONTROL_LINE:
                return False
            try:
                message = json.loads(pending)
            except ValueError:
                return False
            pending.clear()
            if not _is_outcome(message):
                return False
            if "exit" in message:
                self._outcome = message
        pending += chunk[start:]
        return len(pending) <= MAX_CONTROL_LINE

    def _output(self, stream: str, chunk: bytes) -> None:
        if keep_output(self._out[stream], chunk, self._request.max_output):
            self._truncated = True
        if stream == "stderr":
            self._stderr_tail += chunk
            del self._stderr_tail[:-8192]
        if self._on_output is not None:
            try:
                self._on_output(stream, chunk)
            except Exception:
                pass

    # -- Process API ---------------------------------------------------------
    def write_stdin(self, data: bytes) -> None:
        """Waits, as a pipe's writer does, while the guest takes none of it, but not past the
        command's end or its timeout: a guest blocked in a host call that never read its stdin
        (``time.sleep``, which epoch interruption cannot end) held a blocking write, and so
        ``run(stdin=...)``, until it ended by itself, long past its timeout (``wait`` ends it)."""
        with self._stdin_lock:
            fd = self.worker.stdin_w
            if fd < 0:
                return
            os.set_blocking(fd, False)
            deadline = self._start + self._request.timeout + KILL_GRACE
            view = memoryview(data)
            try:
                while view and not self._done.is_set():
                    try:
                        view = view[os.write(fd, view):]
                    except BlockingIOError:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return
                        fdwait.writable(fd, min(left, 0.5))
            except OSError:  # the guest is gone (BrokenPipeError) or its stdin closed
                pass

    def close_stdin(self) -> None:
        with self._stdin_lock:
            if self.worker.stdin_w >= 0:
                os.close(self.worker.stdin_w)
                self.worker.stdin_w = -1

    def send_signal(self, signum: int) -> None:
        # WASI has no signals: every terminating signal ends the command's worker
        if signum in (signal.SIGCHLD, signal.SIGWINCH, signal.SIGURG, signal.SIGCONT, 0):
            return
        self._killed_by = signum
        self.worker.kill()

    def kill(self) -> None:
        if self._killed_by is None:
            self._killed_by = signal.SIGKILL
        self.worker.kill()

    def join(self, timeout: float) -> None:
        self._done.wait(timeout)
        self._finish()

    def kept_output(self) -> dict[str, bytes]:
        return {stream: bytes(data) for stream, data in self._out.items()}

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> ExecResult:
        deadline = self._start + self._request.timeout + KILL_GRACE
        if not self._done.wait(max(0.0, deadline - time.monotonic())):
            self._timed_out = True
            self.worker.kill()
            self._done.wait(5.0)
        return self._finish()

    def _finish(self) -> ExecResult:
        with self._result_lock:
            if self._result is None:
                self._result = self._build_result()
                self.close_stdin()
                self.worker.close()
                self._sandbox._finished(self)
            return self._result

    @property
    def outcome(self) -> dict[str, Any]:
        """What the worker reported: exit, trap, fuel_used, memory (bytes), cpu_ms; empty if it died."""
        return self._outcome or {}

    def _build_result(self) -> ExecResult:
        outcome = {} if self._broken_protocol else self.outcome
        trap = outcome.get("trap")
        exit_code = outcome.get("exit")
        signal_number: int | None = None
        note = ""
        timed_out = self._timed_out or trap == "interrupt"
        oom = self._sandbox.oom_kills() > self._oom_before
        if timed_out:
            exit_code = 124
        elif trap == "out_of_fuel":
            signal_number, exit_code = SIGXCPU, 128 + SIGXCPU
            note = "CPU budget exhausted (wasm fuel: cpus x timeout CPU-seconds)"
        elif trap is not None:
            exit_code = 134
            note = f"the WebAssembly guest trapped: {trap}: {outcome.get('message', '')}"
        elif exit_code is None:
            # the worker ended without reporting: killed by us, by the cgroup's OOM killer, or crashed
            signal_number = self._killed_by if self._killed_by is not None else signal.SIGKILL
            exit_code = 128 + signal_number
            if self._broken_protocol:
                note = "the wasm worker broke its control protocol and was killed"
            elif self._killed_by is None and not oom:
                note = "the wasm worker died before its guest ended"
        if not timed_out and exit_code != 0 and _MEMORY_ERROR.search(bytes(self._stderr_tail)):
            oom = True
        if trap is not None and int(outcome.get("memory") or 0) >= self._memory_limit - 4 * MiB:
            oom = True
        stderr = self._out["stderr"].decode(errors="replace")
        if note:
            stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + f"corral: {note}\n"
        return ExecResult(
            exit_code=int(exit_code),
            stdout=self._out["stdout"].decode(errors="replace"),
            stderr=stderr,
            duration_ms=round((time.monotonic() - self._start) * 1000, 3),
            timed_out=timed_out,
            oom_killed=oom,
            signal=signal_number,
            truncated=self._truncated,
        )


def _is_outcome(message: object) -> bool:
    """A control message of the shape the worker sends (the result is built from its fields)."""
    if not isinstance(message, dict):
        return False
    exit_code, trap = message.get("exit"), message.get("trap")
    numbers = (message.get(name) for name in ("memory", "fuel_used", "cpu_ms"))
    return ((exit_code is None or (isinstance(exit_code, int) and not isinstance(exit_code, bool)))
            and (trap is None or isinstance(trap, str))
            and all(n is None or (isinstance(n, (int, float)) and not isinstance(n, bool)) for n in numbers))
