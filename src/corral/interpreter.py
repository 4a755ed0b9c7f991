"""A stateful code interpreter inside a sandbox, shaped like E2B's.

``sandbox.run_code(code)`` sends a cell to a kernel process running *inside*
the sandbox (started with ``sandbox.commands.start``; see
``kernel/python_kernel.py`` for the line protocol) and returns an
:class:`Execution`: ``logs.stdout``/``logs.stderr`` (lists of str),
``error`` (name, value, traceback) and ``results`` (each with the formats it
has: ``text``, ``html``, ``png`` base64, ...).  Variables and imports survive
across cells.

Timeouts: the cell gets SIGINT (KeyboardInterrupt); the kernel keeps its state
and the execution says ``timed_out``.  If the kernel does not come back within
:data:`INTERRUPT_GRACE` seconds of the interrupt's delivery, or it died, it is killed
and restarted and the execution says ``restarted`` (state lost).

Languages are entries of :data:`KERNELS`: Python (``kernel/python_kernel.py``) and
JavaScript under node (``kernel/js_kernel.js``), speaking the same protocol.  Each
sandbox has one interpreter per language by default; ``create_code_context`` makes
more (their own variables and working directory).
"""

from __future__ import annotations

import functools
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .commands import CommandHandle, check_call
from .errors import InvalidSpec, SandboxClosed
from .execution import Execution, ExecutionError, Result

if TYPE_CHECKING:
    from .local_backend import LocalBackend
    from .sandbox import Sandbox

#: seconds a cell may run when the caller does not say
DEFAULT_TIMEOUT = 60.0
#: seconds an interrupted cell gets to return before the kernel is restarted, from when the
#: sandbox's agent delivered the interrupt
INTERRUPT_GRACE = 5.0
#: seconds the agent may take to deliver it: it runs in the sandbox's cgroups, and with a cell
#: keeping their CPU quota spent (a fork bomb's copies) it did so 0.1-8.5 s after it was sent (at
#: 0.25-0.5 CPU on a loaded host, up to ~11 s at 0.2; a throttled task waits for the next period
#: at each return from a system call):
#: counted in INTERRUPT_GRACE, that restarted kernels that had not had the interrupt yet.  Only an
#: agent that does not run at all waits this out (one older than T_SIGNALED is not waited for).
DELIVERY_GRACE = 30.0
#: seconds more for a kernel that said the interrupt came and is ending the copies of itself a
#: cell forked (its own bound is 10 s): with little CPU that took over INTERRUPT_GRACE, and the
#: kernel, state and all, was restarted though it was about to answer
CLEANUP_GRACE = 12.0
START_TIMEOUT = 30.0
#: longest protocol line accepted from a kernel
MAX_FRAME = 64 << 20
#: bytes a frame may run past the cell's output budget and still be parsed (an error's traceback)
FRAME_SLACK = 1 << 20
#: how long the kernel process itself may live (the sandbox's per-command clock)
KERNEL_LIFETIME = 7 * 86400
#: code contexts (``create_code_context``) one sandbox may have, each an interpreter process whose
#: running cell the owner holds (ResourceLimit, 429 over REST, past it)
MAX_CODE_CONTEXTS = 16
_KERNEL_DIR = Path(__file__).parent / "kernel"
KERNELS: dict[str, Callable[[], list[str]]] = {
    "python": lambda: ["python3", "-u", "-c", (_KERNEL_DIR / "python_kernel.py").read_text()],
    "javascript": lambda: ["node", "-e", (_KERNEL_DIR / "js_kernel.js").read_text()],
}


def is_kernel(argv: list[str]) -> bool:
    """True for the command line of an interpreter kernel: Corral's own process, not one the
    caller started, so ``commands.list()`` leaves it out."""
    return tuple(argv) in _kernel_argvs()


@functools.cache
def _kernel_argvs() -> frozenset[tuple[str, ...]]:
    return frozenset(tuple(kernel()) for kernel in KERNELS.values())  # each reads its source file


#: other names callers use for a language (E2B's "js")
LANGUAGE_ALIASES = {"js": "javascript", "node": "javascript", "py": "python", "python3": "python"}


def language_name(language: str) -> str:
    return LANGUAGE_ALIASES.get(language, language)
