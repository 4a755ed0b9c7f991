"""Corral's Python kernel: runs INSIDE a sandbox, one process per interpreter.

Protocol (one JSON object per line):
  host -> kernel on stdin   {"id": N, "code": "..."}
  kernel -> host on stdout  {"type": "ready"}
                            {"type": "stdout"|"stderr", "id": N, "text": "..."}
                            {"type": "result", "id": N, "main": bool, "data": {"text": ..., "png": base64, ...}}
                            {"type": "error", "id": N, "name": ..., "value": ..., "traceback": ...}
                            {"type": "done", "id": N}
Only this script writes the protocol stream: the real stdout is kept on a
private descriptor, and descriptor 1 is pointed at stderr so that output of
subprocesses and C code can never corrupt a frame.  SIGINT raises
KeyboardInterrupt in the running cell (that is how the host interrupts a cell
on timeout); the namespace survives it.  Between cells the kernel reaps its children that
have ended, and os.waitpid / os.wait give a later cell their statuses as if they had waited.

This file must stay standard library only and runnable by Python 3.8+ (annotations are postponed).
"""

from __future__ import annotations

import ast
import base64
import builtins
import io
import json
import linecache
import os
import signal
import sys
import threading
import time
import traceback
import types
from typing import Any

_proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
os.dup2(2, 1)
# the protocol's input on a private descriptor too: exit() closes sys.stdin, and cells get no stdin
_requests = os.fdopen(os.dup(0), "rb")
_devnull = os.open(os.devnull, os.O_RDONLY)
os.dup2(_devnull, 0)
os.close(_devnull)
_lock = threading.Lock()
_current = {"id": 0}
#: the kernel's own pid: a process that forked from it inside a cell is not the kernel
_KERNEL_PID = os.getpid()
#: True only while a cell's own code runs: the host's SIGINT interrupts that and nothing else
_in_cell = [False]
#: when the running cell began, in the clock ticks of /proc/PID/stat's start times
_cell_began = [0]


def _on_sigint(signum: int, frame: Any) -> None:
    if os.getpid() != _KERNEL_PID:
        os._exit(1)  # a copy a cell forked (a fork bomb's): ends with the interrupt
    if _in_cell[0]:
        raise KeyboardInterrupt
    # an interrupt meant for a cell that has just ended: raised between cells it threw away
    # the next cell's request, read but not yet returned (that cell then hung to its timeout)


def _end_forked_copies() -> None:
    """After an interrupt: end every copy of this kernel a cell forked that still runs (a fork
    bomb's, forked after the interrupt came, loop on and hold every pid of the sandbox), and reap
    those the interrupt ended.  Copies: processes of this session and name started since the
    cell began (read from /proc/PID/stat alone: reading a forking process's cmdline waits on its
    memory map).  Stopped first, round after round, as the running ones fork as fast as they
    would be killed; then killed; and again until a look finds none (bounded: 10 s): under load
    a round could end with copies it had not yet seen, which forked on (CI saw a bomb outlive it)."""
    try:
        with open(f"/proc/{_KERNEL_PID}/comm") as f:
            name = f.read().rstrip("\n")
        session = os.getsid(0)
    except OSError:
        return
    deadline = time.monotonic() + 10
    while True:
        stopped, ended = _stop_copies(name, session, deadline)
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in stopped | ended:  # this kernel's own children: reaped, or they hold their pids
            try:
                _system_waitpid(pid, 0)
            except ChildProcessError:
                pass
        if not stopped or time.monotonic() > deadline:
            return


