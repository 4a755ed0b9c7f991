"""``AsyncSandbox``: the whole :class:`corral.Sandbox` surface for asyncio.

Through a server (``url=``/``CORRAL_URL``) it is native asyncio (:mod:`corral.async_http`: no
thread per call).  A sandbox of this process runs its blocking tier calls in worker threads.
Callbacks may be plain functions or ``async def``; either way each is awaited in order, on the
event loop, before the call that feeds them returns.
"""

from __future__ import annotations

import asyncio
import builtins
import codecs
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .async_http import AsyncHTTPBackend, AsyncHTTPTransport, AsyncOutput, call_maybe_async
from .commands import CommandInfo, check_call
from .errors import FileNotFoundInSandbox, InvalidSpec
from .lifecycle import InstanceOrClass, SandboxInfo, check_lifetime
from .ports import ExposedPort
from .sandbox import CodeContext, Sandbox, check_fork_count, create_options
from .spec import SandboxSpec, validate_env, validate_file_mode, validate_max_bytes, validate_sandbox_path
from .surface import DEFAULT_MAX_READ, disk_holds, download_dir, upload_dir
from .tiers.base import ExecResult, FileEntry

if TYPE_CHECKING:
    from .snapshots import Snapshot


def async_output(on_stdout: Callable[[str], Any] | None, on_stderr: Callable[[str], Any] | None,
                 on_output: Callable[[str, bytes], Any] | None) -> AsyncOutput | None:
    """One awaited ``(stream, chunk)`` callback for the three a command takes (text decoded as UTF-8)."""
    if on_stdout is None and on_stderr is None and on_output is None:
        return None
    decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}

    async def callback(stream: str, chunk: bytes) -> None:
        if on_output is not None:
            await call_maybe_async(on_output, stream, chunk)
        target = on_stdout if stream == "stdout" else on_stderr
        text = decoders[stream].decode(chunk)
        if target is not None and text:
            await call_maybe_async(target, text)

    return callback


class Bridge:
    """Callbacks fired on a sandbox's reader thread, run on the event loop in order; ``drain``
    waits for every one fired so far."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._pending: list[Future[None]] = []

    def wrap(self, callback: Callable[..., Any] | None) -> Callable[..., None] | None:
        if callback is None:
            return None

        def fire(*args: Any) -> None:
            self._pending.append(asyncio.run_coroutine_threadsafe(call_maybe_async(callback, *args), self._loop))

        return fire

    async def drain(self) -> None:
        while self._pending:
            await asyncio.wrap_future(self._pending.pop(0))


class ThreadedProcess:
    """A command of this process's sandbox, its blocking calls in worker threads."""

    def __init__(self, process: Any, bridge: Bridge) -> None:
        self._process = process
        self._bridge = bridge

    @property
    def pid(self) -> int | None:
        return self._process.pid  # type: ignore[no-any-return]

    @property
    def done(self) -> bool:
        return self._process.done  # type: ignore[no-any-return]

    async def write_stdin(self, data: bytes) -> None:
        await asyncio.to_thread(self._process.write_stdin, data)

    async def close_stdin(self) -> None:
        await asyncio.to_thread(self._process.close_stdin)

    async def send_signal(self, signum: int) -> None:
        await asyncio.to_thread(self._process.send_signal, signum)

    async def kill(self) -> None:
        await asyncio.to_thread(self._process.kill)

    async def resize(self, rows: int, cols: int) -> None:
        await asyncio.to_thread(self._process.resize, rows, cols)

    async def wait(self, on_output: AsyncOutput | None = None) -> ExecResult:
        result: ExecResult = await asyncio.to_thread(self._process.wait, self._bridge.wrap(on_output))
        await self._bridge.drain()
        return result


