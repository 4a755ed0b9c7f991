"""The friendly API: ``Sandbox.create()``, ``sandbox.commands.run()``, ``sandbox.files``.

Shaped like E2B's SDK, which agent builders already know::

    with Sandbox.create(memory="256M", workspace="/src/project") as sb:
        r = sb.commands.run("pytest -q", timeout=30)
        sb.files.write("notes.txt", "hello")

Everything here is lifecycle and convenience; isolation lives in the tiers.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

from .errors import ExecTimeout, InvalidSpec, OutOfMemory, SandboxClosed
from .images import SANDBOX_HOME, SANDBOX_USER
from .registry import Registry, gc, state_dir
from .spec import Limits, SandboxSpec, Workspace, validate_env, validate_sandbox_path
from .tiers import get_tier
from .tiers.base import ExecRequest, ExecResult, FileEntry, Process, TierSandbox

BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": SANDBOX_HOME,
    "USER": SANDBOX_USER,
    "LOGNAME": SANDBOX_USER,
    "LANG": "C.UTF-8",
    "SHELL": "/bin/sh",
}
DEFAULT_MAX_READ = 256 << 20

_gc_done: set[Path] = set()
_gc_lock = threading.Lock()


def _startup_gc(root: Path) -> None:
    with _gc_lock:
        if root in _gc_done:
            return
        _gc_done.add(root)
    gc(root)


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(8)


def _argv(cmd: str | Sequence[str]) -> list[str]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidSpec("command is empty")
        return ["/bin/sh", "-c", cmd]
    argv = list(cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidSpec("command must be a shell string or a non-empty list of strings")
    if any("\0" in a for a in argv):
        raise InvalidSpec("command arguments cannot contain NUL bytes")
    return argv


def build_spec(
    spec: SandboxSpec | None = None,
    *,
    image: str | None = None,
    tier: str | None = None,
    memory: str | int | None = None,
    pids: int | None = None,
    cpus: float | None = None,
    disk: str | int | None = None,
    timeout: float | None = None,
    max_output: str | int | None = None,
    workspace: str | Path | Workspace | None = None,
    env: Mapping[str, str] | None = None,
    network: str | None = None,
) -> SandboxSpec:
    """A spec from keyword arguments (each overriding ``spec``'s field when given)."""
    base = spec or SandboxSpec()
    limits = base.limits
    if any(v is not None for v in (memory, pids, cpus, disk, timeout, max_output)):
        fresh = Limits.build(memory, pids, cpus, disk, timeout, max_output)
        defaults = Limits()
        limits = Limits(
            **{
                name: getattr(fresh, name) if given is not None else getattr(limits, name)
                for name, given in (
                    ("memory", memory), ("pids", pids), ("cpus", cpus), ("disk", disk),
                    ("timeout", timeout), ("max_output", max_output),
                )
            }
        )
        del defaults
    ws = base.workspace
    if isinstance(workspace, Workspace):
        ws = workspace
    elif workspace is not None:
        ws = Workspace.parse(str(workspace))
    return SandboxSpec(
        image=image or base.image,
        tier=tier or base.tier,
        limits=limits,
        workspace=ws,
        env=validate_env(env) if env is not None else base.env,
        network=network or base.network,
        cwd=base.cwd,
    )


class CommandHandle:
    """A command started with ``commands.start``: feed stdin, signal, wait for the result."""

    def __init__(self, process: Process) -> None:
        self._process = process

    def send_stdin(self, data: str | bytes) -> None:
        self._process.write_stdin(data.encode() if isinstance(data, str) else data)

    def close_stdin(self) -> None:
        self._process.close_stdin()

    def send_signal(self, signum: int) -> None:
        self._process.send_signal(signum)

    def kill(self) -> None:
        self._process.kill()

    def wait(self) -> ExecResult:
        return self._process.wait()


class Commands:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def _request(self, cmd: str | Sequence[str], timeout: float | None, env: Mapping[str, str] | None,
                 cwd: str | None) -> ExecRequest:
        limits = self._sb.spec.limits
        if timeout is not None and (not isinstance(timeout, (int, float)) or not 0 < timeout <= 7 * 86400):
            raise InvalidSpec(f"timeout: {timeout!r} must be seconds in (0, 604800]")
        merged = {**BASE_ENV, **self._sb.spec.env, **validate_env(env)}
        return ExecRequest(
            argv=_argv(cmd),
            env=merged,
            cwd=validate_sandbox_path(cwd or self._sb.cwd, "cwd"),
            timeout=float(timeout if timeout is not None else limits.timeout),
            max_output=limits.max_output,
        )

    def start(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        on_stdout: Callable[[str], None] | None = None,
        on_stderr: Callable[[str], None] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> CommandHandle:
        """Start a command; output reaches the callbacks as it is produced (on a reader thread)."""
        request = self._request(cmd, timeout, env, cwd)
        callback = _callbacks(on_stdout, on_stderr, on_output)
        return CommandHandle(self._sb._tier_sandbox().start(request, callback))

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: str | bytes | None = None,
        on_stdout: Callable[[str], None] | None = None,
        on_stderr: Callable[[str], None] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        check: bool = False,
    ) -> ExecResult:
        """Run a command to completion. A shell string runs under ``/bin/sh -c``.

        Timeouts and OOM kills come back in the result (``timed_out``,
        ``oom_killed``); with ``check=True`` they raise ExecTimeout/OutOfMemory.
        """
        handle = self.start(cmd, timeout=timeout, env=env, cwd=cwd, on_stdout=on_stdout,
                            on_stderr=on_stderr, on_output=on_output)
        if stdin is not None:
            handle.send_stdin(stdin)
        handle.close_stdin()
        result = handle.wait()
        if check:
            if result.timed_out:
                raise ExecTimeout(f"command timed out after {result.duration_ms:.0f} ms", result)
            if result.oom_killed:
                raise OutOfMemory("command was killed by the sandbox's memory limit", result)
        return result


def _callbacks(
    on_stdout: Callable[[str], None] | None,
    on_stderr: Callable[[str], None] | None,
    on_output: Callable[[str, bytes], None] | None,
) -> Callable[[str, bytes], None] | None:
    if on_stdout is None and on_stderr is None and on_output is None:
        return None
    import codecs

    decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}

    def callback(stream: str, chunk: bytes) -> None:
        if on_output is not None:
            on_output(stream, chunk)
        target = on_stdout if stream == "stdout" else on_stderr
        if target is not None:
            text = decoders[stream].decode(chunk)
            if text:
                target(text)

    return callback