def _stop_copies(name: str, session: int, deadline: float) -> tuple[set[int], set[int]]:
    """Stop every live copy (rounds until two quiet ones, a moment apart); returns those
    stopped and this kernel's children that had already ended (zombies)."""
    stopped: set[int] = set()
    ended: set[int] = set()
    quiet = 0
    while time.monotonic() < deadline:
        found = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == _KERNEL_PID or int(entry) in stopped:
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    text = f.read()
                comm, fields = text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1].split()
                if comm != name or int(fields[3]) != session or int(fields[19]) < _cell_began[0]:
                    continue
                if fields[0] == "Z":
                    if int(fields[1]) == _KERNEL_PID:
                        ended.add(int(entry))
                    continue
                os.kill(int(entry), signal.SIGSTOP)
            except (OSError, ValueError, IndexError):
                continue
            stopped.add(int(entry))
            found += 1
        # a copy stopped in the middle of a fork still makes its child, which may appear after
        # this round looked at its pid: two quiet rounds, a moment apart, before the kill
        quiet = quiet + 1 if not found else 0
        if quiet == 2:
            break
        time.sleep(0.002)
    return stopped, ended


def _forked_copies_end_at_an_interrupt() -> None:
    """In a process a cell forked: SIGINT ends it at once (its default action).  The host's
    interrupt goes to the kernel's process group; a copy that took it in Python (_on_sigint)
    ended only once it had the CPU again, forking on meanwhile, so a fork bomb's copies kept the
    sandbox's CPU quota spent, and the kernel, throttled at each return from a system call, took
    up to 6 s to clean up after them (at 0.25 CPU).  Ended by the kernel at delivery, a copy needs
    no turn of the CPU, and one in the middle of a fork makes no child: the clean-up finds only
    what the kernel itself forked after the interrupt.  (A copy may still set a handler of its
    own, as a forked worker that wants KeyboardInterrupt does.)"""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    except (ValueError, OSError):  # (not the main thread: _on_sigint ends it instead)
        pass


os.register_at_fork(after_in_child=_forked_copies_end_at_an_interrupt)


#: waitpid as the system gives it: the kernel's own reaping (os.waitpid becomes _waitpid for the cells)
_system_waitpid = os.waitpid
#: exit statuses of the cells' children that the kernel reaped, pid -> (process group, wait status),
#: kept for a cell that waits for one later; the newest KEPT_STATUSES of them
_kept_statuses: dict[int, tuple[int, int]] = {}
KEPT_STATUSES = 4096
#: re-entrant: the reaping runs in a signal handler, which may come again while it runs
_kept_lock = threading.RLock()


def _reap_ended_children() -> None:
    """Reap every child of the kernel that has ended, keeping its exit status for os.waitpid and
    os.wait.  A child a cell forked and did not wait for stayed a zombie for the kernel's life,
    holding one of the sandbox's pids: those an interrupt ended (SIGINT reaches the kernel's
    process group) piled up, 16 after 20 interrupted cells, until the session could not fork.
    Called only while no cell runs: C code of a cell that waits itself (os.system) loses nothing."""
    if os.getpid() != _KERNEL_PID:
        return
    with _kept_lock:
        for _ in range(65536):  # bounded: a pid namespace holds no more children than that at once
            try:
                ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # no children at all
                return
            if ended is None or ended.si_pid == 0:
                return
            try:
                group = os.getpgid(ended.si_pid)  # for a waitpid(0) or waitpid(-group) of a cell's
            except OSError:
                group = 0
            try:
                pid, status = _system_waitpid(ended.si_pid, os.WNOHANG)
            except ChildProcessError:  # another thread of the kernel's took it meanwhile
                continue
            if pid == 0:
                return
            _kept_statuses.pop(pid, None)
            _kept_statuses[pid] = (group, status)
            while len(_kept_statuses) > KEPT_STATUSES:
                del _kept_statuses[next(iter(_kept_statuses))]


def _take_kept_status(pid: int) -> tuple[int, int] | None:
    """A kept status that ``waitpid(pid, ...)`` would have found: pid's own, any child's (-1), one
    of the kernel's process group (0) or of group -pid."""
    with _kept_lock:
        for child, (group, status) in _kept_statuses.items():
            if pid in (child, -1) or (pid == 0 and group == os.getpgrp()) or (pid < -1 and group == -pid):
                del _kept_statuses[child]
                return child, status
    return None


