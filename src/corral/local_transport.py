"""The transport of sandboxes owned by this process: tiers, the registry and the janitor.

``Sandbox.create()`` without a server uses :class:`LocalTransport`; each sandbox's
:class:`LocalBackend` holds its tier sandbox, its lifetime timer, the commands it
started (found again by pid) and its code interpreters.
"""

from __future__ import annotations

import builtins
import dataclasses
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import owner_link
from .commands import BASE_ENV, ROOT_ENV, CommandInfo, argv_of
from .egress.network import SandboxNetwork
from .errors import InvalidSpec, SandboxClosed, SandboxNotFound, host_errors
from .host.procs import raise_open_files_limit
from .lifecycle import (
    LIVE,
    Lifetime,
    SandboxInfo,
    check_lifetime,
    kill_embedded,
    list_embedded,
    owner_elsewhere,
    row_of,
)
from .owner_backend import OwnerBackend
from .ports import ExposedPort
from .registry import Registry, gc, state_dir
from .secrets import StreamRedactor
from .snapshots import Snapshot, SnapshotStore
from .spec import SandboxSpec, validate_sandbox_path
from .tiers import get_tier, tier_class
from .tiers.base import ExecRequest, ExecResult, FileEntry, Process, TierSandbox
from .transport import CommandCall, CommandProcess, CreateOptions, OutputCallback, SandboxBackend, Transport

if TYPE_CHECKING:
    from .egress.audit import AuditEvent
    from .interpreter import CodeInterpreter, Execution

_gc_done: set[Path] = set()
_gc_lock = threading.Lock()
#: how long ``run(background=True)`` waits for the command to exist, so its pid is known
BACKGROUND_START_TIMEOUT = 10.0


def _startup_gc(root: Path) -> None:
    with _gc_lock:
        if root in _gc_done:
            return
        _gc_done.add(root)
    raise_open_files_limit()  # once per process: a few descriptors per live sandbox add up
    gc(root)


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(8)


class LocalProcess(CommandProcess):
    """A tier's process, with the sandbox's secrets redacted from what it hands back."""

    def __init__(self, process: Process, sandbox_id: str, redact: Callable[[str], str] | None = None,
                 stream: StreamRedactor | None = None) -> None:
        self._process = process
        self._sandbox_id = sandbox_id
        self._redact = redact
        self._stream = stream

    @property
    def pid(self) -> int | None:  # type: ignore[override]
        return self._process.pid

    @property
    def done(self) -> bool:
        return self._process.done

    def write_stdin(self, data: bytes) -> None:
        self._process.write_stdin(data)

    def close_stdin(self) -> None:
        self._process.close_stdin()

    def send_signal(self, signum: int) -> None:
        self._process.send_signal(signum)

    def kill(self) -> None:
        self._process.kill()

    def resize(self, rows: int, cols: int) -> None:
        self._process.resize(rows, cols)

    def wait(self, on_output: OutputCallback | None = None) -> ExecResult:
        with host_errors("wait for a command", self._sandbox_id):
            result = self._process.wait()
        if self._stream is not None:
            self._stream.flush()
        if self._redact is not None:
            result.stdout = self._redact(result.stdout)
            result.stderr = self._redact(result.stderr)
        if on_output is not None:  # attached late: what it printed (as the server replays it)
            for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
                if text:
                    on_output(stream, text.encode())
        return result


