"""The transport of a server's sandboxes: ``corral serve``'s REST and WebSocket API.

``Sandbox.create(url=..., api_key=...)`` (or ``CORRAL_URL``/``CORRAL_API_KEY``) uses
:class:`HTTPTransport`.  ``commands.run`` without callbacks is one HTTP request; with
output callbacks, and ``commands.start``, it streams over the exec WebSocket; background
commands live under ``/commands`` and are found again by pid.  Every error the server sends
is raised as the same :mod:`corral.errors` class the embedded library would raise.
Idempotent calls are retried on connection errors, 429 and 503 (bounded backoff).
"""

from __future__ import annotations

import base64
import builtins
import json as _json
import os
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlencode, urlsplit

import urllib3

if TYPE_CHECKING:
    import httpx

from .errors import (
    ConnectionLost,
    InvalidSpec,
    SandboxNotFound,
    ServerError,
    Unauthorized,
    error_from_code,
)
from .http_streams import BackgroundProcess, StreamProcess, stream_request
from .lifecycle import SandboxInfo, matches
from .netrules import names_loopback
from .ports import ExposedPort
from .spec import SandboxSpec, path_bytes
from .tiers.base import ExecResult, FileEntry
from .transport import (
    INLINE_STDIN,
    CommandCall,
    CommandProcess,
    CreateOptions,
    OutputCallback,
    SandboxBackend,
    Transport,
    split_stdin,
)

if TYPE_CHECKING:
    from .commands import CommandInfo
    from .egress.audit import AuditEvent
    from .execution import Execution
    from .snapshots import Snapshot

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


def _raise_for(response: httpx.Response | Reply, sandbox_id: str | None = None) -> None:
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


def retry_wait(method: str, attempt: int, response: httpx.Response | Reply | None) -> float | None:
    """Seconds to wait before trying ``method`` again after try number ``attempt`` (from 0) failed
    to reach the server (``response`` None) or got ``response``; None: do not try again.

    An idempotent call is tried again when the server could not be reached or said "later" (429,
    503), a bounded number of times with growing waits (the server's Retry-After, capped); a POST
    is never repeated: it could create a second sandbox or run a command twice."""
    if method not in IDEMPOTENT or attempt >= RETRIES:
        return None
    wait: float = BACKOFF * 2**attempt
    if response is None:
        return wait
    if response.status_code not in (429, 503):
        return None
    try:
        wait = float(response.headers.get("retry-after", wait))
    except ValueError:
        pass
    return min(max(wait, 0.0), MAX_RETRY_WAIT)


def path_params(path: str) -> dict[str, str]:
    """A sandbox path as the files routes' query takes it: ``path``, or for a name that is not
    UTF-8 (a listed entry's, its bytes as surrogates) ``path_b64``, its bytes in base64."""
    try:
        path.encode()
        return {"path": path}
    except UnicodeEncodeError:
        return {"path_b64": base64.b64encode(path_bytes(path)).decode()}


def answer(response: httpx.Response | Reply, path: str) -> Any:
    """The body of a response (JSON decoded; None for 204), or the error it carries, raised."""
    _raise_for(response, _sandbox_of(path))
    if response.status_code == 204:
        return None
    if response.headers.get("content-type", "").startswith("application/json"):
        return response.json()
    return response.content


class Endpoint:
    """Where a server is and how to say who calls (``url``/``CORRAL_URL``, ``api_key``/``CORRAL_API_KEY``)."""

    def __init__(self, url: str | None = None, api_key: str | None = None) -> None:
        url = url or os.environ.get("CORRAL_URL")
        if not url:
            raise InvalidSpec("no server URL: pass url=... or set CORRAL_URL")
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("CORRAL_API_KEY")
        self.headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @staticmethod
    def sandbox_path(sandbox_id: str) -> str:
        return f"/v1/sandboxes/{quote(sandbox_id, safe='')}"

    def ws_url(self, path: str) -> str:
        return ("ws" + self.url[4:] if self.url.startswith("http") else self.url) + path


class Reply:
    """A urllib3 response read whole, as :func:`answer` and :func:`retry_wait` read an httpx one."""

    def __init__(self, response: urllib3.BaseHTTPResponse) -> None:
        self.status_code = response.status
        self.headers = response.headers
        self.content: bytes = response.data
        self.reason_phrase = response.reason or ""

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return _json.loads(self.content)