def _waitpid(pid: int, options: int, /) -> tuple[int, int]:
    """os.waitpid for the cells: the children the kernel reaped between cells are still theirs to
    wait for, with their statuses (a zombie a wait for any child would have taken comes first)."""
    if pid <= 0:
        kept = _take_kept_status(pid)
        if kept is not None:
            return kept
    try:
        waited = _system_waitpid(pid, options)
    except ChildProcessError:
        kept = _take_kept_status(pid)  # reaped by the kernel (its lock: once the status is kept)
        if kept is None:
            raise
        return kept
    if pid > 0 and waited[0] == pid:
        with _kept_lock:
            _kept_statuses.pop(pid, None)  # an earlier child's of the same pid: no longer the one
    return waited


def _wait() -> tuple[int, int]:
    """os.wait for the cells (see _waitpid)."""
    return _waitpid(-1, 0)


os.waitpid = _waitpid
os.wait = _wait


def _forked_copies_keep_no_statuses() -> None:
    """A process a cell forked has none of the kernel's children, so none of their statuses; its
    lock is its own (another thread may have held the kernel's as it forked)."""
    global _kept_lock
    _kept_statuses.clear()
    _kept_lock = threading.RLock()


os.register_at_fork(after_in_child=_forked_copies_keep_no_statuses)


def _on_child_ended(signum: int, frame: Any) -> None:
    if not _in_cell[0]:
        _reap_ended_children()


def _reap_while_idle() -> None:
    """Between cells: reap the cells' children that have ended, now and as each ends (SIGCHLD).
    A cell that set SIGCHLD's handling itself reaps its children itself."""
    if signal.getsignal(signal.SIGCHLD) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGCHLD, _on_child_ended)
    if signal.getsignal(signal.SIGCHLD) is _on_child_ended:
        _reap_ended_children()


def _stop_reaping() -> None:
    """Before a cell: its children are its own to wait for while it runs (a SIGCHLD that came
    meanwhile and was not yet handled is then dropped: Python skips the default handling)."""
    if signal.getsignal(signal.SIGCHLD) is _on_child_ended:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def _leave_if_forked() -> None:
    """A process a cell forked that comes back here is not the kernel: it would read the next
    cells' requests from the same pipe and answer them with its own copy of the state."""
    if os.getpid() != _KERNEL_PID:
        os._exit(0)


#: characters of output per frame, and of an error's message or traceback (whose frame the host
#: must be able to take whatever the cell printed before: a longer one was dropped, and the cell
#: came back as a success)
FRAME_TEXT = 65536


def cut(text: str) -> str:
    """``text`` within FRAME_TEXT characters: its beginning and its end (a traceback's last frames
    and the exception's line are its end)."""
    if len(text) <= FRAME_TEXT:
        return text
    keep = FRAME_TEXT // 2 - 64
    return f"{text[:keep]}\n... ({len(text) - 2 * keep} characters cut) ...\n{text[-keep:]}"


def send(message: dict[str, Any]) -> None:
    line = json.dumps(message, ensure_ascii=False)
    with _lock:
        _proto.write(line + "\n")
        _proto.flush()


class Capture(io.TextIOBase):
    """sys.stdout / sys.stderr during a cell: whole lines become protocol frames."""

    def __init__(self, stream: str) -> None:
        super().__init__()
        self.stream = stream
        self.buffer_text = ""

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError("write() argument must be str, not " + type(text).__name__)
        self.buffer_text += text
        if "\n" in self.buffer_text:
            cut = self.buffer_text.rindex("\n") + 1
            chunk, self.buffer_text = self.buffer_text[:cut], self.buffer_text[cut:]
            self._send(chunk)
        elif len(self.buffer_text) > 65536:
            self.flush()
        return len(text)

    def _send(self, chunk: str) -> None:
        # in frames of at most FRAME_TEXT characters: the host keeps a cell's output up to its budget
        # and drops a frame past it whole (one print of 3 MB kept nothing at all)
        for start in range(0, len(chunk), FRAME_TEXT):
            frame = {"type": self.stream, "id": _current["id"], "text": chunk[start:start + FRAME_TEXT]}
            if threading.current_thread() is not threading.main_thread():
                # a thread an earlier cell may have started: the host counts it apart from the running
                # cell's own output, which it could otherwise crowd out of the cell's budget; the mark
                # comes first, so that the host can pass over such frames unparsed once their budget is spent
                frame = {"background": True, **frame}
            send(frame)

    def flush(self) -> None:
        if self.buffer_text:
            chunk, self.buffer_text = self.buffer_text, ""
            self._send(chunk)


