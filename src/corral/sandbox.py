"""The friendly API: ``Sandbox.create()``, ``sandbox.commands.run()``, ``sandbox.files``.

Shaped like E2B's SDK, which agent builders already know::

    with Sandbox.create(memory="256M", workspace="/src/project") as sb:
        r = sb.commands.run("pytest -q", timeout=30)
        sb.files.write("notes.txt", "hello")

One class whatever carries the calls (see :mod:`corral.transport`): sandboxes of this
process (the default), or of a server with ``url=``/``CORRAL_URL`` -- the same methods,
the same checks and the same errors.  Isolation lives in the tiers.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

# re-exported: they were defined here before corral.commands
from .commands import BASE_ENV as BASE_ENV
from .commands import CommandHandle as CommandHandle
from .commands import Commands
from .egress.network import SandboxNetwork, secret_values
from .errors import InvalidSpec, InvalidState
from .lifecycle import InstanceOrClass, SandboxInfo, check_lifetime, check_metadata
from .local_backend import LocalBackend
from .local_backend import new_sandbox_id as new_sandbox_id
from .local_transport import LocalTransport
from .ports import Ports
from .spec import SandboxSpec, validate_env, validate_file_mode, validate_max_bytes, validate_sandbox_path
from .surface import DEFAULT_MAX_READ, build_spec, check_create_arguments, disk_holds, download_dir, upload_dir
from .tiers.base import ExecResult, FileEntry, TierSandbox
from .transport import CreateOptions, SandboxBackend, Transport

if TYPE_CHECKING:
    from .egress.audit import AuditEvent
    from .execution import Execution
    from .snapshots import Snapshot

#: sandboxes one ``fork`` may make
MAX_FORKS = 64


def check_fork_count(count: object) -> int:
    """``count`` as a number of forks: a whole number in [1, MAX_FORKS], else InvalidSpec."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
        raise InvalidSpec(f"count: {count!r} must be a whole number in [1, {MAX_FORKS}]")
    return count


def transport_for(url: str | None = None, api_key: str | None = None, state: str | Path | None = None,
                  transport: Transport | None = None, cluster: str | bool | None = None) -> Transport:
    """The transport a call means: ``transport`` if given; a Ray cluster at ``cluster`` (or
    ``CORRAL_CLUSTER``); a server at ``url`` (or ``CORRAL_URL``); else this process's sandboxes
    in the state directory ``state``."""
    if transport is not None:
        return transport
    if cluster is None and not url:
        from .cluster.nodes import address_from_env

        cluster = address_from_env()
    if cluster is not None and cluster is not False:
        if url:
            raise InvalidSpec("cluster= and url=: a sandbox lives either in a cluster or in a server")
        from .cluster.transport import ClusterTransport

        return ClusterTransport.shared(cluster)
    url = url or os.environ.get("CORRAL_URL")
    if url:
        from .http_transport import HTTPTransport

        return HTTPTransport(url, api_key)
    return LocalTransport(state)