class Files:
    """Files inside the sandbox. Relative paths are taken from ``/workspace``.

    Every operation is carried out *inside* the sandbox by its agent, as the
    sandbox user and in the sandbox's own view: a symlink the sandbox planted
    resolves to the sandbox's files, never to the host's.
    """

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    @overload
    def read(self, path: str, format: Literal["text"] = "text", max_bytes: int = ...) -> str: ...

    @overload
    def read(self, path: str, format: Literal["bytes"], max_bytes: int = ...) -> bytes: ...

    def read(self, path: str, format: str = "text", max_bytes: int = DEFAULT_MAX_READ) -> str | bytes:
        data = self._sb._tier_sandbox().read_file(validate_sandbox_path(path), max_bytes)
        data = self._sb._filter_output(data)
        if format == "bytes":
            return data
        if format != "text":
            raise InvalidSpec(f"format {format!r}: use 'text' or 'bytes'")
        return data.decode(errors="replace")

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        payload = data.encode() if isinstance(data, str) else bytes(data)
        self._sb._tier_sandbox().write_file(validate_sandbox_path(path), payload, mode)

    def list(self, path: str = ".") -> list[FileEntry]:
        return self._sb._tier_sandbox().list_dir(validate_sandbox_path(path))

    def stat(self, path: str) -> FileEntry:
        return self._sb._tier_sandbox().stat(validate_sandbox_path(path))

    def exists(self, path: str) -> bool:
        from .errors import FileNotFoundInSandbox

        try:
            self.stat(path)
            return True
        except FileNotFoundInSandbox:
            return False

    def remove(self, path: str, recursive: bool = False) -> None:
        self._sb._tier_sandbox().remove(validate_sandbox_path(path), recursive)

    def make_dir(self, path: str, mode: int = 0o755) -> None:
        self._sb._tier_sandbox().make_dir(validate_sandbox_path(path), mode)

    def upload_dir(self, local: str | Path, remote: str) -> int:
        """Copy a host directory into the sandbox (symlinks are skipped). Returns files copied."""
        local = Path(local)
        if not local.is_dir():
            raise InvalidSpec(f"{local} is not a directory")
        base = validate_sandbox_path(remote).rstrip("/")
        count = 0
        self.make_dir(base)
        for dirpath, dirnames, filenames in os.walk(local):
            rel = os.path.relpath(dirpath, local)
            target = base if rel == "." else f"{base}/{rel}"
            for d in dirnames:
                if not os.path.islink(os.path.join(dirpath, d)):
                    self.make_dir(f"{target}/{d}")
            for name in filenames:
                src = os.path.join(dirpath, name)
                if os.path.islink(src) or not os.path.isfile(src):
                    continue
                with open(src, "rb") as f:
                    self.write(f"{target}/{name}", f.read(), os.stat(src).st_mode & 0o755)
                count += 1
        return count

    def download_dir(self, remote: str, local: str | Path) -> int:
        """Copy a sandbox directory to the host. Symlinks are not followed or copied."""
        local = Path(local)
        local.mkdir(parents=True, exist_ok=True)
        count = 0
        for entry in self.list(remote):
            if entry.name in (".", "..") or "/" in entry.name:
                continue
            dest = local / entry.name
            if entry.type == "dir":
                count += self.download_dir(entry.path, dest)
            elif entry.type == "file":
                if dest.is_symlink():
                    dest.unlink()
                dest.write_bytes(self.read(entry.path, format="bytes"))
                count += 1
        return count


