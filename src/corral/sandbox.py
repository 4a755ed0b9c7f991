"""The friendly API: ``Sandbox.create()``, ``sandbox.commands.run()``, ``sandbox.files``.

Shaped like E2B's SDK, which agent builders already know::

    with Sandbox.create(memory="256M", workspace="/src/project") as sb:
        r = sb.commands.run("pytest -q", timeout=30)
        sb.files.write("notes.txt", "hello")

Everything here is lifecycle and convenience; isolation lives in the tiers.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, overload

# re-exported: they were defined here before corral.commands
from .commands import BASE_ENV as BASE_ENV
from .commands import CommandHandle as CommandHandle
from .commands import CommandInfo, Commands
from .egress.network import SandboxNetwork, secret_values
from .errors import InvalidSpec, SandboxClosed, SandboxNotFound, host_errors
from .host.procs import raise_open_files_limit
from .lifecycle import (
    LIVE,
    InstanceOrClass,
    Lifetime,
    SandboxInfo,
    check_lifetime,
    check_metadata,
    kill_embedded,
    list_embedded,
    matches,
    owned_elsewhere,
    row_of,
)
from .ports import Ports
from .registry import Registry, gc, state_dir
from .spec import SandboxSpec, validate_sandbox_path
from .surface import (
    DEFAULT_MAX_READ,
    build_spec,
    check_create_arguments,
    download_dir,
    upload_dir,
)
from .tiers import get_tier, tier_class
from .tiers.base import ExecResult, FileEntry, TierSandbox

_gc_done: set[Path] = set()
_gc_lock = threading.Lock()


def _startup_gc(root: Path) -> None:
    with _gc_lock:
        if root in _gc_done:
            return
        _gc_done.add(root)
    raise_open_files_limit()  # once per process: a few descriptors per live sandbox add up
    gc(root)


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(8)


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
        with host_errors("read a file", self._sb.id):
            data = self._sb._tier_sandbox().read_file(validate_sandbox_path(path), max_bytes)
        data = self._sb._filter_output(data)
        if format == "bytes":
            return data
        if format != "text":
            raise InvalidSpec(f"format {format!r}: use 'text' or 'bytes'")
        return data.decode(errors="replace")

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        payload = data.encode() if isinstance(data, str) else bytes(data)
        with host_errors("write a file", self._sb.id):
            self._sb._tier_sandbox().write_file(validate_sandbox_path(path), payload, mode)

    def list(self, path: str = ".") -> list[FileEntry]:
        with host_errors("list a directory", self._sb.id):
            return self._sb._tier_sandbox().list_dir(validate_sandbox_path(path))

    def stat(self, path: str) -> FileEntry:
        with host_errors("stat a file", self._sb.id):
            return self._sb._tier_sandbox().stat(validate_sandbox_path(path))

    def exists(self, path: str) -> bool:
        from .errors import FileNotFoundInSandbox

        try:
            self.stat(path)
            return True
        except FileNotFoundInSandbox:
            return False

    def remove(self, path: str, recursive: bool = False) -> None:
        with host_errors("remove a file", self._sb.id):
            self._sb._tier_sandbox().remove(validate_sandbox_path(path), recursive)

    def make_dir(self, path: str, mode: int = 0o755) -> None:
        with host_errors("make a directory", self._sb.id):
            self._sb._tier_sandbox().make_dir(validate_sandbox_path(path), mode)

    def upload_dir(self, local: str | Path, remote: str) -> int:
        """Copy a host directory into the sandbox (symlinks are skipped). Returns files copied."""
        return upload_dir(self, local, remote)

    def download_dir(self, remote: str, local: str | Path) -> int:
        """Copy a sandbox directory to the host. Symlinks are not followed or copied."""
        return download_dir(self, remote, local)


class Sandbox:
    """An isolated, ephemeral, resource-limited environment. Destroy it with ``kill()`` or ``with``."""

    def __init__(self, spec: SandboxSpec, inner: TierSandbox, root: Path, registry: Registry) -> None:
        self.spec = spec
        self.id = inner.id
        #: E2B's name for ``id``
        self.sandbox_id = inner.id
        self._inner: TierSandbox | None = inner
        self._root = root
        self._registry = registry
        self.cwd = spec.cwd
        self.commands = Commands(self)
        self.files = Files(self)
        self.ports = Ports(self)
        self.metadata: dict[str, str] = {}
        self._lifetime = Lifetime(self)
        self._started_at = time.time()

    @classmethod
    def create(cls, spec: SandboxSpec | None = None, *, state: str | Path | None = None, **kwargs: Any) -> Sandbox:
        """Create a sandbox. Keyword arguments: image, tier, memory, pids, cpus, disk, timeout,
        max_output, workspace (``DIR[:rw|ro|cow]``), env, network, allow, unsafe_allow_ranges,
        secrets (``["NAME@host1,host2"]``), secret_values (``{"NAME": value}``; default: the
        caller's environment) and user (``"user"``, the default: uid 1000; ``"root"``: root of
        the sandbox's own user namespace, on tiers that offer it)."""
        values = kwargs.pop("secret_values", None)
        if values is not None:
            with secret_values(values):
                return cls.create(spec, state=state, **kwargs)
        check_create_arguments(kwargs, "url", "api_key", "idle_timeout", "lifetime", "metadata")
        url = kwargs.pop("url", None) or os.environ.get("CORRAL_URL")
        if url:
            from .client import RemoteSandbox  # type: ignore[import-not-found,import-untyped,unused-ignore]

            return RemoteSandbox.create(spec, url=url, **kwargs)  # type: ignore[return-value]
        kwargs.pop("api_key", None)
        if kwargs.pop("idle_timeout", None) is not None:
            raise InvalidSpec("idle_timeout: only a server tracks use (Sandbox.create(url=...)); an embedded "
                              "sandbox lives until kill() or its lifetime")
        metadata = check_metadata(kwargs.pop("metadata", None))
        lifetime = kwargs.pop("lifetime", None)
        if lifetime is not None:
            lifetime = check_lifetime(lifetime)
        full_spec = build_spec(spec, **kwargs)
        tier_class(full_spec.tier).capabilities.check_user(full_spec.user, full_spec.tier)
        sandbox_id = new_sandbox_id()
        with host_errors("create the sandbox", sandbox_id):
            root = state_dir(state)
            _startup_gc(root)
            registry = Registry.at(root)
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
            end_at = time.time() + lifetime if lifetime is not None else None
            registry.set_record(sandbox_id, {**inner.reap_record(), "corral": {
                "metadata": metadata, "image": full_spec.image, "end_at": end_at}})
        sandbox = cls(full_spec, inner, root, registry)
        sandbox.metadata = metadata
        LIVE[sandbox.id] = sandbox
        if lifetime is not None:
            sandbox._lifetime.set(lifetime)
        return sandbox

    @classmethod
    def list(cls, metadata: dict[str, str] | None = None, *, state: str | Path | None = None,
             url: str | None = None, api_key: str | None = None) -> list[SandboxInfo]:
        """The live sandboxes (of this state directory, or of the server at ``url``/``CORRAL_URL``)
        whose metadata holds every pair of ``metadata``."""
        url = url or os.environ.get("CORRAL_URL")
        if url:
            from .client import Client

            infos = [SandboxInfo(e["id"], e["spec"].get("tier", ""), e["spec"].get("image", ""),
                                 e.get("metadata", {}), e.get("created_at", 0.0), e.get("expires_at"), e["state"])
                     for e in Client(url, api_key).list()]
            return [i for i in infos if matches(i.metadata, metadata)]
        return list_embedded(state_dir(state), metadata)

    @classmethod
    def connect(cls, sandbox_id: str, *, state: str | Path | None = None, url: str | None = None,
                api_key: str | None = None) -> Sandbox:
        """The sandbox with this id: this process's own, or a server's (``url``/``CORRAL_URL``)."""
        url = url or os.environ.get("CORRAL_URL")
        if url:
            from .client import RemoteSandbox

            return RemoteSandbox.connect(sandbox_id, url=url, api_key=api_key)  # type: ignore[return-value]
        sandbox = LIVE.get(sandbox_id)
        if sandbox is not None:
            return sandbox
        elsewhere = owned_elsewhere(state_dir(state), sandbox_id)
        if elsewhere is not None:
            raise elsewhere
        raise SandboxNotFound(f"no live sandbox {sandbox_id}", sandbox_id=sandbox_id)

    def set_timeout(self, seconds: float) -> None:
        """End the sandbox ``seconds`` from now (replaces its lifetime; the owner's timer kills it)."""
        seconds = check_lifetime(seconds, "timeout")
        self._tier_sandbox()
        self._lifetime.set(seconds)
        row = row_of(self._root, self.id)
        if row is not None:
            self._registry.set_record(self.id, {**row.record, "corral": {
                **row.record.get("corral", {}), "end_at": self._lifetime.end_at}})

    def get_info(self) -> SandboxInfo:
        self._tier_sandbox()
        return SandboxInfo(self.id, self.spec.tier, self.spec.image, dict(self.metadata), self._started_at,
                           self._lifetime.end_at, "paused" if self.paused else "running")

    def _tier_sandbox(self) -> TierSandbox:
        if self._inner is None:
            raise SandboxClosed(f"sandbox {self.id} was destroyed", sandbox_id=self.id)
        return self._inner

    def _filter_output(self, data: bytes) -> bytes:
        network = self._tier_sandbox().network
        return network.redact(data) if network is not None else data

    @property
    def network(self) -> SandboxNetwork:
        """The sandbox's network side: ``network.audit()`` lists every refused destination."""
        network = self._tier_sandbox().network
        if network is None:
            raise SandboxClosed(f"sandbox {self.id}: its tier has no network side", sandbox_id=self.id)
        return network

    def is_running(self) -> bool:
        return self._inner is not None and self._inner.alive()

    @property
    def paused(self) -> bool:
        return self._inner is not None and self._inner.paused

    def pause(self) -> None:
        """Freeze the sandbox: its processes stop where they are and keep their memory, no CPU
        is used, and running commands' timeouts stop counting.  Commands and file calls raise
        :class:`SandboxPaused` until :meth:`resume`.  Raises :class:`InvalidState` on a tier
        that cannot pause (``Capabilities.pause``) and on a sandbox already paused."""
        with host_errors("pause the sandbox", self.id):
            self._tier_sandbox().pause()

    def resume(self) -> None:
        """Let a paused sandbox run on from where it stopped (:class:`InvalidState` if it is not paused)."""
        with host_errors("resume the sandbox", self.id):
            self._tier_sandbox().resume()

    def run_code(self, code: str, *, language: str = "python", timeout: float | None = None,
                 **callbacks: Any) -> Any:
        """Run a cell in this sandbox's persistent interpreter; returns an E2B-shaped
        :class:`corral.interpreter.Execution` (variables and imports survive across calls)."""
        from .interpreter import run_code

        return run_code(self, code, language=language, timeout=timeout, **callbacks)

    def _kill(self) -> None:
        """Destroy the sandbox: every process, mount, cgroup and file of it. Idempotent.

        ``sb.kill()`` (E2B's name); :meth:`close` and :meth:`destroy` are aliases.  On the class,
        ``Sandbox.kill(sandbox_id)`` kills by id (see :func:`corral.lifecycle.kill_embedded`)."""
        self._lifetime.cancel()
        inner, self._inner = self._inner, None
        if inner is None:
            return
        try:
            inner.close()
        finally:
            self._registry.remove(self.id)
            LIVE.pop(self.id, None)

    @staticmethod
    def _kill_by_id(sandbox_id: str, *, state: str | Path | None = None, url: str | None = None,
                    api_key: str | None = None) -> bool:
        url = url or os.environ.get("CORRAL_URL")
        if url:
            from .client import Client

            try:
                Client(url, api_key).request("DELETE", f"/v1/sandboxes/{sandbox_id}")
                return True
            except SandboxNotFound:
                return False
        return kill_embedded(state_dir(state), sandbox_id)

    kill: Any = InstanceOrClass(_kill, _kill_by_id)
    close = _kill
    destroy = _kill

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def __repr__(self) -> str:
        state = ("paused" if self.paused else "running") if self.is_running() else "closed"
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

    async def run(self, cmd: str | Sequence[str], **kwargs: Any) -> Any:
        """As :meth:`Commands.run` (``background=True`` returns the synchronous handle)."""
        import asyncio

        return await asyncio.to_thread(lambda: self._sync.run(cmd, **kwargs))

    def list(self) -> list[CommandInfo]:
        return self._sync.list()

    async def kill(self, pid: int) -> bool:
        import asyncio

        return await asyncio.to_thread(self._sync.kill, pid)


class _AsyncFiles:
    def __init__(self, sync: Files) -> None:
        self._sync = sync

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._sync, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            import asyncio

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
        # expose() only opens a listener (the microVM: copies a file once): the same object; a server's
        # sandbox has none yet (its ports go through the server's route)
        self.ports = getattr(sync, "ports", None)

    @classmethod
    async def create(cls, spec: SandboxSpec | None = None, **kwargs: Any) -> AsyncSandbox:
        import asyncio

        return cls(await asyncio.to_thread(Sandbox.create, spec, **kwargs))

    def is_running(self) -> bool:
        return self._sync.is_running()

    async def run_code(self, code: str, **kwargs: Any) -> Any:
        import asyncio

        return await asyncio.to_thread(self._sync.run_code, code, **kwargs)

    @property
    def network(self) -> SandboxNetwork:
        return self._sync.network

    @property
    def paused(self) -> bool:
        return self._sync.paused

    async def pause(self) -> None:
        import asyncio

        await asyncio.to_thread(self._sync.pause)

    async def resume(self) -> None:
        import asyncio

        await asyncio.to_thread(self._sync.resume)

    async def kill(self) -> None:
        """Destroy the sandbox (as :meth:`Sandbox.kill`); :meth:`close` is an alias."""
        import asyncio

        await asyncio.to_thread(self._sync.kill)

    close = kill

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()