def create_options(spec: SandboxSpec | None, kwargs: dict[str, Any]) -> CreateOptions:
    """``create``'s keyword arguments, checked (unknown ones are named in an :class:`InvalidSpec`)."""
    check_create_arguments(kwargs, "idle_timeout", "lifetime", "metadata", "slot_timeout", "snapshot")
    kwargs = dict(kwargs)
    snapshot = kwargs.pop("snapshot", None)
    if snapshot is not None:
        if not isinstance(snapshot, str):
            raise InvalidSpec(f"snapshot: {snapshot!r} must be a snapshot id")
        fixed = sorted({"tier", "image", "workspace"} & set(kwargs))
        if fixed:
            raise InvalidSpec(f"{', '.join(fixed)}: a sandbox made from a snapshot has the snapshot's tier, image "
                              "and /workspace")
    metadata = check_metadata(kwargs.pop("metadata", None))
    lifetime = kwargs.pop("lifetime", None)
    idle_timeout = kwargs.pop("idle_timeout", None)
    slot_timeout = kwargs.pop("slot_timeout", None)
    if slot_timeout is not None and (isinstance(slot_timeout, bool) or not isinstance(slot_timeout, (int, float))
                                     or not 0 <= slot_timeout <= 3600):
        raise InvalidSpec(f"slot_timeout: {slot_timeout!r} must be seconds in [0, 3600]")
    return CreateOptions(build_spec(spec, **kwargs), metadata,
                         check_lifetime(lifetime) if lifetime is not None else None,
                         check_lifetime(idle_timeout, "idle_timeout") if idle_timeout is not None else None,
                         float(slot_timeout) if slot_timeout is not None else None, snapshot)


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
        if format not in ("text", "bytes"):
            raise InvalidSpec(f"format {format!r}: use 'text' or 'bytes'")
        data = self._sb._backend.read_file(validate_sandbox_path(path), validate_max_bytes(max_bytes))
        return data if format == "bytes" else data.decode(errors="replace")

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        """Replace (or make) the file at ``path`` with ``data``, whole or not at all: on an error (a
        full disk) the file is as it was, and of two writes at once the last to finish is there.
        ``mode`` is a new file's; a replaced file keeps its mode and owner.  A link at ``path``
        is followed (the file it names is replaced, or made if it names none yet); a fifo, socket, device or directory there is refused."""
        payload = data.encode() if isinstance(data, str) else bytes(data)
        self._sb._backend.write_file(validate_sandbox_path(path), payload, validate_file_mode(mode))

    def list(self, path: str = ".") -> list[FileEntry]:
        return self._sb._backend.list_dir(validate_sandbox_path(path))

    def stat(self, path: str) -> FileEntry:
        return self._sb._backend.stat(validate_sandbox_path(path))

    def exists(self, path: str) -> bool:
        from .errors import FileNotFoundInSandbox

        try:
            self.stat(path)
            return True
        except FileNotFoundInSandbox:
            return False

    def remove(self, path: str, recursive: bool = False) -> None:
        self._sb._backend.remove(validate_sandbox_path(path), recursive)

    def make_dir(self, path: str, mode: int = 0o755) -> None:
        self._sb._backend.make_dir(validate_sandbox_path(path), validate_file_mode(mode))

    def upload_dir(self, local: str | Path, remote: str) -> int:
        """Copy a host directory into the sandbox (symlinks are skipped). Returns files copied."""
        return upload_dir(self, local, remote)

    def download_dir(self, remote: str, local: str | Path) -> int:
        """Copy a sandbox directory's files into the host directory ``local``; returns files
        copied.  Symlinks are not followed or copied, nor is a git directory's configuration;
        at most the sandbox's disk limit is written (:func:`corral.surface.download_dir`)."""
        return download_dir(self, remote, local, disk_holds(self._sb.spec))


class Network:
    """``sandbox.network`` of a server's sandbox: its egress audit."""

    def __init__(self, backend: SandboxBackend) -> None:
        self._backend = backend

    def audit(self) -> list[AuditEvent]:
        return self._backend.audit()


@dataclass(frozen=True)
class CodeContext:
    """A named interpreter of its own (``create_code_context``): pass it as ``run_code(context=)``."""

    id: str
    language: str
    cwd: str | None = None