class LocalBackend(SandboxBackend):
    """One sandbox of this process."""

    def __init__(self, spec: SandboxSpec, inner: TierSandbox, root: Path, registry: Registry,
                 metadata: dict[str, str]) -> None:
        self.id = inner.id
        self.spec = spec
        self.inner: TierSandbox | None = inner
        self.root = root
        self._registry = registry
        self._metadata = metadata
        self._started_at = time.time()
        self._lifetime = Lifetime(self)
        self._lock = threading.Lock()
        #: every command started and not yet seen to end, with its request (list/connect/kill by pid)
        self._started: list[tuple[LocalProcess, ExecRequest]] = []
        self.interpreters: dict[str, CodeInterpreter] = {}
        self.interpreters_lock = threading.Lock()
        #: named code contexts: name -> (language, cwd)
        self.contexts: dict[str, tuple[str, str | None]] = {}
        #: the ``Sandbox`` in front of this backend (set by it): what another process's
        #: ``run_code`` runs through (owner_link)
        self.front: weakref.ref[Any] | None = None

    def tier_sandbox(self) -> TierSandbox:
        if self.inner is None:
            raise SandboxClosed(f"sandbox {self.id} was destroyed", sandbox_id=self.id)
        return self.inner

    @property
    def network(self) -> SandboxNetwork:
        network = self.tier_sandbox().network
        if network is None:
            raise SandboxClosed(f"sandbox {self.id}: its tier has no network side", sandbox_id=self.id)
        return network

    # -- commands ---------------------------------------------------------------
    def request(self, call: CommandCall) -> ExecRequest:
        if call.pty is not None and not tier_class(self.spec.tier).capabilities.pty:
            raise InvalidSpec(f"pty: the {self.spec.tier} tier cannot run commands on a terminal")
        tier_class(self.spec.tier).capabilities.check_user(call.user, self.spec.tier)
        limits = self.spec.limits
        as_root = (call.user or self.spec.user) == "root"
        return ExecRequest(
            argv=argv_of(call.cmd),
            env={**BASE_ENV, **(ROOT_ENV if as_root else {}), **self.spec.env, **(call.env or {})},
            cwd=validate_sandbox_path(call.cwd or self.spec.cwd, "cwd"),
            timeout=float(call.timeout if call.timeout is not None else limits.timeout),
            max_output=limits.max_output,
            pty=call.pty,
            user=call.user,
        )

    def start(self, call: CommandCall, on_output: OutputCallback | None) -> LocalProcess:
        request = self.request(call)
        inner = self.tier_sandbox()
        network = inner.network
        with host_errors("start a command", self.id):
            if network is not None and network.secrets:
                stream = StreamRedactor(network.redactor, on_output) if on_output is not None else None
                process = LocalProcess(inner.start(request, stream.feed if stream else None), self.id,
                                       network.redact_text, stream)
            else:
                process = LocalProcess(inner.start(request, on_output), self.id)
        with self._lock:
            self._started = [(p, r) for p, r in self._started if not p.done]
            self._started.append((process, request))
        return process

    def start_background(self, call: CommandCall, stdin: bytes | None,
                         on_output: OutputCallback | None) -> LocalProcess:
        process = self.start(call, on_output)
        if stdin is not None:
            process.write_stdin(stdin)
        deadline = time.monotonic() + BACKGROUND_START_TIMEOUT
        while process.pid is None and not process.done and time.monotonic() < deadline:
            time.sleep(0.0005)
        return process

    def commands(self) -> list[CommandInfo]:
        with self._lock:
            self._started = [(p, r) for p, r in self._started if not p.done]
            running = [CommandInfo(p.pid, list(r.argv), r.cwd) for p, r in self._started if p.pid is not None]
        from .interpreter import is_kernel

        return [info for info in running if not is_kernel(info.argv)]

    def command(self, pid: int) -> LocalProcess:
        with self._lock:
            for process, _ in self._started:
                if process.pid == pid and not process.done:
                    return process
        raise InvalidSpec(f"sandbox {self.id} has no running command with pid {pid}")

    def kill_command(self, pid: int) -> bool:
        try:
            process = self.command(pid)
        except InvalidSpec:
            return False
        process.kill()
        return True

    # -- files --------------------------------------------------------------------
    def read_file(self, path: str, max_bytes: int) -> bytes:
        with host_errors("read a file", self.id):
            data = self.tier_sandbox().read_file(path, max_bytes)
        network = self.tier_sandbox().network
        return network.redact(data) if network is not None else data

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        with host_errors("write a file", self.id):
            self.tier_sandbox().write_file(path, data, mode)

    def list_dir(self, path: str) -> list[FileEntry]:
        with host_errors("list a directory", self.id):
            return self.tier_sandbox().list_dir(path)

    def stat(self, path: str) -> FileEntry:
        with host_errors("stat a file", self.id):
            return self.tier_sandbox().stat(path)

    def remove(self, path: str, recursive: bool) -> None:
        with host_errors("remove a file", self.id):
            self.tier_sandbox().remove(path, recursive)

    def make_dir(self, path: str, mode: int) -> None:
        with host_errors("make a directory", self.id):
            self.tier_sandbox().make_dir(path, mode)

    # -- the sandbox --------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def info(self) -> SandboxInfo:
        self.tier_sandbox()
        return SandboxInfo(self.id, self.spec.tier, self.spec.image, dict(self._metadata), self._started_at,
                           self._lifetime.end_at, "paused" if self.paused else "running")

    def set_timeout(self, seconds: float) -> None:
        self.tier_sandbox()
        self._lifetime.set(seconds)
        row = row_of(self.root, self.id)
        if row is not None:
            self._registry.set_record(self.id, {**row.record, "corral": {
                **row.record.get("corral", {}), "end_at": self._lifetime.end_at}})

    def alive(self) -> bool:
        return self.inner is not None and self.inner.alive()

    @property
    def paused(self) -> bool:
        return self.inner is not None and self.inner.paused

    def pause(self) -> None:
        with host_errors("pause the sandbox", self.id):
            self.tier_sandbox().pause()

    def resume(self) -> None:
        with host_errors("resume the sandbox", self.id):
            self.tier_sandbox().resume()

    def run_code(self, sandbox: Any, code: str, *, language: str | None, context: str | None,
                 timeout: float | None, envs: dict[str, str] | None, callbacks: dict[str, Any]) -> Execution:
        from .interpreter import interpreter_in

        self.tier_sandbox()
        return interpreter_in(self, sandbox, language, context).run(code, timeout=timeout, envs=envs, **callbacks)

    def create_code_context(self, language: str, cwd: str | None) -> str:
        from .interpreter import check_language, language_name

        self.tier_sandbox()
        check_language(language)
        name = "ctx-" + secrets.token_hex(6)
        self.contexts[name] = (language_name(language), validate_sandbox_path(cwd, "cwd") if cwd is not None else None)
        return name

    def audit(self) -> list[AuditEvent]:
        return self.network.audit()

    def expose_port(self, port: int, unix: bool) -> tuple[ExposedPort, Callable[[], None]]:
        with host_errors("expose a port", self.id):
            forward = self.tier_sandbox().expose_port(port, unix=unix)
        return ExposedPort.of(forward), forward.close

    def snapshot(self, tenant: str | None = None) -> Snapshot:
        """Snapshot the sandbox's files into this state directory's store (owned by ``tenant``)."""
        with host_errors("snapshot the sandbox", self.id):
            return SnapshotStore(self.root).take(self.tier_sandbox(), self.spec, tenant)

    def close(self) -> None:
        self._lifetime.cancel()
        inner, self.inner = self.inner, None
        if inner is None:
            return
        try:
            inner.close()
        finally:
            self._registry.remove(self.id)
            LIVE.pop(self.id, None)