class ThreadedBackend:
    """This process's sandbox for asyncio: the calls of its sync backend, in worker threads."""

    def __init__(self, sync: Sandbox) -> None:
        self.sync = sync
        self._backend = sync._backend
        self.id, self.spec = sync.id, sync.spec

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # files, commands by pid, lifecycle: the same call, awaited in a worker thread
        if name not in ("commands", "kill_command", "read_file", "write_file", "list_dir", "stat", "remove",
                        "make_dir", "info", "set_timeout", "alive", "pause", "resume", "create_code_context",
                        "code_contexts", "remove_code_context", "audit", "close"):
            raise AttributeError(name)
        method = getattr(self._backend, name)

        async def call(*args: Any) -> Any:
            return await asyncio.to_thread(method, *args)

        return call

    @property
    def metadata(self) -> dict[str, str]:
        return self._backend.metadata

    async def is_paused(self) -> bool:
        return self._backend.paused

    async def start(self, call: Any, on_output: AsyncOutput | None) -> ThreadedProcess:
        bridge = Bridge()
        return ThreadedProcess(await asyncio.to_thread(self._backend.start, call, bridge.wrap(on_output)), bridge)

    async def run(self, call: Any, stdin: bytes | None, on_output: AsyncOutput | None) -> ExecResult:
        bridge = Bridge()
        result = await asyncio.to_thread(self._backend.run, call, stdin, bridge.wrap(on_output))
        await bridge.drain()
        return result

    async def start_background(self, call: Any, stdin: bytes | None, on_output: AsyncOutput | None) -> ThreadedProcess:
        bridge = Bridge()
        process = await asyncio.to_thread(self._backend.start_background, call, stdin, bridge.wrap(on_output))
        return ThreadedProcess(process, bridge)

    async def command(self, pid: int) -> ThreadedProcess:
        return ThreadedProcess(await asyncio.to_thread(self._backend.command, pid), Bridge())

    async def run_code(self, code: str, *, callbacks: dict[str, Callable[[Any], Any]], **options: Any) -> Any:
        bridge = Bridge()
        wrapped = {name: bridge.wrap(callback) for name, callback in callbacks.items()}
        execution = await asyncio.to_thread(lambda: self._backend.run_code(self.sync, code, callbacks=wrapped,
                                                                           **options))
        await bridge.drain()
        return execution


AsyncBackend = AsyncHTTPBackend | ThreadedBackend


class AsyncCommandHandle:
    """A running command (as :class:`corral.commands.CommandHandle`, its calls awaited)."""

    def __init__(self, process: Any) -> None:
        self._process = process

    @property
    def pid(self) -> int | None:
        return self._process.pid  # type: ignore[no-any-return]

    @property
    def done(self) -> bool:
        return self._process.done  # type: ignore[no-any-return]

    async def send_stdin(self, data: str | bytes) -> None:
        await self._process.write_stdin(data.encode() if isinstance(data, str) else bytes(data))

    async def close_stdin(self) -> None:
        await self._process.close_stdin()

    async def send_signal(self, signum: int) -> None:
        await self._process.send_signal(signum)

    async def kill(self) -> None:
        await self._process.kill()

    async def resize(self, rows: int, cols: int) -> None:
        await self._process.resize(rows, cols)

    async def wait(self, on_output: Callable[[str, bytes], Any] | None = None) -> ExecResult:
        return await self._process.wait(on_output)  # type: ignore[no-any-return]


class AsyncCommands:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def list(self) -> list[CommandInfo]:
        return await self._sb._backend.commands()  # type: ignore[no-any-return]

    async def connect(self, pid: int) -> AsyncCommandHandle:
        return AsyncCommandHandle(await self._sb._backend.command(pid))

    async def kill(self, pid: int) -> bool:
        return await self._sb._backend.kill_command(pid)  # type: ignore[no-any-return]

    async def send_stdin(self, pid: int, data: str | bytes) -> None:
        await (await self.connect(pid)).send_stdin(data)

    async def start(self, cmd: str | Sequence[str], *, timeout: float | None = None,
                    env: Mapping[str, str] | None = None, cwd: str | None = None,
                    on_stdout: Callable[[str], Any] | None = None, on_stderr: Callable[[str], Any] | None = None,
                    on_output: Callable[[str, bytes], Any] | None = None,
                    pty: tuple[int, int] | None = None, user: str | None = None) -> AsyncCommandHandle:
        call = check_call(cmd, timeout, env, cwd or self._sb.cwd, pty, user)
        return AsyncCommandHandle(await self._sb._backend.start(call, async_output(on_stdout, on_stderr, on_output)))

    async def run(self, cmd: str | Sequence[str], *, timeout: float | None = None,
                  env: Mapping[str, str] | None = None, cwd: str | None = None, stdin: str | bytes | None = None,
                  on_stdout: Callable[[str], Any] | None = None, on_stderr: Callable[[str], Any] | None = None,
                  on_output: Callable[[str, bytes], Any] | None = None, check: bool = False,
                  background: bool = False, user: str | None = None) -> Any:
        """As :meth:`corral.commands.Commands.run` (``background=True`` returns an :class:`AsyncCommandHandle`)."""
        from .errors import ExecTimeout, OutOfMemory

        call = check_call(cmd, timeout, env, cwd or self._sb.cwd, user=user)
        callback = async_output(on_stdout, on_stderr, on_output)
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin) if stdin is not None else None
        if background:
            return AsyncCommandHandle(await self._sb._backend.start_background(call, data, callback))
        result: ExecResult = await self._sb._backend.run(call, data, callback)
        if check and result.timed_out:
            raise ExecTimeout(f"command timed out after {result.duration_ms:.0f} ms", result, sandbox_id=self._sb.id)
        if check and result.oom_killed:
            raise OutOfMemory("command was killed by the sandbox's memory limit", result, sandbox_id=self._sb.id)
        return result