#: what a result costs its cell besides its bytes: the objects it becomes here (246,723 results of
#: display(None), charged at ~40 bytes each, held 79 MiB of the owner)
RESULT_COST = 1024
#: what each value of a result (a container, a string, a number) costs its cell: parsed, it is a
#: Python object of ~50-64 bytes for as little as 2 bytes of JSON (a result of 4,000,000 empty
#: lists, 16 MiB of JSON, held 308 MiB; one of 2.8 million two-letter strings, 236 MiB)
ELEMENT_COST = 64
#: a frame with more structure than this (commas, colons, brackets: counted before it is parsed,
#: those in strings too) is parsed only if that many elements would cost at most PARSE_ALLOWANCE
#: times the cell's budget left: parsing a frame refused after was the owner's peak (440 MiB)
FREE_ELEMENTS = 4096
PARSE_ALLOWANCE = 4
#: what every protocol line the running cell does not keep as output costs its budget (an empty
#: line, one that is no frame, a frame of another cell, a frame dropped by a spent budget, the cell's
#: end): each costs the owner a turn of Python (~3-5 us), so a cell that wrote newlines to the
#: kernel's protocol descriptor made the owner spend ~5 us a byte, charged to nothing (12.7 s of a
#: server's CPU in 15 s while the cell spent 2 ms)
LINE_COST = 256
#: frames that can end a cell (``interrupted``, ``error``) taken once one of its budgets is spent:
#: the kernel writes at most two of each; past this many only ``done`` is
MAX_ENDING_FRAMES = 8


