""":class:`corral.AsyncSandbox` over HTTP, natively on asyncio: ``httpx.AsyncClient`` for REST,
``websockets.asyncio`` for exec streams and attaching to background commands.  No thread per
call; the same routes, retries and errors as :mod:`corral.http_transport`."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from .errors import ConnectionLost, InvalidSpec, SandboxClosed, SandboxError, SandboxNotFound
from .http_streams import (
    ExecFrames,
    attached_frame,
    lost_attachment,
    printed,
    stdin_posts,
    stream_request,
)
from .http_transport import (
    REQUEST_TIMEOUT,
    Endpoint,
    answer,
    create_body,
    info_of,
    path_params,
    retry_wait,
    stdin_field,
)
from .lifecycle import SandboxInfo, matches
from .spec import SandboxSpec
from .tiers.base import ExecResult, FileEntry
from .transport import INLINE_STDIN, CommandCall, CreateOptions, split_stdin

if TYPE_CHECKING:
    from .commands import CommandInfo
    from .egress.audit import AuditEvent
    from .execution import Execution
    from .snapshots import Snapshot

#: an output callback of the async API: ``(stream, chunk)``, plain or ``async def``
AsyncOutput = Callable[[str, bytes], Any]


async def call_maybe_async(callback: Callable[..., Any], *args: Any) -> None:
    """Call ``callback``; await what it returns if it is awaitable (``async def`` callbacks)."""
    outcome = callback(*args)
    if inspect.isawaitable(outcome):
        await outcome


class AsyncClient(Endpoint):
    """An asyncio connection to one server (as :class:`corral.http_transport.Client`)."""

    def __init__(self, url: str | None = None, api_key: str | None = None) -> None:
        super().__init__(url, api_key)
        self.http = httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=REQUEST_TIMEOUT)

    async def request(self, method: str, path: str, *, timeout: float | None = REQUEST_TIMEOUT,
                      **kwargs: Any) -> Any:
        attempt = 0
        while True:
            try:
                response = await self.http.request(method, path, timeout=timeout, **kwargs)
            except httpx.TransportError as exc:
                wait = retry_wait(method, attempt, None)
                if wait is None:
                    raise ConnectionLost(f"cannot reach the Corral server at {self.url}: {exc}") from exc
            else:
                wait = retry_wait(method, attempt, response)
                if wait is None:
                    return answer(response, path)
            await asyncio.sleep(wait)
            attempt += 1

    async def connect_ws(self, path: str, max_size: int | None) -> Any:
        from websockets.asyncio.client import connect

        try:
            return await connect(self.ws_url(path), additional_headers=self.headers, open_timeout=30,
                                 max_size=max_size)
        except Exception as exc:
            raise ConnectionLost(f"cannot open {path} at {self.url}: {exc}") from exc

    async def aclose(self) -> None:
        await self.http.aclose()


class AsyncStreamProcess(ExecFrames):
    """A command over the exec WebSocket, read by a task of the running loop."""

    def __init__(self, ws: Any, sandbox_id: str, on_output: AsyncOutput | None) -> None:
        self._ws = ws
        self._sandbox_id = sandbox_id
        self._on_output = on_output
        self._result: ExecResult | None = None
        self._error: SandboxError | None = None
        self._started = asyncio.Event()
        #: set on each stdin ack and when the stream ends
        self._stdin_room = asyncio.Event()
        self.pid: int | None = None
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for raw in self._ws:
                kind, data = self._take(raw)
                if kind == "started":
                    self._started.set()
                elif data is not None and self._on_output is not None:
                    await call_maybe_async(self._on_output, kind, data)
        except Exception as exc:
            self._lost(exc)
        finally:
            self._started.set()
            self._stdin_room.set()

    def _stdin_acked(self, taken: int) -> None:
        super()._stdin_acked(taken)
        self._stdin_room.set()

    @property
    def done(self) -> bool:
        return self._reader.done()

    async def _send(self, frame: dict[str, Any]) -> None:
        if not self._reader.done():
            with contextlib.suppress(Exception):
                await self._ws.send(json.dumps(frame))

    async def write_stdin(self, data: bytes) -> None:
        self._raise_stdin_error()
        await self._started.wait()  # the server's window comes with "started"
        for chunk in self._stdin_chunks(data):
            while not self._stdin_room_for(len(chunk)) and not self._reader.done() and self._stdin_error is None:
                self._stdin_room.clear()
                await self._stdin_room.wait()
            self._stdin_unacked += len(chunk)
            self._raise_stdin_error()
            await self._send(self._stdin_frame(chunk))

    async def close_stdin(self) -> None:
        await self._send({"type": "stdin_close"})

    async def send_signal(self, signum: int) -> None:
        await self._send({"type": "signal", "signal": int(signum)})

    async def kill(self) -> None:
        await self._send({"type": "kill"})

    async def resize(self, rows: int, cols: int) -> None:
        await self._send({"type": "resize", "rows": int(rows), "cols": int(cols)})

    async def wait(self, on_output: AsyncOutput | None = None) -> ExecResult:
        await self._reader
        await self._ws.close()
        result = self._outcome()
        if on_output is not None:
            for stream, data in printed(result):
                await call_maybe_async(on_output, stream, data)
        return result


class AsyncBackgroundProcess:
    """A background command of a server's sandbox, by pid."""

    def __init__(self, client: AsyncClient, sandbox_id: str, pid: int, on_output: AsyncOutput | None = None) -> None:
        self._client = client
        self._sandbox_id = sandbox_id
        self._path = f"{client.sandbox_path(sandbox_id)}/commands/{pid}"
        self.pid = pid
        self._result: ExecResult | None = None
        self._follower = asyncio.ensure_future(self._attach(on_output)) if on_output is not None else None

    @property
    def done(self) -> bool:
        return self._result is not None

    async def write_stdin(self, data: bytes) -> None:
        for body in stdin_posts(data):
            await self._client.request("POST", f"{self._path}/stdin", content=body,
                                       headers={"content-type": "application/octet-stream"})

    async def close_stdin(self) -> None:
        await self._client.request("POST", f"{self._path}/stdin", params={"close": "true"}, content=b"",
                                   headers={"content-type": "application/octet-stream"})

    async def send_signal(self, signum: int) -> None:
        await self._client.request("POST", f"{self._path}/signal", json={"signal": int(signum)})

    async def kill(self) -> None:
        await self.kill_if_running()

    async def kill_if_running(self) -> bool:
        try:
            await self._client.request("DELETE", self._path)
            return True
        except SandboxNotFound:
            return False

    async def resize(self, rows: int, cols: int) -> None:
        raise InvalidSpec("resize: a background command has no terminal", sandbox_id=self._sandbox_id)

    async def wait(self, on_output: AsyncOutput | None = None) -> ExecResult:
        if self._follower is not None:
            await self._follower
        if self._result is None or on_output is not None:
            await self._attach(on_output)
        assert self._result is not None
        return self._result

    async def _attach(self, on_output: AsyncOutput | None) -> None:
        from websockets.exceptions import ConnectionClosed

        ws = await self._client.connect_ws(f"{self._path}/stream", None)
        async with ws:
            try:
                async for raw in ws:
                    kind, data, result = attached_frame(raw, self._sandbox_id)
                    if result is not None:
                        self._result = result
                        return
                    if data is not None and on_output is not None:
                        await call_maybe_async(on_output, kind, data)
            except (ConnectionClosed, OSError) as exc:  # the server went, or the line to it
                raise lost_attachment(self.pid, self._sandbox_id, exc) from exc
        raise SandboxClosed("the command's stream ended without a result", sandbox_id=self._sandbox_id)