class LocalTransport(Transport):
    """Sandboxes of this process, registered in a state directory (default: ``CORRAL_STATE_DIR``)."""

    def __init__(self, state: str | Path | None = None) -> None:
        self._state = state

    @property
    def root(self) -> Path:
        return state_dir(self._state)

    def create(self, options: CreateOptions) -> LocalBackend:
        if options.idle_timeout is not None:
            raise InvalidSpec("idle_timeout: only a server tracks use (Sandbox.create(url=...)); an embedded "
                              "sandbox lives until kill() or its lifetime")
        spec = options.spec
        tier_class(spec.tier).capabilities.check_user(spec.user, spec.tier)
        sandbox_id = new_sandbox_id()
        seed: tuple[Path, str] | None = None
        if options.snapshot is not None:
            if spec.workspace is not None:
                raise InvalidSpec("workspace: a sandbox made from a snapshot gets the snapshot's /workspace")
            snapshot, files, digest = SnapshotStore(self.root).files(options.snapshot)
            spec = dataclasses.replace(spec, tier=snapshot.tier, image=snapshot.image)
            seed = (files, digest)
        with host_errors("create the sandbox", sandbox_id):
            root = self.root
            _startup_gc(root)
            registry = Registry.at(root)
            run_dir = root / "sandboxes" / sandbox_id
            tier = get_tier(spec.tier, root)
            registry.add(sandbox_id, spec.tier, run_dir)
            try:
                run_dir.mkdir(mode=0o700)
                inner = (tier.create(spec, sandbox_id, run_dir) if seed is None
                         else tier.create_from_snapshot(spec, sandbox_id, run_dir, *seed))
            except BaseException:
                tier.reap(sandbox_id, run_dir, {})
                registry.remove(sandbox_id)
                raise
            end_at = time.time() + options.lifetime if options.lifetime is not None else None
            registry.set_record(sandbox_id, {**inner.reap_record(), "corral": {
                "metadata": options.metadata, "image": spec.image, "end_at": end_at}})
        backend = LocalBackend(spec, inner, root, registry, options.metadata)
        LIVE[backend.id] = backend
        owner_link.serve(root)
        if options.lifetime is not None:
            backend.set_timeout(check_lifetime(options.lifetime))
        return backend

    def connect(self, sandbox_id: str) -> SandboxBackend:
        backend = LIVE.get(sandbox_id)
        if backend is not None and backend.inner is not None:
            return backend
        owner = owner_elsewhere(self.root, sandbox_id)
        if owner is not None:
            return OwnerBackend(self.root, owner, sandbox_id)
        raise SandboxNotFound(f"no live sandbox {sandbox_id}", sandbox_id=sandbox_id)

    def list(self, metadata: dict[str, str] | None) -> list[SandboxInfo]:
        return list_embedded(self.root, metadata)

    def list_snapshots(self) -> builtins.list[Snapshot]:
        return SnapshotStore(self.root).list()

    def delete_snapshot(self, snapshot_id: str) -> bool:
        return SnapshotStore(self.root).delete(snapshot_id)

    def kill(self, sandbox_id: str) -> bool:
        owner = owner_elsewhere(self.root, sandbox_id) if sandbox_id not in LIVE else None
        if owner is not None:  # its owner destroys it, as if it had called kill() itself
            OwnerBackend(self.root, owner, sandbox_id).close()
            return True
        return kill_embedded(self.root, sandbox_id)
