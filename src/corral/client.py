"""The remote SDK: the same ``Sandbox`` surface, served by ``corral serve``.

``Sandbox.create(url=..., api_key=...)`` (or ``CORRAL_URL``/``CORRAL_API_KEY``)
returns a :class:`RemoteSandbox`.  ``commands.run`` without callbacks is one
HTTP request; with output callbacks, and ``commands.start``, it streams over
the exec WebSocket.  Every error the server sends is raised as the same
:mod:`corral.errors` class the embedded library would raise.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload
from urllib.parse import quote, unquote

import httpx

from .client_background import RemoteBackgroundHandle
from .egress.audit import AuditEvent
from .errors import (
    ConnectionLost,
    ExecTimeout,
    InvalidSpec,
    OutOfMemory,
    SandboxClosed,
    SandboxError,
    SandboxNotFound,
    ServerError,
    Unauthorized,
    error_from_code,
)
from .spec import SandboxSpec
from .surface import (
    DEFAULT_MAX_READ,
    build_spec,
    check_create_arguments,
    download_dir,
    output_callback,
    upload_dir,
)
from .tiers.base import ExecResult, FileEntry

if TYPE_CHECKING:
    from .commands import CommandInfo
    from .interpreter import Execution
    from .lifecycle import SandboxInfo

REQUEST_TIMEOUT = 60.0
#: methods whose repetition changes nothing: retried on connection errors, 429 and 503
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
RETRIES = 3
#: the first wait; each retry doubles it (0.2, 0.4, 0.8 s) unless the server says how long
BACKOFF = 0.2
MAX_RETRY_WAIT = 5.0


def _sandbox_of(path: str) -> str | None:
    """The sandbox id in a ``/v1/sandboxes/ID/...`` path, if there is one."""
    parts = path.split("/")
    return unquote(parts[3]) if len(parts) > 3 and parts[1:3] == ["v1", "sandboxes"] and parts[3] else None


def _raise_for(response: httpx.Response, sandbox_id: str | None = None) -> None:
    if response.is_success:
        return
    try:
        body = response.json()
        code, message = str(body.get("error", "")), str(body.get("message", response.text))
    except ValueError:
        code, message = "", response.text or response.reason_phrase
    if response.status_code == 401:
        raise Unauthorized(f"unauthorized: {message}")
    if response.status_code == 413:
        code = "resource_limit"
    if response.status_code >= 500 and code in ("", "sandbox_error", "internal_error"):
        raise ServerError(message, sandbox_id=sandbox_id)
    raise error_from_code(code, message, sandbox_id)


class Client:
    """A connection to one server, shared by the sandboxes made through it."""

    def __init__(self, url: str | None = None, api_key: str | None = None) -> None:
        url = url or os.environ.get("CORRAL_URL")
        if not url:
            raise InvalidSpec("no server URL: pass url=... or set CORRAL_URL")
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("CORRAL_API_KEY")
        self.headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=self.headers, timeout=REQUEST_TIMEOUT)

    def request(self, method: str, path: str, *, timeout: float | None = REQUEST_TIMEOUT, **kwargs: Any) -> Any:
        # an idempotent call is tried again when the server could not be reached or said "later"
        # (429, 503), a bounded number of times with growing waits (the server's Retry-After, capped);
        # a POST is never repeated: it could create a second sandbox or run a command twice
        retries = RETRIES if method in IDEMPOTENT else 0
        for attempt in range(retries + 1):
            wait = BACKOFF * 2**attempt
            try:
                response = self.http.request(method, path, timeout=timeout, **kwargs)
            except httpx.TransportError as exc:
                if attempt < retries:
                    time.sleep(wait)
                    continue
                raise ConnectionLost(f"cannot reach the Corral server at {self.url}: {exc}") from exc
            if response.status_code in (429, 503) and attempt < retries:
                try:
                    wait = float(response.headers.get("retry-after", wait))
                except ValueError:
                    pass
                time.sleep(min(max(wait, 0.0), MAX_RETRY_WAIT))
                continue
            break
        _raise_for(response, _sandbox_of(path))
        if response.status_code == 204:
            return None
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.content

    def list(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/sandboxes")["sandboxes"])

    def ws_url(self, path: str) -> str:
        return ("ws" + self.url[4:] if self.url.startswith("http") else self.url) + path


class RemoteCommandHandle:
    """A command streaming over the exec WebSocket (same methods as ``CommandHandle``)."""

    def __init__(self, client: Client, sandbox_id: str, request: dict[str, Any],
                 on_output: Callable[[str, bytes], None] | None) -> None:
        from websockets.sync.client import connect

        self._on_output = on_output
        self._sandbox_id = sandbox_id
        self._result: ExecResult | None = None
        self._error: SandboxError | None = None
        self._done = threading.Event()
        try:
            self._ws = connect(client.ws_url(f"/v1/sandboxes/{quote(sandbox_id)}/exec/stream"),
                               additional_headers=client.headers, open_timeout=30, max_size=64 << 20,
                               legacy=True)
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
                frame = json.loads(raw)
                kind = frame.pop("type", None)
                if kind in ("stdout", "stderr") and self._on_output is not None:
                    self._on_output(kind, frame["data"].encode())
                elif kind == "result":
                    frame.pop("sandbox_id", None)
                    self._result = ExecResult(**frame)
                elif kind == "error" and self._result is None:
                    self._error = error_from_code(frame.get("error", ""), frame.get("message", ""), self._sandbox_id)
        except Exception as exc:
            if self._result is None and self._error is None:
                self._error = SandboxClosed(f"exec stream lost: {exc}", sandbox_id=self._sandbox_id)
        finally:
            self._done.set()

    def _send(self, frame: dict[str, Any]) -> None:
        if self._done.is_set():
            return
        try:
            self._ws.send(json.dumps(frame))
        except Exception:
            pass

    def send_stdin(self, data: str | bytes) -> None:
        if isinstance(data, str):
            self._send({"type": "stdin", "data": data})
        else:  # any bytes, not only UTF-8: base64 in the JSON frame
            self._send({"type": "stdin", "data_b64": base64.b64encode(data).decode()})

    def close_stdin(self) -> None:
        self._send({"type": "stdin_close"})

    def send_signal(self, signum: int) -> None:
        self._send({"type": "signal", "signal": int(signum)})

    def kill(self) -> None:
        self._send({"type": "kill"})

    def resize(self, rows: int, cols: int) -> None:
        self._send({"type": "resize", "rows": int(rows), "cols": int(cols)})

    def wait(self) -> ExecResult:
        self._done.wait()
        self._ws.close()
        if self._result is not None:
            return self._result
        raise self._error or SandboxClosed("exec stream ended without a result")


class RemoteCommands:
    def __init__(self, sandbox: RemoteSandbox) -> None:
        self._sb = sandbox

    def start(self, cmd: str | Sequence[str], *, timeout: float | None = None, env: Mapping[str, str] | None = None,
              cwd: str | None = None, on_stdout: Callable[[str], None] | None = None,
              on_stderr: Callable[[str], None] | None = None,
              on_output: Callable[[str, bytes], None] | None = None,
              pty: tuple[int, int] | None = None) -> RemoteCommandHandle:
        request = _exec_body(cmd, timeout, env, cwd, None)
        if pty is not None:
            request["pty"] = list(pty)
        return RemoteCommandHandle(self._sb._client, self._sb.id, request, output_callback(on_stdout, on_stderr, on_output))

    @overload
    def run(self, cmd: str | Sequence[str], *, timeout: float | None = ..., env: Mapping[str, str] | None = ...,
            cwd: str | None = ..., stdin: str | bytes | None = ..., on_stdout: Callable[[str], None] | None = ...,
            on_stderr: Callable[[str], None] | None = ..., on_output: Callable[[str, bytes], None] | None = ...,
            check: bool = ..., background: Literal[False] = ...) -> ExecResult: ...

    @overload
    def run(self, cmd: str | Sequence[str], *, timeout: float | None = ..., env: Mapping[str, str] | None = ...,
            cwd: str | None = ..., stdin: str | bytes | None = ..., on_stdout: Callable[[str], None] | None = ...,
            on_stderr: Callable[[str], None] | None = ..., on_output: Callable[[str, bytes], None] | None = ...,
            check: bool = ..., background: Literal[True]) -> RemoteBackgroundHandle: ...

    def run(self, cmd: str | Sequence[str], *, timeout: float | None = None, env: Mapping[str, str] | None = None,
            cwd: str | None = None, stdin: str | bytes | None = None,
            on_stdout: Callable[[str], None] | None = None, on_stderr: Callable[[str], None] | None = None,
            on_output: Callable[[str, bytes], None] | None = None, check: bool = False,
            background: bool = False) -> ExecResult | RemoteBackgroundHandle:
        """As :meth:`corral.commands.Commands.run`; ``background=True`` returns a handle with ``pid``
        (its output is read with ``handle.wait(on_output=...)``, from the start, whenever attached)."""
        if background:
            stdin_text = stdin.decode() if isinstance(stdin, bytes) else stdin
            started = self._sb._client.request("POST", f"{self._sb._path}/commands",
                                               json=_exec_body(cmd, timeout, env, cwd, stdin_text))
            return RemoteBackgroundHandle(self._sb._client, self._sb._path, self._sb.id, int(started["pid"]))
        if on_stdout is None and on_stderr is None and on_output is None:
            stdin_text = stdin.decode() if isinstance(stdin, bytes) else stdin
            data = self._sb._client.request("POST", f"{self._sb._path}/exec", timeout=None,
                                            json=_exec_body(cmd, timeout, env, cwd, stdin_text))
            data.pop("sandbox_id", None)
            result = ExecResult(**data)
        else:
            handle = self.start(cmd, timeout=timeout, env=env, cwd=cwd, on_stdout=on_stdout,
                                on_stderr=on_stderr, on_output=on_output)
            if stdin is not None:
                handle.send_stdin(stdin)
            handle.close_stdin()
            result = handle.wait()
        if check and result.timed_out:
            raise ExecTimeout(f"command timed out after {result.duration_ms:.0f} ms", result, sandbox_id=self._sb.id)
        if check and result.oom_killed:
            raise OutOfMemory("command was killed by the sandbox's memory limit", result, sandbox_id=self._sb.id)
        return result


    def list(self) -> list[CommandInfo]:
        """The running commands, by pid."""
        from .commands import CommandInfo

        return [CommandInfo(**c) for c in self._sb._client.request("GET", f"{self._sb._path}/commands")["commands"]]

    def connect(self, pid: int) -> RemoteBackgroundHandle:
        return RemoteBackgroundHandle(self._sb._client, self._sb._path, self._sb.id, pid)

    def kill(self, pid: int) -> bool:
        return self.connect(pid).kill()

    def send_stdin(self, pid: int, data: str | bytes) -> None:
        self.connect(pid).send_stdin(data)


def _exec_body(cmd: str | Sequence[str], timeout: float | None, env: Mapping[str, str] | None, cwd: str | None,
               stdin: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else list(cmd)}
    for name, value in (("timeout", timeout), ("env", dict(env) if env is not None else None), ("cwd", cwd),
                        ("stdin", stdin)):
        if value is not None:
            body[name] = value
    return body


class RemoteFiles:
    """``sandbox.files`` over HTTP; relative paths are taken from ``/workspace`` by the server side."""

    def __init__(self, sandbox: RemoteSandbox) -> None:
        self._sb = sandbox
        self._base = f"{sandbox._path}/files"

    def _call(self, method: str, suffix: str, path: str, **kwargs: Any) -> Any:
        params = {"path": path, **kwargs.pop("params", {})}
        return self._sb._client.request(method, self._base + suffix, params=params, **kwargs)

    @overload
    def read(self, path: str, format: Literal["text"] = "text", max_bytes: int = ...) -> str: ...

    @overload
    def read(self, path: str, format: Literal["bytes"], max_bytes: int = ...) -> bytes: ...

    def read(self, path: str, format: str = "text", max_bytes: int = DEFAULT_MAX_READ) -> str | bytes:
        if format not in ("text", "bytes"):
            raise InvalidSpec(f"format {format!r}: use 'text' or 'bytes'")
        data = self._call("GET", "/content", path, params={"max_bytes": max_bytes})
        data = data if isinstance(data, bytes) else json.dumps(data).encode()
        return data if format == "bytes" else data.decode(errors="replace")

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        payload = data.encode() if isinstance(data, str) else bytes(data)
        self._call("PUT", "/content", path, params={"mode": mode}, content=payload,
                   headers={"content-type": "application/octet-stream"})

    def list(self, path: str = ".") -> list[FileEntry]:
        return [FileEntry(**e) for e in self._call("GET", "", _absolute(path))["entries"]]

    def stat(self, path: str) -> FileEntry:
        return FileEntry(**self._call("GET", "/stat", path))

    def exists(self, path: str) -> bool:
        from .errors import FileNotFoundInSandbox

        try:
            self.stat(path)
            return True
        except FileNotFoundInSandbox:
            return False

    def remove(self, path: str, recursive: bool = False) -> None:
        self._call("DELETE", "", path, params={"recursive": recursive})

    def make_dir(self, path: str, mode: int = 0o755) -> None:
        self._call("POST", "/dir", path, params={"mode": mode})

    # the directory copies only use the methods above
    def upload_dir(self, local: str | Path, remote: str) -> int:
        return upload_dir(self, local, remote)

    def download_dir(self, remote: str, local: str | Path) -> int:
        return download_dir(self, remote, local)


def _absolute(path: str) -> str:
    return path if path.startswith("/") else "/workspace" if path in (".", "") else f"/workspace/{path}"


class RemoteNetwork:
    """``sandbox.network`` of a remote sandbox: its egress audit."""

    def __init__(self, sandbox: RemoteSandbox) -> None:
        self._sb = sandbox

    def audit(self) -> list[AuditEvent]:
        data = self._sb._client.request("GET", f"{self._sb._path}/network/audit")
        return [AuditEvent(**event) for event in data["events"]]


class RemoteSandbox:
    """A sandbox living in a Corral server; the same surface as :class:`corral.Sandbox`."""

    def __init__(self, client: Client, info: dict[str, Any]) -> None:
        self._client = client
        self.id: str = info["id"]
        #: E2B's name for ``id``
        self.sandbox_id: str = self.id
        self._path = f"/v1/sandboxes/{quote(self.id)}"
        self.info = info
        self.spec = SandboxSpec.from_dict(info["spec"])
        self.cwd = self.spec.cwd
        self.commands = RemoteCommands(self)
        self.files = RemoteFiles(self)
        self.network = RemoteNetwork(self)
        self._killed = False

    @classmethod
    def create(cls, spec: SandboxSpec | None = None, *, url: str | None = None, api_key: str | None = None,
               idle_timeout: float | None = None, lifetime: float | None = None,
               state: str | Path | None = None, metadata: dict[str, str] | None = None,
               **kwargs: Any) -> RemoteSandbox:
        del state  # the server owns its state directory
        check_create_arguments(kwargs)
        full = build_spec(spec, **kwargs)
        body = full.to_dict()
        body.pop("workspace", None)
        if full.workspace is not None:
            raise InvalidSpec("workspace: a remote sandbox cannot mount a host directory; use files.upload_dir")
        if idle_timeout is not None:
            body["idle_timeout"] = idle_timeout
        # checked here as an embedded create checks them: the same errors both ways
        from .lifecycle import check_lifetime, check_metadata

        if lifetime is not None:
            body["lifetime"] = check_lifetime(lifetime)
        if metadata is not None:
            body["metadata"] = check_metadata(metadata)
        client = Client(url, api_key)
        return cls(client, client.request("POST", "/v1/sandboxes", json=body))

    @classmethod
    def connect(cls, sandbox_id: str, *, url: str | None = None, api_key: str | None = None) -> RemoteSandbox:
        client = Client(url, api_key)
        return cls(client, client.request("GET", f"/v1/sandboxes/{quote(sandbox_id)}"))

    def refresh(self) -> dict[str, Any]:
        self.info = self._client.request("GET", self._path)
        return self.info

    def set_timeout(self, seconds: float) -> None:
        """Destroy the sandbox ``seconds`` from now (within the server's max lifetime)."""
        self.info = self._client.request("POST", f"{self._path}/timeout", json={"timeout": seconds})

    def run_code(self, code: str, *, language: str = "python", timeout: float | None = None) -> Execution:
        """As :meth:`corral.Sandbox.run_code`, in the server's interpreter for this sandbox."""
        from .interpreter import Execution

        body: dict[str, Any] = {"code": code, "language": language}
        if timeout is not None:
            body["timeout"] = timeout
        return Execution.from_dict(self._client.request("POST", f"{self._path}/code", json=body))

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.info.get("metadata", {}))

    def get_info(self) -> SandboxInfo:
        """As :meth:`corral.Sandbox.get_info`, from the server."""
        from .lifecycle import SandboxInfo

        info = self.refresh()
        return SandboxInfo(info["id"], info["spec"].get("tier", ""), info["spec"].get("image", ""),
                           dict(info.get("metadata", {})), info.get("created_at", 0.0), info.get("expires_at"),
                           info["state"])

    def pause(self) -> None:
        """As :meth:`corral.Sandbox.pause`."""
        self.info = self._client.request("POST", f"{self._path}/pause")

    def resume(self) -> None:
        """As :meth:`corral.Sandbox.resume`."""
        self.info = self._client.request("POST", f"{self._path}/resume")

    @property
    def paused(self) -> bool:
        return not self._killed and self.refresh().get("state") == "paused"

    def is_running(self) -> bool:
        if self._killed:
            return False
        try:
            return self.refresh().get("state") in ("running", "paused")
        except SandboxNotFound:
            return False

    def kill(self) -> None:
        """Destroy the sandbox on the server (idempotent); :meth:`close` and :meth:`destroy` are aliases."""
        if self._killed:
            return
        self._killed = True
        try:
            self._client.request("DELETE", self._path)
        except SandboxNotFound:
            pass
        finally:
            self._client.http.close()

    close = kill
    destroy = kill

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"<RemoteSandbox {self.id} at {self._client.url}>"