_REPR_METHODS = (
    ("html", "_repr_html_"), ("markdown", "_repr_markdown_"), ("svg", "_repr_svg_"), ("png", "_repr_png_"),
    ("jpeg", "_repr_jpeg_"), ("latex", "_repr_latex_"), ("json", "_repr_json_"),
    ("javascript", "_repr_javascript_"), ("pdf", "_repr_pdf_"),
)


_MIME_KEYS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
    "image/png": "png", "image/jpeg": "jpeg", "text/latex": "latex", "application/json": "json",
    "application/javascript": "javascript", "application/pdf": "pdf",
}


def _mimebundle(obj: Any) -> dict[str, Any]:
    """What ``obj._repr_mimebundle_()`` offers, under the result's format names."""
    method = getattr(obj, "_repr_mimebundle_", None)
    if not callable(method):
        return {}
    try:
        bundle = method()
    except Exception:
        return {}
    if isinstance(bundle, tuple):  # (data, metadata)
        bundle = bundle[0]
    data: dict[str, Any] = {}
    for mime, value in (bundle.items() if isinstance(bundle, dict) else ()):
        key = _MIME_KEYS.get(mime)
        if key is None or value is None:
            continue
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode("ascii")
        data[key] = json.loads(json.dumps(value, default=str)) if key == "json" else value
    return data


def _is_figure(obj: Any) -> bool:
    module = sys.modules.get("matplotlib.figure")
    return module is not None and isinstance(obj, module.Figure)  # type: ignore[attr-defined]


def _figure_data(fig: Any) -> dict[str, Any]:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    width, height = fig.get_size_inches() * fig.dpi
    return {"png": base64.b64encode(buf.getvalue()).decode("ascii"),
            "text": f"<Figure size {width:.0f}x{height:.0f} with {len(fig.axes)} Axes>"}


def formats(obj: Any) -> dict[str, Any]:
    if _is_figure(obj):
        return _figure_data(obj)
    data: dict[str, Any] = _mimebundle(obj) if not isinstance(obj, type) else {}
    if not isinstance(obj, type):
        for key, method_name in _REPR_METHODS:
            if key in data:
                continue
            method = getattr(obj, method_name, None)
            if not callable(method):
                continue
            try:
                value = method()
            except Exception:
                continue
            if isinstance(value, tuple):  # (data, metadata)
                value = value[0]
            if value is None:
                continue
            if isinstance(value, bytes):
                value = base64.b64encode(value).decode("ascii")
            elif key == "json":
                value = json.loads(json.dumps(value, default=str))
            data[key] = value
    if "text" not in data:
        try:
            data["text"] = repr(obj)
        except Exception as exc:
            data["text"] = f"<repr failed: {exc!r}>"
    return data


def display(obj: Any) -> None:
    """Show a rich result now (like IPython's display)."""
    send({"type": "result", "id": _current["id"], "main": False, "data": formats(obj)})


def _flush_figures() -> None:
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    for number in pyplot.get_fignums():
        fig = pyplot.figure(number)
        send({"type": "result", "id": _current["id"], "main": False, "data": _figure_data(fig)})
    pyplot.close("all")