def _elements(value: object) -> int:
    """How many values (containers, strings, numbers) ``value`` holds, itself included."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


class _Cell:
    def __init__(self, cell_id: int, execution: Execution, callbacks: dict[str, Callable[[Any], None] | None]):
        self.id = cell_id
        self.execution = execution
        self.callbacks = callbacks
        self.done = threading.Event()
        #: the kernel said the interrupt came (it is ending what the cell forked)
        self.interrupted = threading.Event()
        self.budget = 0
        #: the same again for what the kernel's other threads print meanwhile (``background``)
        self.background_budget = 0
        #: frames that could end the cell taken once its budget was spent
        self.ending_frames = 0

    def wanted_lines(self, language: str) -> list[tuple[bytes, str]]:
        """How the lines this cell still has use for begin (after their newline) as ``language``'s
        kernel writes them (Python's ``json.dumps``, ``JSON.stringify``: keys in the order given),
        each with its kind: ``done``, ``ending`` (``error``, ``interrupted``: past MAX_ENDING_FRAMES
        none), ``output`` while its budget lasts, ``background`` while that budget lasts."""
        sep, comma = (b": ", b", ") if language == "python" else (b":", b",")

        def start(kind: str, end: bytes, background: bool = False) -> bytes:
            mark = b'"background"' + sep + b"true" + comma if background else b""
            return b'\n{' + mark + b'"type"' + sep + b'"' + kind.encode() + b'"' + comma + b'"id"' + sep + b"%d" % self.id + end

        wanted = [(start("done", b"}"), "done")]
        if self.ending_frames < MAX_ENDING_FRAMES:
            wanted += [(start("error", comma.strip()), "ending"), (start("interrupted", b"}"), "ending")]
        if self.budget > 0:
            wanted += [(start(kind, comma.strip()), "output") for kind in ("stdout", "stderr", "result")]
        if self.background_budget > 0 and language == "python":
            wanted += [(start(kind, comma.strip(), True), "background") for kind in ("stdout", "stderr")]
        return wanted


class CodeInterpreter:
    """One kernel process in one sandbox. Cells run one at a time."""

    def __init__(self, sandbox: Sandbox, language: str = "python", cwd: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        if language not in KERNELS:
            raise InvalidSpec(f"language {language!r} is not supported; use one of {', '.join(KERNELS)}")
        self._sandbox = sandbox
        self.language = language
        self._cwd = cwd
        self._env = {"MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1", **(env or {})}
        self._run_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._handle: CommandHandle | None = None
        #: the protocol frame being received (a bytearray: a long frame costs its length, not its square)
        self._buffer = bytearray()
        self._skip_line = False
        self._cell: _Cell | None = None
        self._ready = threading.Event()
        self._next_id = 0
        self._count = 0
        #: a restart nobody was told of (its cell's client had left): the next cell says it
        self._restart_untold = False
        self._generation = 0
        #: set by close(): no cell runs and no kernel starts after it (a run waiting for the lock as
        #: its context was removed started a kernel nobody held)
        self._closed = False

    # -- kernel process ------------------------------------------------------
    def _start(self) -> None:
        self._ready = threading.Event()
        self._buffer = bytearray()
        self._skip_line = False
        self._generation += 1
        generation = self._generation

        def on_output(stream: str, chunk: bytes) -> None:
            if generation == self._generation:
                self._on_output(stream, chunk)

        # the cell's frames are taken as they arrive: the kernel's command keeps none of its output for
        # a result (it kept 2 x max_output for as long as the kernel lived, up to 7 days)
        argv = KERNELS[self.language]()
        call = replace(check_call(argv, KERNEL_LIFETIME, self._env, self._cwd or self._sandbox.cwd), keep_output=False)
        handle = CommandHandle(self._sandbox._backend.start(call, on_output), self._sandbox.id)
        with self._state_lock:  # (close() kills the kernel it sees here, or this one sees it closed)
            self._handle = handle
        deadline = time.monotonic() + START_TIMEOUT
        while not self._ready.wait(0.05):
            if self._closed or handle.done or time.monotonic() > deadline:
                self._stop()
                if self._closed:
                    raise self._removed()
                raise SandboxClosed(f"the {self.language} interpreter did not start within {START_TIMEOUT:.0f} s "
                                    f"(does image {self._sandbox.spec.image!r} have {KERNELS[self.language]()[0]}?)")

    def _stop(self) -> None:
        handle, self._handle = self._handle, None
        self._generation += 1
        if handle is not None:
            try:
                handle.kill()
                handle.wait()
            except Exception:
                pass

    def close(self) -> None:
        """End the kernel now, a running cell with it (it waited for the cell: up to its timeout, 7
        days), and return once the kernel has ended; later cells are refused."""
        with self._state_lock:
            self._closed = True
            handle = self._handle
        if handle is not None:
            try:
                handle.kill()
            except Exception:  # (ended already, or its sandbox went: _stop below waits either way)
                pass
        with self._run_lock:  # the running cell, if any, sees its kernel dead and returns at once
            self._stop()

    def _removed(self) -> InvalidSpec:
        return InvalidSpec(f"sandbox {self._sandbox.id}: this code context was removed", sandbox_id=self._sandbox.id)

    def _on_output(self, stream: str, chunk: bytes) -> None:
        # everything here comes from inside the sandbox: parse defensively, keep memory bounded
        cell = self._cell
        if stream == "stderr":  # stray descriptor-level output (subprocesses, C code)
            if cell is not None and self._charge(cell, len(chunk)):
                text = chunk.decode(errors="replace")
                cell.execution.logs.stderr.append(text)
                self._call(cell, "on_stderr", text)
            return
        # The owner's work on a chunk is bounded by what the sandbox is charged for it.  Between cells
        # nothing the kernel writes is anyone's (a cell's thread flooded newlines after it returned):
        # the chunk is dropped whole, never split.  During a cell every line costs its budget at least
        # LINE_COST (a dropped thread's frame costs that thread's budget), and once a budget is spent only
        # the lines the cell still has use for are looked for, by a few searches of the chunk (~1 ns a
        # byte), not a turn of Python a line.
        # Dropping lines the real kernel never writes, or restarting the kernel on them, would not do:
        # forged frames of the running cell, which are well formed, cost the owner the same.
        if cell is None and self._ready.is_set():
            self._buffer, self._skip_line = bytearray(), not chunk.endswith(b"\n")
            return
        first, last = chunk.find(b"\n"), chunk.rfind(b"\n")
        if first >= 0:
            # only the new chunk is searched and the frame so far is appended to, never copied: a frame
            # of n bytes costs the owner O(n) however it is cut (a 60 MiB line cost 22 s of CPU)
            if self._skip_line:  # the end of a frame that was too long: dropped
                self._skip_line = False
                self._buffer = bytearray()
            else:
                self._buffer += memoryview(chunk)[:first]
                line, self._buffer = self._buffer, bytearray()
                if cell is None or (cell.budget > 0 and cell.background_budget > 0) or line.startswith(
                        tuple(beginning[1:] for beginning, _ in cell.wanted_lines(self.language))):
                    self._take_line(cell, line)
            self._take_lines(cell, chunk, first, last)
            rest = memoryview(chunk)[last + 1:]
        else:
            rest = memoryview(chunk)
        if not self._skip_line:
            self._buffer += rest
            if len(self._buffer) > self._frame_room():  # dropped now, and the rest of its line
                self._buffer, self._skip_line = bytearray(), True
                self._dropped()

    def _take_lines(self, cell: _Cell | None, chunk: bytes, start: int, end: int) -> None:
        """The whole lines of ``chunk`` between the newlines at ``start`` and ``end``."""
        while start < end:
            if cell is not None and (cell.budget <= 0 or cell.background_budget <= 0):
                self._take_wanted_lines(cell, chunk, start, end)
                return
            stop = chunk.index(b"\n", start + 1)
            self._take_line(cell, chunk[start + 1:stop])
            start = stop

    def _take_wanted_lines(self, cell: _Cell, chunk: bytes, start: int, end: int) -> None:
        """Of the lines between the newlines at ``start`` and ``end``, those ``cell``, one of whose
        budgets is spent, has use for: a few searches of the chunk (~1 ns a byte), no turn of Python
        for a line it could not keep, each taken in the order it came."""
        found: list[tuple[int, int, str]] = []
        for beginning, kind in cell.wanted_lines(self.language):
            room = {"output": cell.budget, "background": cell.background_budget}.get(kind, 0)
            taken = 0
            at = chunk.find(beginning, start, end + 1)
            while at >= 0:
                stop = chunk.index(b"\n", at + 1, end + 1)
                found.append((at, stop, kind))
                taken += 1
                room -= stop - at
                if kind == "done" or (kind == "ending" and taken >= MAX_ENDING_FRAMES) or (
                        kind in ("output", "background") and room < 0):
                    break  # (the rest could not be kept: one done ends the cell)
                at = chunk.find(beginning, stop, end + 1)
        for at, stop, kind in sorted(found):
            if cell.done.is_set():
                break
            if kind == "ending":
                if cell.ending_frames >= MAX_ENDING_FRAMES:
                    continue
                cell.ending_frames += 1
            self._take_line(cell, chunk[at + 1:stop])
        if end - start > sum(stop - at for at, stop, _ in found):  # (output a spent budget could not keep)
            cell.execution.truncated = True

    def _take_line(self, cell: _Cell | None, line: bytes | bytearray) -> None:
        """Parse and dispatch one protocol line; what is not kept as output costs the cell LINE_COST,
        or its length if parsed (a frame refused unparsed for its size leaves the budget to what follows)."""
        kept, cost = False, LINE_COST
        if len(line) > self._frame_room() or self._too_costly_to_parse(line):
            self._dropped()
        else:
            cost = max(len(line), LINE_COST)
            try:
                message = json.loads(line)
            except (ValueError, RecursionError):  # (a forged frame nested past the parser's depth)
                message = None
            if isinstance(message, dict):
                try:
                    kept = self._dispatch(message)
                except (RecursionError, ValueError, TypeError):  # a forged frame nested past what we re-encode
                    self._dropped()
        if cell is not None and not kept:
            cell.budget -= cost

    def _frame_room(self) -> int:
        """The longest frame worth keeping now: an output frame longer than the running cell's budget
        left could not be charged, so it is dropped as it arrives, not held and parsed first (a 60 MiB
        line held 280 MiB at its peak); FRAME_SLACK more leaves room for the cell's error."""
        cell = self._cell
        return min(MAX_FRAME, (max(cell.budget, 0) if cell is not None else 0) + FRAME_SLACK)

    def _too_costly_to_parse(self, line: bytes | bytearray) -> bool:
        """Whether parsing ``line`` could cost more than the running cell has left to be charged
        (PARSE_ALLOWANCE times it, as counted before parsing: strings' commas count too)."""
        elements = line.count(b",") + line.count(b":") + line.count(b"[") + line.count(b"{")
        if elements <= FREE_ELEMENTS:
            return False
        cell = self._cell
        return cell is None or elements * ELEMENT_COST > PARSE_ALLOWANCE * max(cell.budget, 0)

    def _dropped(self) -> None:
        cell = self._cell
        if cell is not None:
            cell.execution.truncated = True

    def _charge(self, cell: _Cell, size: int, background: bool = False) -> bool:
        """Count output against the cell's budget (or its background budget); False (and
        ``truncated``) once it is spent."""
        if background:
            cell.background_budget -= size
            left = cell.background_budget
        else:
            cell.budget -= size
            left = cell.budget
        if left < 0:
            cell.execution.truncated = True
            return False
        return True

    def _dispatch(self, message: dict[str, Any]) -> bool:
        """Act on one frame; True if it was output the cell keeps (and was charged for)."""
        kind = message.get("type")
        if kind == "ready":
            self._ready.set()
            return False
        cell = self._cell
        if cell is None or message.get("id") != cell.id:
            return False
        logs = cell.execution.logs
        if kind in ("stdout", "stderr", "result") and not self._charge(
                cell, len(json.dumps(message)) + (RESULT_COST + ELEMENT_COST * _elements(message.get("data"))
                                                  if kind == "result" else 0),
                background=kind != "result" and bool(message.get("background"))):
            return False  # (a thread's prints spend a budget of their own: a flood of them left the cell none)
        if kind in ("stdout", "stderr"):
            text = str(message.get("text", ""))
            (logs.stdout if kind == "stdout" else logs.stderr).append(text)
            self._call(cell, f"on_{kind}", text)
        elif kind == "result":
            data = message.get("data")
            result = Result.from_data(data if isinstance(data, dict) else {}, bool(message.get("main")))
            cell.execution.results.append(result)
            self._call(cell, "on_result", result)
        elif kind == "error":
            error = ExecutionError(str(message.get("name", "")), str(message.get("value", "")),
                                   str(message.get("traceback", "")))
            cell.execution.error = error
            self._call(cell, "on_error", error)
        elif kind == "done":
            cell.done.set()
        elif kind == "interrupted":
            cell.interrupted.set()
        return kind in ("stdout", "stderr", "result")

    @staticmethod
    def _call(cell: _Cell, name: str, value: Any) -> None:
        callback = cell.callbacks.get(name)
        if callback is not None:
            callback(value)

    # -- cells ---------------------------------------------------------------
    def run(self, code: str, *, timeout: float | None = None, envs: dict[str, str] | None = None,
            on_stdout: Callable[[str], None] | None = None, on_stderr: Callable[[str], None] | None = None,
            on_result: Callable[[Result], None] | None = None,
            on_error: Callable[[ExecutionError], None] | None = None,
            cancel: threading.Event | None = None) -> Execution:
        """Run one cell.  ``cancel``, once set, ends the cell as its timeout does (interrupted, the
        kernel restarted if it does not stop): a server whose client left sets it."""
        if not isinstance(code, str):
            raise InvalidSpec("code must be a string")
        limit = DEFAULT_TIMEOUT if timeout is None else timeout
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit <= KERNEL_LIFETIME:
            raise InvalidSpec(f"timeout: {timeout!r} must be seconds in (0, {KERNEL_LIFETIME}]")
        with self._run_lock:
            if self._closed:
                raise self._removed()
            restarted, self._restart_untold = self._restart_untold, False
            if self._handle is not None and self._kernel_over():
                restarted = True  # the kernel died after the last cell (e.g. exit() or a background kill)
                self._stop()
            if self._handle is None:
                self._start()
            self._next_id += 1
            self._count += 1
            execution = Execution(execution_count=self._count)
            cell = _Cell(self._next_id, execution, {"on_stdout": on_stdout, "on_stderr": on_stderr,
                                                    "on_result": on_result, "on_error": on_error})
            cell.budget = cell.background_budget = self._sandbox.spec.limits.max_output
            self._cell = cell
            request = json.dumps({"id": cell.id, "code": code, **({"env": envs} if envs else {})}) + "\n"
            try:
                assert self._handle is not None
                try:
                    self._handle.send_stdin(request)
                except Exception:
                    restarted = True  # the kernel died between cells
                    self._stop()
                    self._start()
                    assert self._handle is not None
                    self._handle.send_stdin(request)
                outcome = self._wait(cell, limit, cancel)
                if outcome == "timeout":
                    execution.timed_out = True
                    self._handle.send_signal(signal.SIGINT)
                    # waited for even if the cell ends first: the agent signals the kernel's group,
                    # then the kernel, and a second SIGINT that came late could interrupt the next cell
                    self._wait_delivered(DELIVERY_GRACE)
                    outcome = self._wait(cell, INTERRUPT_GRACE)
                    if outcome == "timeout" and cell.interrupted.is_set():
                        outcome = self._wait(cell, CLEANUP_GRACE)
                    if outcome == "done":
                        execution.error = ExecutionError(
                            "TimeoutError", f"the cell ran longer than {limit:g} s and was interrupted "
                            "(KeyboardInterrupt); the interpreter's state is kept",
                            execution.error.traceback if execution.error else "")
                    else:
                        restarted = True
                        self._stop()
                        execution.error = ExecutionError(
                            "TimeoutError", f"the cell ran longer than {limit:g} s and did not stop when "
                            "interrupted; the interpreter was restarted: variables and imports are lost", "")
                elif outcome == "dead":
                    restarted = True
                    self._stop()
                    execution.error = ExecutionError(
                        "KernelDied", "the interpreter process died while running the cell (out of memory, "
                        "os._exit or a crash); it restarts on the next cell: variables and imports are lost", "")
                    if not self._running():
                        execution.error = ExecutionError(
                            "SandboxClosed", "the sandbox was destroyed while the cell ran", "")
                    elif self._closed:
                        execution.error = ExecutionError(
                            "ContextRemoved", "the code context was removed while the cell ran", "")
            finally:
                self._cell = None
            if restarted:
                execution.restarted = True
                self._count = 0
                # a cancelled cell's execution goes to nobody (its client left): the next cell
                # says the state is gone (it got a NameError with restarted False)
                self._restart_untold = cancel is not None and cancel.is_set()
            return execution

    def _running(self) -> bool:
        """Whether the sandbox runs on (a destroyed one's kernel died with it, no crash of its own)."""
        try:
            return bool(self._sandbox._backend.alive())
        except Exception:  # a sandbox that cannot say is not running
            return False

    def _kernel_over(self) -> bool:
        """True once the kernel process has ended."""
        return self._handle is not None and self._handle.done

    def _running_steps(self, seconds: float) -> Iterator[float]:
        """How long to wait next, again and again, until ``seconds`` of time the sandbox could run
        have passed while the caller waited: as for a command's timeout, a wait that began or ended
        with the sandbox paused is not counted (the kernel was frozen for some of it)."""
        step, waited = 0.02, 0.0
        while waited < seconds:
            paused_before = self._sandbox.paused
            began = time.monotonic()
            yield min(step, seconds - waited)
            if not (paused_before or self._sandbox.paused):
                waited += time.monotonic() - began
            step = min(step * 2, 0.25)

    def _wait_delivered(self, seconds: float) -> None:
        """Until the signals sent to the kernel have reached it (or it ended), or ``seconds`` of
        time the sandbox could run have passed."""
        assert self._handle is not None
        for step in self._running_steps(seconds):
            if self._handle.signals_delivered(step):
                return

    def _wait(self, cell: _Cell, seconds: float, cancel: threading.Event | None = None) -> str:
        """``"done"``, ``"timeout"`` (also once ``cancel`` is set), or ``"dead"`` when the kernel
        process ended without finishing the cell.  Only time the sandbox could run counts."""
        for step in self._running_steps(seconds):
            if cancel is not None and cancel.is_set():
                break
            if cell.done.wait(step):
                return "done"
            if self._kernel_over():
                return "done" if cell.done.wait(0.2) else "dead"
        return "done" if cell.done.is_set() else "timeout"

def check_language(language: str) -> None:
    if language_name(language) not in KERNELS:
        raise InvalidSpec(f"language {language!r} is not supported; use one of {', '.join(KERNELS)}")


def interpreter_in(backend: LocalBackend, sandbox: Sandbox, language: str | None,
                   context: str | None) -> CodeInterpreter:
    """The interpreter of ``context`` (made by ``create_code_context``), or the sandbox's default
    one for ``language``; started on first use, kept by the sandbox's backend."""
    with backend.interpreters_lock:  # (a context removed between a look and the making made a kernel nobody held)
        if context is not None:
            if context not in backend.contexts:
                raise InvalidSpec(f"sandbox {backend.id} has no code context {context!r}", sandbox_id=backend.id)
            wanted, cwd = backend.contexts[context]
            language = language or wanted
            if language_name(language) != wanted:
                raise InvalidSpec(f"code context {context!r} runs {wanted}, not {language}", sandbox_id=backend.id)
            key = context
        else:
            language = language or "python"
            check_language(language)
            key, cwd = language_name(language), None
        if key not in backend.interpreters:
            backend.interpreters[key] = CodeInterpreter(sandbox, language_name(language), cwd)
        return backend.interpreters[key]


def replay_callbacks(execution: Execution, callbacks: dict[str, Any]) -> None:
    """Hand a finished execution's parts to ``run_code``'s callbacks, in the order a live run gives them
    (a server's ``POST /code`` answers once the cell ended)."""
    for name, items in (("on_stdout", execution.logs.stdout), ("on_stderr", execution.logs.stderr),
                        ("on_result", execution.results)):
        callback = callbacks.get(name)
        if callback is not None:
            for item in items:
                callback(item)
    if execution.error is not None and callbacks.get("on_error") is not None:
        callbacks["on_error"](execution.error)