class Sandbox:
    """An isolated, ephemeral, resource-limited environment. Destroy it with ``kill()`` or ``with``."""

    def __init__(self, spec: SandboxSpec, inner: TierSandbox, root: Path, registry: Registry) -> None:
        self.spec = spec
        self.id = inner.id
        self._inner: TierSandbox | None = inner
        self._root = root
        self._registry = registry
        self.cwd = spec.cwd
        self.commands = Commands(self)
        self.files = Files(self)

    @classmethod
    def create(cls, spec: SandboxSpec | None = None, *, state: str | Path | None = None, **kwargs: Any) -> Sandbox:
        """Create a sandbox. Keyword arguments: image, tier, memory, pids, cpus, disk, timeout,
        max_output, workspace (``DIR[:rw|ro|cow]``), env, network."""
        url = kwargs.pop("url", None) or os.environ.get("CORRAL_URL")
        if url:
            from .client import RemoteSandbox  # type: ignore[import-not-found]

            return RemoteSandbox.create(spec, url=url, **kwargs)  # type: ignore[return-value]
        kwargs.pop("api_key", None)
        full_spec = build_spec(spec, **kwargs)
        root = state_dir(state)
        _startup_gc(root)
        registry = Registry(root)
        sandbox_id = new_sandbox_id()
        run_dir = root / "sandboxes" / sandbox_id
        tier = get_tier(full_spec.tier, root)
        registry.add(sandbox_id, full_spec.tier, run_dir)
        try:
            run_dir.mkdir(mode=0o700)
            inner = tier.create(full_spec, sandbox_id, run_dir)
        except BaseException:
            tier.reap(sandbox_id, run_dir, {})
            registry.remove(sandbox_id)
            raise
        registry.set_record(sandbox_id, inner.reap_record())
        return cls(full_spec, inner, root, registry)

    def _tier_sandbox(self) -> TierSandbox:
        if self._inner is None:
            raise SandboxClosed(f"sandbox {self.id} was destroyed")
        return self._inner

    def _filter_output(self, data: bytes) -> bytes:
        return data

    def is_running(self) -> bool:
        return self._inner is not None and self._inner.alive()

    def kill(self) -> None:
        """Destroy the sandbox: every process, mount, cgroup and file of it. Idempotent."""
        inner, self._inner = self._inner, None
        if inner is None:
            return
        try:
            inner.close()
        finally:
            self._registry.remove(self.id)

    close = kill
    destroy = kill

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "closed"
        return f"<Sandbox {self.id} {self.spec.tier}:{self.spec.image} {state}>"


def run(cmd: str | Sequence[str], *, timeout: float | None = None, stdin: str | bytes | None = None,
        on_stdout: Callable[[str], None] | None = None, on_stderr: Callable[[str], None] | None = None,
        spec: SandboxSpec | None = None, **kwargs: Any) -> ExecResult:
    """Create a sandbox, run one command, destroy the sandbox."""
    with Sandbox.create(spec, **kwargs) as sb:
        return sb.commands.run(cmd, timeout=timeout, stdin=stdin, on_stdout=on_stdout, on_stderr=on_stderr)


class _AsyncCommands:
    def __init__(self, sync: Commands) -> None:
        self._sync = sync

    async def run(self, cmd: str | Sequence[str], **kwargs: Any) -> ExecResult:
        return await asyncio.to_thread(self._sync.run, cmd, **kwargs)


class _AsyncFiles:
    def __init__(self, sync: Files) -> None:
        self._sync = sync

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._sync, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(method, *args, **kwargs)

        return call


class AsyncSandbox:
    """The same surface as :class:`Sandbox` for asyncio (blocking work runs in threads)."""

    def __init__(self, sync: Sandbox) -> None:
        self._sync = sync
        self.id = sync.id
        self.spec = sync.spec
        self.commands = _AsyncCommands(sync.commands)
        self.files = _AsyncFiles(sync.files)

    @classmethod
    async def create(cls, spec: SandboxSpec | None = None, **kwargs: Any) -> AsyncSandbox:
        return cls(await asyncio.to_thread(Sandbox.create, spec, **kwargs))

    def is_running(self) -> bool:
        return self._sync.is_running()

    async def kill(self) -> None:
        await asyncio.to_thread(self._sync.kill)

    close = kill

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()