def _traceback_text(exc: BaseException, skip_frames: int) -> str:
    tb = exc.__traceback__
    for _ in range(skip_frames):
        if tb is not None:
            tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_cell(cell_id: int, code: str, namespace: dict[str, Any], count: int) -> None:
    filename = f"<cell-{count}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        tree = ast.parse(code, filename, "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        # besides SyntaxError the parser raises ValueError for a NUL byte (Python < 3.12),
        # RecursionError or MemoryError (its own stack) for an expression nested thousands deep:
        # a cell's error, never the kernel's end (they escaped here and the kernel died with them)
        name, value = type(exc).__name__, str(exc)
        if isinstance(exc, ValueError):
            name = "SyntaxError"
        elif isinstance(exc, MemoryError):
            name, value = "RecursionError", "the cell is nested too deeply to parse"
        send({"type": "error", "id": cell_id, "name": name, "value": cut(value),
              "traceback": cut(f"{name}: {value}\n")})
        return
    last: Any = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)  # type: ignore[attr-defined]
    try:
        with open("/proc/uptime") as f:
            _cell_began[0] = int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))
    except OSError:
        pass
    try:
        _in_cell[0] = True
        exec(compile(tree, filename, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, filename, "eval"), namespace)
            _in_cell[0] = False
            _leave_if_forked()
            if value is not None and not _is_figure(value):
                namespace["_"] = value
                send({"type": "result", "id": cell_id, "main": True, "data": formats(value)})
    except BaseException as exc:  # KeyboardInterrupt and SystemExit included: the kernel lives on
        _in_cell[0] = False
        _leave_if_forked()
        if isinstance(exc, KeyboardInterrupt):
            # the host waits INTERRUPT_GRACE for the cell's end, then restarts the kernel: say the
            # interrupt came, so that it waits for this clean-up too (its own bound, 10 s)
            send({"type": "interrupted", "id": cell_id})
            _end_forked_copies()
        sys.stdout.flush()
        sys.stderr.flush()
        send({"type": "error", "id": cell_id, "name": type(exc).__name__, "value": cut(str(exc)),
              "traceback": cut(_traceback_text(exc, 1))})
    finally:
        _in_cell[0] = False
        _leave_if_forked()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            _flush_figures()
        except Exception as exc:
            send({"type": "stderr", "id": cell_id, "text": f"could not render figures: {exc!r}\n"})


def main() -> None:
    os.environ.setdefault("MPLBACKEND", "Agg")
    sys.stdout = Capture("stdout")
    sys.stderr = Capture("stderr")
    # the cells' names live in a module registered as __main__ (as in Jupyter), so that pickle
    # finds a function or class a cell defined (multiprocessing.Pool.map, ProcessPoolExecutor):
    # in a bare dict, "attribute lookup f on __main__ failed"
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update({"__builtins__": builtins, "display": display})
    sys.modules["__main__"] = main_module
    namespace = main_module.__dict__
    signal.signal(signal.SIGINT, _on_sigint)
    send({"type": "ready", "pid": os.getpid(), "python": sys.version.split()[0]})
    count = 0
    while True:
        _in_cell[0] = False
        _reap_while_idle()
        line = _requests.readline()
        _stop_reaping()
        if not line:
            return
        try:
            request = json.loads(line)
            cell_id, code = int(request["id"]), str(request["code"])
            env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
        except (ValueError, KeyError, TypeError) as exc:
            send({"type": "error", "id": 0, "name": "ProtocolError", "value": str(exc), "traceback": ""})
            continue
        count += 1
        _current["id"] = cell_id
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)  # this cell's envs=, then back as they were
        try:
            run_cell(cell_id, code, namespace, count)
        except KeyboardInterrupt:  # one that came as the cell's code ended, before its flag was down
            _in_cell[0] = False
            _leave_if_forked()
            send({"type": "interrupted", "id": cell_id})
            _end_forked_copies()
            send({"type": "error", "id": cell_id, "name": "KeyboardInterrupt", "value": "", "traceback": ""})
        except Exception as exc:  # whatever a cell does, the kernel and its namespace live on
            send({"type": "error", "id": cell_id, "name": type(exc).__name__, "value": str(exc)[:4000],
                  "traceback": ""})
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        send({"type": "done", "id": cell_id})


if __name__ == "__main__":
    main()