class Sandbox:
    """An isolated, ephemeral, resource-limited environment. Destroy it with ``kill()`` or ``with``."""

    def __init__(self, backend: SandboxBackend, transport: Transport | None = None) -> None:
        self._backend = backend
        self._transport = transport
        #: made for this sandbox alone (its connections close with it)
        self._owns_transport = False
        #: [how many sandboxes still use the transport] when forks share this one's
        self._transport_users: list[int] | None = None
        self.spec: SandboxSpec = backend.spec
        self.id: str = backend.id
        #: E2B's name for ``id``
        self.sandbox_id: str = backend.id
        self.cwd = self.spec.cwd
        self.commands = Commands(self)
        self.files = Files(self)
        self.ports = Ports(self)
        if isinstance(backend, LocalBackend):
            backend.front = weakref.ref(self)

    @classmethod
    def create(cls, spec: SandboxSpec | None = None, *, state: str | Path | None = None, url: str | None = None,
               api_key: str | None = None, transport: Transport | None = None,
               cluster: str | bool | None = None, **kwargs: Any) -> Sandbox:
        """Create a sandbox. Keyword arguments: image, tier, memory, pids, cpus, disk, timeout,
        max_output, workspace (``DIR[:rw|ro|cow]``), env, network, allow, unsafe_allow_ranges,
        secrets (``["NAME@host1,host2"]``) and secret_values (``{"NAME": value}``; default: the
        caller's environment); user (``"user"``, the default: uid 1000; ``"root"``: root of the
        sandbox's own user namespace, on tiers that offer it); metadata (labels for ``list``),
        lifetime (seconds until it is destroyed), idle_timeout (a server's or a cluster's);
        snapshot (an id from :meth:`snapshot`: the sandbox starts with its files, tier and image).
        ``url``/``api_key`` (or ``CORRAL_URL``) make it in a server; ``cluster`` (a Ray address,
        or True for the Ray this process joined; or ``CORRAL_CLUSTER``) on a node of a Ray
        cluster, waiting up to ``slot_timeout`` seconds for a free slot; ``state`` names this
        process's state directory; ``transport`` is any."""
        values = kwargs.pop("secret_values", None)
        if values is not None:
            with secret_values(values):
                return cls.create(spec, state=state, url=url, api_key=api_key, transport=transport,
                                  cluster=cluster, **kwargs)
        options = create_options(spec, kwargs)
        chosen = cls._transport_for(url, api_key, state, transport, cluster)
        if options.slot_timeout is not None and not chosen.places:
            raise InvalidSpec("slot_timeout: only a cluster's creates wait for a slot (cluster=...)")
        sandbox = cls(chosen.create(options), chosen)
        sandbox._owns_transport = transport is None
        return sandbox

    @classmethod
    def _transport_for(cls, url: str | None, api_key: str | None, state: str | Path | None,
                       transport: Transport | None, cluster: str | bool | None = None) -> Transport:
        return transport_for(url, api_key, state, transport, cluster)

    @classmethod
    @contextlib.contextmanager
    def _transport_for_one_call(cls, url: str | None, api_key: str | None, state: str | Path | None,
                                transport: Transport | None, cluster: str | bool | None = None) -> Iterator[Transport]:
        """The transport of one class-level call (list, kill by id...): one made here is closed after it."""
        chosen = cls._transport_for(url, api_key, state, transport, cluster)
        try:
            yield chosen
        finally:
            if transport is None:
                chosen.close()

    @classmethod
    def list(cls, metadata: dict[str, str] | None = None, *, state: str | Path | None = None,
             url: str | None = None, api_key: str | None = None,
             transport: Transport | None = None, cluster: str | bool | None = None) -> list[SandboxInfo]:
        """The live sandboxes (of this state directory, of the server at ``url``/``CORRAL_URL``, or
        of the cluster at ``cluster``/``CORRAL_CLUSTER``) whose metadata holds every pair of ``metadata``."""
        with cls._transport_for_one_call(url, api_key, state, transport, cluster) as chosen:
            return chosen.list(metadata)

    @classmethod
    def connect(cls, sandbox_id: str, *, state: str | Path | None = None, url: str | None = None,
                api_key: str | None = None, transport: Transport | None = None,
                cluster: str | bool | None = None) -> Sandbox:
        """The sandbox with this id: this process's own, another live process's of the same state
        directory (driven through that process, :mod:`corral.owner_link`), a server's
        (``url``/``CORRAL_URL``) or a cluster's (``cluster``/``CORRAL_CLUSTER``)."""
        chosen = cls._transport_for(url, api_key, state, transport, cluster)
        sandbox = cls(chosen.connect(sandbox_id), chosen)
        sandbox._owns_transport = transport is None
        return sandbox

    @property
    def remote(self) -> bool:
        """True when the sandbox lives in a server or on a cluster node."""
        return self._backend.remote

    @property
    def node_id(self) -> str | None:
        """The Ray node the sandbox lives on (a cluster's sandbox; None otherwise)."""
        return self._backend.node_id

    @property
    def metadata(self) -> dict[str, str]:
        return self._backend.metadata

    def set_timeout(self, seconds: float) -> None:
        """End the sandbox ``seconds`` from now (replaces its lifetime)."""
        self._backend.set_timeout(check_lifetime(seconds, "timeout"))

    def get_info(self) -> SandboxInfo:
        return self._backend.info()

    # -- this process's sandbox only (the tier behind it) ----------------------------
    def _local(self) -> LocalBackend:
        if not isinstance(self._backend, LocalBackend):
            raise InvalidState(f"sandbox {self.id} lives in {'a server' if self.remote else 'another process'}: "
                               "its tier is not in this process",
                               sandbox_id=self.id)
        return self._backend

    def _tier_sandbox(self) -> TierSandbox:
        return self._local().tier_sandbox()

    @property
    def _inner(self) -> TierSandbox | None:
        return self._local().inner

    @property
    def network(self) -> SandboxNetwork | Network:
        """The sandbox's network side: ``network.audit()`` lists every refused destination."""
        if isinstance(self._backend, LocalBackend) and self._backend.tier_sandbox().network is not None:
            return self._backend.network
        return Network(self._backend)  # a server's sandbox, or a tier with no network side (wasm): the audit

    def is_running(self) -> bool:
        return self._backend.alive()

    @property
    def paused(self) -> bool:
        return self._backend.paused

    def pause(self, to_disk: bool = False) -> None:
        """Freeze the sandbox: its processes stop where they are and keep their memory, no CPU
        is used, and running commands' timeouts stop counting.  Commands and file calls raise
        :class:`SandboxPaused` until :meth:`resume`.  Raises :class:`InvalidState` on a tier
        that cannot pause (``Capabilities.pause``) and on a sandbox already paused.

        ``to_disk=True`` (microVM, ``Capabilities.snapshot == "live"``): its memory, devices,
        processes and workspace are written to the snapshot store and everything it held is
        released (QEMU exits).  It survives this process and a server's restart:
        ``Sandbox.connect(id).resume()`` brings it back with its processes and memory and the
        same identity (docs/snapshots.md)."""
        if to_disk:
            self._backend.pause(to_disk=True)
        else:
            self._backend.pause()

    def resume(self) -> None:
        """Let a paused sandbox run on from where it stopped (:class:`InvalidState` if it is not paused)."""
        self._backend.resume()

    # -- snapshots (corral.snapshots) -----------------------------------------------
    def snapshot(self) -> Snapshot:
        """Save the sandbox's files (process and gVisor tiers: what it changed of its image, deletions
        included, and its /workspace) -- not its processes, memory, network rules or secrets.  The
        sandbox is paused while they are copied, then runs on.  On the microVM the snapshot is its
        live state (kind "live": memory, devices, processes, /workspace), and a VM made from it
        gets a fresh identity (RNG, boot id, hostname, machine id).  ``Sandbox.create(snapshot=s.id)``
        starts from it.  Raises :class:`InvalidState` on a tier that cannot."""
        return self._backend.snapshot()

    def fork(self, count: int = 1) -> builtins.list[Sandbox]:
        """``count`` new sandboxes, each starting from this one's files as they are now, with fresh
        processes and a fresh identity (id, hostname, machine id), this sandbox's limits, env and
        cwd, and no network (none) or secrets.  This sandbox keeps running unchanged."""
        check_fork_count(count)
        transport = self._transport
        if transport is None:
            raise InvalidState(f"sandbox {self.id}: forked only through the transport that made it",
                               sandbox_id=self.id)
        children = [type(self)(backend, transport) for backend in transport.fork(self._backend, count)]
        if self._owns_transport:  # the last of them to be killed closes it
            users = self._transport_users = self._transport_users or [1]
            users[0] += len(children)
            for child in children:
                child._owns_transport, child._transport_users = True, users
        return children

    @classmethod
    def list_snapshots(cls, *, state: str | Path | None = None, url: str | None = None, api_key: str | None = None,
                       transport: Transport | None = None) -> builtins.list[Snapshot]:
        """The stored snapshots (of this state directory, or yours in the server at ``url``)."""
        with cls._transport_for_one_call(url, api_key, state, transport) as chosen:
            return chosen.list_snapshots()

    @classmethod
    def delete_snapshot(cls, snapshot_id: str, *, state: str | Path | None = None, url: str | None = None,
                        api_key: str | None = None, transport: Transport | None = None) -> bool:
        """Remove a snapshot; False if there is none (of yours)."""
        with cls._transport_for_one_call(url, api_key, state, transport) as chosen:
            return chosen.delete_snapshot(snapshot_id)

    def create_code_context(self, language: str = "python", cwd: str | None = None) -> CodeContext:
        """A new interpreter with its own variables (``run_code(..., context=ctx)``)."""
        return CodeContext(self._backend.create_code_context(language, cwd), language, cwd)

    def list_code_contexts(self) -> builtins.list[CodeContext]:
        """The code contexts made (:meth:`create_code_context`) and not removed."""
        return [CodeContext(*c) for c in self._backend.code_contexts()]

    def remove_code_context(self, context: CodeContext | str) -> None:
        """End a code context's interpreter and forget its variables; its room counts again toward
        the sandbox's 16 (a cell running in it ends too).  InvalidSpec if there is no such context."""
        self._backend.remove_code_context(context.id if isinstance(context, CodeContext) else context)

    def run_code(self, code: str, *, language: str | None = None, context: CodeContext | str | None = None,
                 timeout: float | None = None, envs: dict[str, str] | None = None,
                 **callbacks: Any) -> Execution:
        """Run a cell in this sandbox's persistent interpreter; returns an E2B-shaped
        :class:`corral.execution.Execution` (variables and imports survive across calls).
        ``context`` names an interpreter made by :meth:`create_code_context`; callbacks
        (``on_stdout``, ``on_stderr``, ``on_result``, ``on_error``) get each part of it; ``envs``
        are environment variables for this cell only.  Languages: python, javascript (``js``)."""
        unknown = sorted(set(callbacks) - {"on_stdout", "on_stderr", "on_result", "on_error"})
        if unknown:
            raise InvalidSpec(f"unknown argument(s) to run_code: {', '.join(unknown)}")
        if not isinstance(code, str):
            raise InvalidSpec("code must be a string")
        name = context.id if isinstance(context, CodeContext) else context
        return self._backend.run_code(self, code, language=language, context=name, timeout=timeout,
                                      envs=validate_env(envs) if envs else None, callbacks=callbacks)

    def _kill(self) -> None:
        """Destroy the sandbox: every process, mount, cgroup and file of it. Idempotent.

        ``sb.kill()`` (E2B's name); :meth:`close` and :meth:`destroy` are aliases.  On the class,
        ``Sandbox.kill(sandbox_id)`` kills by id."""
        try:
            self._backend.close()
        finally:
            if self._owns_transport and self._transport is not None:
                self._owns_transport = False
                users = self._transport_users
                if users is not None:
                    users[0] -= 1
                if users is None or users[0] <= 0:
                    self._transport.close()

    @classmethod
    def _kill_by_id(cls, sandbox_id: str, *, state: str | Path | None = None, url: str | None = None,
                    api_key: str | None = None, transport: Transport | None = None,
                    cluster: str | bool | None = None) -> bool:
        with cls._transport_for_one_call(url, api_key, state, transport, cluster) as chosen:
            return chosen.kill(sandbox_id)

    kill: Any = InstanceOrClass(_kill, _kill_by_id)
    close = _kill
    destroy = _kill

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def __repr__(self) -> str:
        state = ("paused" if self.paused else "running") if self.is_running() else "closed"
        where = " remote" if self.remote else ""
        return f"<Sandbox {self.id} {self.spec.tier}:{self.spec.image}{where} {state}>"


def run(cmd: str | Sequence[str], *, timeout: float | None = None, stdin: str | bytes | None = None,
        on_stdout: Callable[[str], None] | None = None, on_stderr: Callable[[str], None] | None = None,
        spec: SandboxSpec | None = None, **kwargs: Any) -> ExecResult:
    """Create a sandbox, run one command, destroy the sandbox."""
    with Sandbox.create(spec, **kwargs) as sb:
        return sb.commands.run(cmd, timeout=timeout, stdin=stdin, on_stdout=on_stdout, on_stderr=on_stderr)