class AsyncHTTPBackend:
    """One sandbox of a server, for asyncio (the methods of :class:`corral.transport.SandboxBackend`, awaited)."""

    def __init__(self, client: AsyncClient, data: dict[str, Any]) -> None:
        self._client = client
        self.id: str = data["id"]
        self.data = data
        self.spec = SandboxSpec.from_dict(data["spec"])
        self._path = client.sandbox_path(self.id)
        self.closed = False

    async def _call(self, method: str, suffix: str, **kwargs: Any) -> Any:
        return await self._client.request(method, self._path + suffix, **kwargs)

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.data.get("metadata", {}))

    async def start(self, call: CommandCall, on_output: AsyncOutput | None) -> AsyncStreamProcess:
        body = stream_request(call)
        ws = await self._client.connect_ws(f"{self._path}/exec/stream", 64 << 20)
        await ws.send(json.dumps(body))
        process = AsyncStreamProcess(ws, self.id, on_output)
        await asyncio.wait_for(process._started.wait(), 30)
        return process

    async def run(self, call: CommandCall, stdin: bytes | None, on_output: AsyncOutput | None) -> ExecResult:
        if on_output is not None or (stdin is not None and len(stdin) > INLINE_STDIN):  # stdin in frames
            process = await self.start(call, on_output)
            if stdin is not None:
                await process.write_stdin(stdin)
            await process.close_stdin()
            return await process.wait()
        data = await self._call("POST", "/exec", timeout=None, json={**call.body(), **stdin_field(stdin)})
        data.pop("sandbox_id", None)
        return ExecResult(**data)

    async def start_background(self, call: CommandCall, stdin: bytes | None,
                               on_output: AsyncOutput | None) -> AsyncBackgroundProcess:
        inline, after = split_stdin(stdin)
        started = await self._call("POST", "/commands", json={**call.body(), **stdin_field(inline)})
        process = AsyncBackgroundProcess(self._client, self.id, int(started["pid"]), on_output)
        if after is not None:
            await process.write_stdin(after)
        return process

    async def commands(self) -> list[CommandInfo]:
        from .commands import CommandInfo

        return [CommandInfo(**c) for c in (await self._call("GET", "/commands"))["commands"]]

    async def command(self, pid: int) -> AsyncBackgroundProcess:
        if all(c.pid != pid for c in await self.commands()):
            raise InvalidSpec(f"sandbox {self.id} has no running command with pid {pid}", sandbox_id=self.id)
        return AsyncBackgroundProcess(self._client, self.id, pid)

    async def kill_command(self, pid: int) -> bool:
        return await AsyncBackgroundProcess(self._client, self.id, pid).kill_if_running()

    async def _file(self, method: str, suffix: str, path: str, **kwargs: Any) -> Any:
        params = {**path_params(path), **kwargs.pop("params", {})}
        return await self._call(method, "/files" + suffix, params=params, **kwargs)

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        data = await self._file("GET", "/content", path, params={"max_bytes": max_bytes})
        return data if isinstance(data, bytes) else json.dumps(data).encode()

    async def write_file(self, path: str, data: bytes, mode: int) -> None:
        await self._file("PUT", "/content", path, params={"mode": mode}, content=data,
                         headers={"content-type": "application/octet-stream"})

    async def list_dir(self, path: str) -> list[FileEntry]:
        return [FileEntry.from_json(e) for e in (await self._file("GET", "", path))["entries"]]

    async def stat(self, path: str) -> FileEntry:
        return FileEntry.from_json(await self._file("GET", "/stat", path))

    async def remove(self, path: str, recursive: bool) -> None:
        await self._file("DELETE", "", path, params={"recursive": recursive})

    async def make_dir(self, path: str, mode: int) -> None:
        await self._file("POST", "/dir", path, params={"mode": mode})

    async def info(self) -> SandboxInfo:
        self.data = await self._call("GET", "")
        return info_of(self.data)

    async def set_timeout(self, seconds: float) -> None:
        self.data = await self._call("POST", "/timeout", json={"timeout": seconds})

    async def alive(self) -> bool:
        if self.closed:
            return False
        try:
            return (await self.info()).state in ("running", "paused")
        except SandboxNotFound:
            return False

    async def is_paused(self) -> bool:
        return not self.closed and (await self.info()).state == "paused"

    async def pause(self, to_disk: bool = False) -> None:
        self.data = await self._call("POST", "/pause", json={"to_disk": True} if to_disk else None)

    async def resume(self) -> None:
        self.data = await self._call("POST", "/resume")

    async def run_code(self, code: str, *, language: str | None, context: str | None, timeout: float | None,
                       envs: dict[str, str] | None, callbacks: dict[str, Callable[[Any], Any]]) -> Execution:
        from .execution import Execution

        body: dict[str, Any] = {"code": code}
        for name, value in (("language", language), ("timeout", timeout), ("context", context), ("envs", envs)):
            if value is not None:
                body[name] = value
        execution = Execution.from_dict(await self._call("POST", "/code", json=body, timeout=None))
        await replay_async(execution, callbacks)
        return execution

    async def create_code_context(self, language: str, cwd: str | None) -> str:
        body: dict[str, Any] = {"language": language, **({"cwd": cwd} if cwd is not None else {})}
        return str((await self._call("POST", "/contexts", json=body))["id"])

    async def code_contexts(self) -> list[tuple[str, str, str | None]]:
        return [(c["id"], c["language"], c["cwd"]) for c in (await self._call("GET", "/contexts"))["contexts"]]

    async def remove_code_context(self, name: str) -> None:
        await self._call("DELETE", f"/contexts/{quote(name, safe='')}")

    async def audit(self) -> list[AuditEvent]:
        from .egress.audit import AuditEvent

        return [AuditEvent(**event) for event in (await self._call("GET", "/network/audit"))["events"]]

    async def snapshot(self) -> Snapshot:
        from .snapshots import Snapshot

        return Snapshot.from_dict(await self._call("POST", "/snapshot", timeout=None))

    async def fork(self, count: int) -> list[AsyncHTTPBackend]:
        made = await self._call("POST", "/fork", json={"count": count}, timeout=None)
        # each AsyncSandbox closes its own client: every fork gets one
        return [AsyncHTTPBackend(AsyncClient(self._client.url, self._client.api_key), data)
                for data in made["sandboxes"]]

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            with contextlib.suppress(SandboxNotFound):
                await self._call("DELETE", "")
        finally:
            await self._client.aclose()  # each AsyncSandbox has its own client