class _FilesOnLoop:
    """The async files API as the blocking one the directory copies use (run in a worker thread)."""

    def __init__(self, files: AsyncFiles, loop: asyncio.AbstractEventLoop) -> None:
        self._files, self._loop = files, loop

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._files, name)
        return lambda *args, **kwargs: asyncio.run_coroutine_threadsafe(method(*args, **kwargs), self._loop).result()


class AsyncFiles:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def read(self, path: str, format: str = "text", max_bytes: int = DEFAULT_MAX_READ) -> str | bytes:
        if format not in ("text", "bytes"):
            raise InvalidSpec(f"format {format!r}: use 'text' or 'bytes'")
        data: bytes = await self._sb._backend.read_file(validate_sandbox_path(path), validate_max_bytes(max_bytes))
        return data if format == "bytes" else data.decode(errors="replace")

    async def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        payload = data.encode() if isinstance(data, str) else bytes(data)
        await self._sb._backend.write_file(validate_sandbox_path(path), payload, validate_file_mode(mode))

    async def list(self, path: str = ".") -> list[FileEntry]:
        return await self._sb._backend.list_dir(validate_sandbox_path(path))  # type: ignore[no-any-return]

    async def stat(self, path: str) -> FileEntry:
        return await self._sb._backend.stat(validate_sandbox_path(path))  # type: ignore[no-any-return]

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
            return True
        except FileNotFoundInSandbox:
            return False

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._sb._backend.remove(validate_sandbox_path(path), recursive)

    async def make_dir(self, path: str, mode: int = 0o755) -> None:
        await self._sb._backend.make_dir(validate_sandbox_path(path), validate_file_mode(mode))

    async def upload_dir(self, local: str | Path, remote: str) -> int:
        files = _FilesOnLoop(self, asyncio.get_running_loop())
        return await asyncio.to_thread(upload_dir, files, local, remote)  # type: ignore[arg-type]

    async def download_dir(self, remote: str, local: str | Path) -> int:
        files = _FilesOnLoop(self, asyncio.get_running_loop())
        return await asyncio.to_thread(download_dir, files, remote, local,  # type: ignore[arg-type]
                                       disk_holds(self._sb.spec))


class AsyncNetwork:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def audit(self) -> list[Any]:
        return await self._sb._backend.audit()  # type: ignore[no-any-return]


class AsyncPorts:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def expose(self, port: int, *, unix_socket: bool = False, local_users: Sequence[str | int] = ()) -> ExposedPort:
        backend = self._sb._backend
        if isinstance(backend, ThreadedBackend):
            return await asyncio.to_thread(backend.sync.ports.expose, port, unix_socket=unix_socket,
                                           local_users=local_users)
        from .http_transport import server_port
        from .ports import other_uids

        return server_port(backend._client, backend.id, port, unix_socket, other_uids(local_users))


def _server(url: str | None) -> str | None:
    return url or os.environ.get("CORRAL_URL")


