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
on timeout); the namespace survives it.

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
import sys
import threading
import traceback
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
            send({"type": self.stream, "id": _current["id"], "text": chunk})
        elif len(self.buffer_text) > 65536:
            self.flush()
        return len(text)

    def flush(self) -> None:
        if self.buffer_text:
            chunk, self.buffer_text = self.buffer_text, ""
            send({"type": self.stream, "id": _current["id"], "text": chunk})


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
        send({"type": "error", "id": cell_id, "name": name, "value": value,
              "traceback": f"{name}: {value}\n"})
        return
    last: Any = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)  # type: ignore[attr-defined]
    try:
        exec(compile(tree, filename, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, filename, "eval"), namespace)
            if value is not None and not _is_figure(value):
                namespace["_"] = value
                send({"type": "result", "id": cell_id, "main": True, "data": formats(value)})
    except BaseException as exc:  # KeyboardInterrupt and SystemExit included: the kernel lives on
        sys.stdout.flush()
        sys.stderr.flush()
        send({"type": "error", "id": cell_id, "name": type(exc).__name__, "value": str(exc),
              "traceback": _traceback_text(exc, 1)})
    finally:
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
    namespace = {"__name__": "__main__", "__builtins__": builtins, "display": display}
    send({"type": "ready", "pid": os.getpid(), "python": sys.version.split()[0]})
    count = 0
    while True:
        try:
            line = _requests.readline()
        except KeyboardInterrupt:
            continue  # an interrupt that arrived between cells
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
        except KeyboardInterrupt:
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