async def replay_async(execution: Execution, callbacks: dict[str, Callable[[Any], Any]]) -> None:
    """``run_code``'s callbacks (plain or ``async def``) for a finished execution, in order."""
    for name, items in (("on_stdout", execution.logs.stdout), ("on_stderr", execution.logs.stderr),
                        ("on_result", execution.results), ("on_error", [execution.error] if execution.error else [])):
        callback = callbacks.get(name)
        if callback is not None:
            for item in items:
                await call_maybe_async(callback, item)


class AsyncHTTPTransport:
    """The sandboxes of one server, for asyncio."""

    remote = True

    def __init__(self, url: str | None = None, api_key: str | None = None) -> None:
        self.client = AsyncClient(url, api_key)

    async def create(self, options: CreateOptions) -> AsyncHTTPBackend:
        return AsyncHTTPBackend(self.client, await self.client.request("POST", "/v1/sandboxes",
                                                                       json=create_body(options)))

    async def connect(self, sandbox_id: str) -> AsyncHTTPBackend:
        return AsyncHTTPBackend(self.client, await self.client.request("GET", self.client.sandbox_path(sandbox_id)))

    async def list(self, metadata: dict[str, str] | None) -> list[SandboxInfo]:
        data = await self.client.request("GET", "/v1/sandboxes")
        return [info for info in map(info_of, data["sandboxes"]) if matches(info.metadata, metadata)]

    async def kill(self, sandbox_id: str) -> bool:
        try:
            await self.client.request("DELETE", self.client.sandbox_path(sandbox_id))
            return True
        except SandboxNotFound:
            return False

    async def aclose(self) -> None:
        await self.client.aclose()