class AsyncSandbox:
    """The :class:`corral.Sandbox` surface for asyncio: every call that waits is awaited."""

    def __init__(self, backend: AsyncBackend) -> None:
        self._backend = backend
        self.id: str = backend.id
        self.sandbox_id: str = backend.id
        self.spec: SandboxSpec = backend.spec
        self.cwd = self.spec.cwd
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.network = AsyncNetwork(self)
        self.ports = AsyncPorts(self)

    @classmethod
    async def create(cls, spec: SandboxSpec | None = None, *, state: str | Path | None = None,
                     url: str | None = None, api_key: str | None = None, **kwargs: Any) -> AsyncSandbox:
        """As :meth:`corral.Sandbox.create`."""
        if _server(url):
            kwargs.pop("secret_values", None)  # a server takes secret values from its own side
            options = create_options(spec, kwargs)
            return cls(await AsyncHTTPTransport(url, api_key).create(options))
        return cls(ThreadedBackend(await asyncio.to_thread(lambda: Sandbox.create(spec, state=state, **kwargs))))

    @classmethod
    async def connect(cls, sandbox_id: str, *, state: str | Path | None = None, url: str | None = None,
                      api_key: str | None = None) -> AsyncSandbox:
        if _server(url):
            return cls(await AsyncHTTPTransport(url, api_key).connect(sandbox_id))
        return cls(ThreadedBackend(await asyncio.to_thread(Sandbox.connect, sandbox_id, state=state)))

    @classmethod
    async def list(cls, metadata: dict[str, str] | None = None, *, state: str | Path | None = None,
                   url: str | None = None, api_key: str | None = None) -> list[SandboxInfo]:
        if _server(url):
            transport = AsyncHTTPTransport(url, api_key)
            try:
                return await transport.list(metadata)
            finally:
                await transport.aclose()
        return await asyncio.to_thread(Sandbox.list, metadata, state=state)

    @property
    def remote(self) -> bool:
        return isinstance(self._backend, AsyncHTTPBackend)

    @property
    def metadata(self) -> dict[str, str]:
        return self._backend.metadata

    async def get_info(self) -> SandboxInfo:
        return await self._backend.info()  # type: ignore[no-any-return]

    async def set_timeout(self, seconds: float) -> None:
        await self._backend.set_timeout(check_lifetime(seconds, "timeout"))

    async def is_running(self) -> bool:
        return await self._backend.alive()  # type: ignore[no-any-return]

    async def is_paused(self) -> bool:
        return await self._backend.is_paused()

    async def pause(self, to_disk: bool = False) -> None:
        """As :meth:`corral.Sandbox.pause`."""
        if to_disk:
            await self._backend.pause(True)
        else:
            await self._backend.pause()

    async def resume(self) -> None:
        await self._backend.resume()

    async def snapshot(self) -> Snapshot:
        """As :meth:`corral.Sandbox.snapshot`."""
        if isinstance(self._backend, ThreadedBackend):
            return await asyncio.to_thread(self._backend.sync.snapshot)
        return await self._backend.snapshot()

    async def fork(self, count: int = 1) -> builtins.list[AsyncSandbox]:
        """As :meth:`corral.Sandbox.fork`."""
        if isinstance(self._backend, ThreadedBackend):
            forks = await asyncio.to_thread(self._backend.sync.fork, count)
            return [AsyncSandbox(ThreadedBackend(sb)) for sb in forks]
        check_fork_count(count)
        return [AsyncSandbox(backend) for backend in await self._backend.fork(count)]

    async def create_code_context(self, language: str = "python", cwd: str | None = None) -> CodeContext:
        return CodeContext(await self._backend.create_code_context(language, cwd), language, cwd)

    async def list_code_contexts(self) -> builtins.list[CodeContext]:
        """The code contexts made and not removed."""
        return [CodeContext(*c) for c in await self._backend.code_contexts()]

    async def remove_code_context(self, context: CodeContext | str) -> None:
        """As :meth:`corral.Sandbox.remove_code_context`."""
        await self._backend.remove_code_context(context.id if isinstance(context, CodeContext) else context)

    async def run_code(self, code: str, *, language: str | None = None, context: CodeContext | str | None = None,
                       timeout: float | None = None, envs: dict[str, str] | None = None,
                       **callbacks: Callable[[Any], Any]) -> Any:
        """As :meth:`corral.Sandbox.run_code`; callbacks may be ``async def``."""
        unknown = sorted(set(callbacks) - {"on_stdout", "on_stderr", "on_result", "on_error"})
        if unknown:
            raise InvalidSpec(f"unknown argument(s) to run_code: {', '.join(unknown)}")
        if not isinstance(code, str):
            raise InvalidSpec("code must be a string")
        name = context.id if isinstance(context, CodeContext) else context
        return await self._backend.run_code(code, language=language, context=name, timeout=timeout,
                                            envs=validate_env(envs) if envs else None, callbacks=callbacks)

    async def _kill(self) -> None:
        """Destroy the sandbox (as :meth:`corral.Sandbox.kill`); :meth:`close` is an alias."""
        await self._backend.close()

    @classmethod
    async def _kill_by_id(cls, sandbox_id: str, *, state: str | Path | None = None, url: str | None = None,
                          api_key: str | None = None) -> bool:
        if _server(url):
            transport = AsyncHTTPTransport(url, api_key)
            try:
                return await transport.kill(sandbox_id)
            finally:
                await transport.aclose()
        return await asyncio.to_thread(Sandbox.kill, sandbox_id, state=state)  # type: ignore[no-any-return]

    kill: Any = InstanceOrClass(_kill, _kill_by_id)
    close = _kill

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.spec.tier}:{self.spec.image}{' remote' if self.remote else ''}>"