def _query(params: dict[str, Any]) -> str:
    # as httpx writes them: booleans in lower case
    return urlencode({k: str(v).lower() if isinstance(v, bool) else v for k, v in params.items()})


def proxy_for(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``,
    less ``NO_PROXY``), as httpx and the WebSocket client of the command streams take it: a server
    reached only through a proxy is reached through it by every request."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(parts.netloc):
        return None
    return proxy


class Client(Endpoint):
    """A connection to one server, shared by the sandboxes made through it (and their threads).

    Through urllib3's pool of kept-alive connections: a request costs the caller ~0.1 ms over a
    bare ``http.client`` one, where httpx's ``Client`` cost ~0.4 ms (``bench/server.py``)."""

    def __init__(self, url: str | None = None, api_key: str | None = None) -> None:
        super().__init__(url, api_key)
        proxy = proxy_for(self.url)
        # a connection per thread that asks at once (block=False: more are made, 16 are kept)
        self.http: urllib3.HTTPConnectionPool | urllib3.ProxyManager
        if proxy is None:
            self.http = urllib3.connection_from_url(self.url, maxsize=16, block=False)
            self._path = urlsplit(self.url).path
        else:  # a proxy takes the whole URL (and tunnels https with CONNECT)
            self.http = urllib3.ProxyManager(proxy, maxsize=16, block=False)
            self._path = self.url

    def request(self, method: str, path: str, *, timeout: float | None = REQUEST_TIMEOUT,
                json: Any = None, content: bytes | None = None, params: dict[str, Any] | None = None,
                headers: dict[str, str] | None = None) -> Any:
        body, sent = content, dict(self.headers)
        if headers:
            sent.update(headers)
        if json is not None:
            body = _json.dumps(json).encode()
            sent["content-type"] = "application/json"
        target = self._path + path + ("?" + _query(params) if params else "")
        limit = urllib3.Timeout(connect=REQUEST_TIMEOUT, read=timeout)
        attempt = 0
        while True:
            try:
                reply = Reply(self.http.urlopen(method, target, body=body, headers=sent, timeout=limit,
                                                retries=False, redirect=False, assert_same_host=False))
            except urllib3.exceptions.HTTPError as exc:
                wait = retry_wait(method, attempt, None)
                if wait is None:
                    raise ConnectionLost(f"cannot reach the Corral server at {self.url}: {exc}") from exc
            else:
                wait = retry_wait(method, attempt, reply)
                if wait is None:
                    return answer(reply, path)
            time.sleep(wait)
            attempt += 1

    def list(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/sandboxes")["sandboxes"])

    def close(self) -> None:
        if isinstance(self.http, urllib3.ProxyManager):
            self.http.clear()
        else:
            self.http.close()


def info_of(data: dict[str, Any]) -> SandboxInfo:
    spec = data.get("spec", {})
    return SandboxInfo(data["id"], spec.get("tier", ""), spec.get("image", ""), dict(data.get("metadata", {})),
                       data.get("created_at", 0.0), data.get("expires_at"), data.get("state", "running"))


class HTTPBackend(SandboxBackend):
    """One sandbox of a server."""

    remote = True

    def __init__(self, client: Client, data: dict[str, Any]) -> None:
        self._client = client
        self.id: str = data["id"]
        self.data = data
        self.spec = SandboxSpec.from_dict(data["spec"])
        self._path = client.sandbox_path(self.id)
        self.closed = False

    def _call(self, method: str, suffix: str, **kwargs: Any) -> Any:
        return self._client.request(method, self._path + suffix, **kwargs)

    def refresh(self) -> dict[str, Any]:
        self.data = self._call("GET", "")
        return self.data

    # -- commands ---------------------------------------------------------------
    def start(self, call: CommandCall, on_output: OutputCallback | None) -> StreamProcess:
        body = stream_request(call)
        process = StreamProcess(self._client, self.id, body, on_output)
        process.wait_started(30)  # as a local start: the command exists when start returns
        return process

    def run(self, call: CommandCall, stdin: bytes | None, on_output: OutputCallback | None,
            started: Callable[[CommandProcess], None] | None = None) -> ExecResult:
        if on_output is not None or started is not None or (stdin is not None and len(stdin) > INLINE_STDIN):
            return super().run(call, stdin, on_output, started)  # the exec stream: stdin in frames
        data = self._call("POST", "/exec", timeout=None, json={**call.body(), **stdin_field(stdin)})
        data.pop("sandbox_id", None)
        return ExecResult(**data)

    def start_background(self, call: CommandCall, stdin: bytes | None,
                         on_output: OutputCallback | None) -> BackgroundProcess:
        inline, after = split_stdin(stdin)
        started = self._call("POST", "/commands", json={**call.body(), **stdin_field(inline)})
        process = BackgroundProcess(self._client, self.id, int(started["pid"]), on_output)
        if after is not None:
            process.write_stdin(after)
        return process

    def commands(self) -> list[CommandInfo]:
        from .commands import CommandInfo

        return [CommandInfo(**c) for c in self._call("GET", "/commands")["commands"]]

    def command(self, pid: int) -> BackgroundProcess:
        if all(c.pid != pid for c in self.commands()):
            raise InvalidSpec(f"sandbox {self.id} has no running command with pid {pid}", sandbox_id=self.id)
        return BackgroundProcess(self._client, self.id, pid)

    def kill_command(self, pid: int) -> bool:
        return BackgroundProcess(self._client, self.id, pid).kill_if_running()

    # -- files --------------------------------------------------------------------
    def _file(self, method: str, suffix: str, path: str, **kwargs: Any) -> Any:
        params = {**path_params(path), **kwargs.pop("params", {})}
        return self._call(method, "/files" + suffix, params=params, **kwargs)

    def read_file(self, path: str, max_bytes: int) -> bytes:
        data = self._file("GET", "/content", path, params={"max_bytes": max_bytes})
        if not isinstance(data, bytes):  # a file whose bytes happen to parse as JSON
            import json

            data = json.dumps(data).encode()
        return data

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        self._file("PUT", "/content", path, params={"mode": mode}, content=data,
                   headers={"content-type": "application/octet-stream"})

    def list_dir(self, path: str) -> list[FileEntry]:
        return [FileEntry.from_json(e) for e in self._file("GET", "", path)["entries"]]

    def stat(self, path: str) -> FileEntry:
        return FileEntry.from_json(self._file("GET", "/stat", path))

    def remove(self, path: str, recursive: bool) -> None:
        self._file("DELETE", "", path, params={"recursive": recursive})

    def make_dir(self, path: str, mode: int) -> None:
        self._file("POST", "/dir", path, params={"mode": mode})

    # -- the sandbox --------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.data.get("metadata", {}))

    def info(self) -> SandboxInfo:
        return info_of(self.refresh())

    def set_timeout(self, seconds: float) -> None:
        self.data = self._call("POST", "/timeout", json={"timeout": seconds})

    def alive(self) -> bool:
        if self.closed:
            return False
        try:
            return self.refresh().get("state") in ("running", "paused")
        except SandboxNotFound:
            return False

    @property
    def paused(self) -> bool:
        return not self.closed and self.refresh().get("state") == "paused"

    def pause(self, to_disk: bool = False) -> None:
        self.data = self._call("POST", "/pause", json={"to_disk": True} if to_disk else None)

    def resume(self) -> None:
        self.data = self._call("POST", "/resume")

    def run_code(self, sandbox: Any, code: str, *, language: str | None, context: str | None,
                 timeout: float | None, envs: dict[str, str] | None, callbacks: dict[str, Any]) -> Execution:
        from .execution import Execution
        from .interpreter import replay_callbacks

        body: dict[str, Any] = {"code": code}
        for name, value in (("language", language), ("timeout", timeout), ("context", context), ("envs", envs)):
            if value is not None:
                body[name] = value
        execution = Execution.from_dict(self._call("POST", "/code", json=body, timeout=None))
        replay_callbacks(execution, callbacks)
        return execution

    def create_code_context(self, language: str, cwd: str | None) -> str:
        body: dict[str, Any] = {"language": language}
        if cwd is not None:
            body["cwd"] = cwd
        return str(self._call("POST", "/contexts", json=body)["id"])

    def code_contexts(self) -> list[tuple[str, str, str | None]]:
        return [(c["id"], c["language"], c["cwd"]) for c in self._call("GET", "/contexts")["contexts"]]

    def remove_code_context(self, name: str) -> None:
        self._call("DELETE", f"/contexts/{quote(name, safe='')}")

    def audit(self) -> list[AuditEvent]:
        from .egress.audit import AuditEvent

        return [AuditEvent(**event) for event in self._call("GET", "/network/audit")["events"]]

    def expose_port(self, port: int, unix: bool, other_users: Sequence[int] = ()) -> tuple[ExposedPort, Callable[[], None]]:
        return server_port(self._client, self.id, port, unix, other_users), lambda: None

    def snapshot(self) -> Snapshot:
        from .snapshots import Snapshot

        return Snapshot.from_dict(self._call("POST", "/snapshot", timeout=None))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._call("DELETE", "")
        except SandboxNotFound:
            pass


def server_port(endpoint: Endpoint, sandbox_id: str, port: int, unix: bool,
                other_users: Sequence[int] = ()) -> ExposedPort:
    """Where a caller reaches ``port`` of a server's sandbox: the server's proxy route (with the API key)."""
    if other_users:
        raise InvalidSpec("local_users: a server's sandbox port is reached through the server's URL, by "
                          "whoever the server lets in (its API keys, or its local_users without keys)",
                          sandbox_id=sandbox_id)
    if unix:
        raise InvalidSpec("unix_socket: a server's sandbox is reached through the server's URL, "
                          "not a socket on this host", sandbox_id=sandbox_id)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise InvalidSpec(f"port {port!r} must be 1-65535", sandbox_id=sandbox_id)
    where = urlsplit(endpoint.url)
    listening = where.port or (443 if where.scheme == "https" else 80)
    url = f"{endpoint.url}{endpoint.sandbox_path(sandbox_id)}/ports/{port}/"
    browser_url = None
    if not endpoint.api_key and where.scheme == "http" and names_loopback(where.hostname or ""):
        browser_url = f"http://{port}-{sandbox_id}.localhost:{listening}/"  # see server/port_routes.py
    return ExposedPort(port, where.hostname or "", listening, url, None, browser_url)


def stdin_field(stdin: bytes | None) -> dict[str, str]:
    if stdin is None:
        return {}
    try:
        return {"stdin": stdin.decode()}
    except UnicodeDecodeError:  # any bytes, not only UTF-8
        return {"stdin_b64": base64.b64encode(stdin).decode()}


def create_body(options: CreateOptions) -> dict[str, Any]:
    """The JSON of ``POST /v1/sandboxes`` for a create."""
    body = options.spec.to_dict()
    body.pop("workspace", None)
    if options.spec.workspace is not None:
        raise InvalidSpec("workspace: a remote sandbox cannot mount a host directory; use files.upload_dir")
    for name in ("idle_timeout", "lifetime"):
        if getattr(options, name) is not None:
            body[name] = getattr(options, name)
    if options.metadata:
        body["metadata"] = options.metadata
    if options.snapshot is not None:
        body["snapshot"] = options.snapshot
        body.pop("tier", None)
        body.pop("image", None)
    return body


class HTTPTransport(Transport):
    """The sandboxes of one server (``url``; ``api_key`` names the tenant)."""

    remote = True

    def __init__(self, url: str | None = None, api_key: str | None = None) -> None:
        self.client = Client(url, api_key)

    def create(self, options: CreateOptions) -> HTTPBackend:
        return HTTPBackend(self.client, self.client.request("POST", "/v1/sandboxes", json=create_body(options)))

    def connect(self, sandbox_id: str) -> HTTPBackend:
        return HTTPBackend(self.client, self.client.request("GET", self.client.sandbox_path(sandbox_id)))

    def list(self, metadata: dict[str, str] | None) -> list[SandboxInfo]:
        return [info for info in map(info_of, self.client.list()) if matches(info.metadata, metadata)]

    def kill(self, sandbox_id: str) -> bool:
        try:
            self.client.request("DELETE", self.client.sandbox_path(sandbox_id))
            return True
        except SandboxNotFound:
            return False

    def list_snapshots(self) -> builtins.list[Snapshot]:
        from .snapshots import Snapshot

        return [Snapshot.from_dict(d) for d in self.client.request("GET", "/v1/snapshots")["snapshots"]]

    def delete_snapshot(self, snapshot_id: str) -> bool:
        try:
            self.client.request("DELETE", f"/v1/snapshots/{quote(snapshot_id, safe='')}")
            return True
        except SandboxNotFound:
            return False

    def fork(self, backend: SandboxBackend, count: int) -> builtins.list[SandboxBackend]:
        made = self.client.request("POST", self.client.sandbox_path(backend.id) + "/fork", json={"count": count},
                                   timeout=None)
        return [HTTPBackend(self.client, data) for data in made["sandboxes"]]

    def close(self) -> None:
        self.client.close()
