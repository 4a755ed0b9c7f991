"""One sandbox owned by this process (:class:`LocalBackend`): its tier sandbox, its lifetime
timer, the commands it started (found again by pid, :class:`LocalProcess`), its code
interpreters, and pausing it to disk.  :mod:`corral.local_transport` makes and finds them.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import parked
from .commands import BASE_ENV, ROOT_ENV, CommandInfo, argv_of
from .egress.network import SandboxNetwork
from .errors import InvalidSpec, InvalidState, ResourceLimit, SandboxClosed, SandboxNotFound, SandboxPaused, host_errors
from .lifecycle import (
    LIVE,
    Lifetime,
    SandboxInfo,
    row_of,
)
from .parked import Parked
from .ports import ExposedPort
from .registry import Registry
from .secrets import Redactor, StreamRedactor
from .snapshots import Snapshot, SnapshotStore
from .spec import SandboxSpec, validate_sandbox_path
from .tiers import get_tier, tier_class
from .tiers.base import ExecRequest, ExecResult, FileEntry, Process, TierSandbox
from .transport import CommandCall, CommandProcess, OutputCallback, SandboxBackend, run_to_its_end

if TYPE_CHECKING:
    from .egress.audit import AuditEvent
    from .execution import Execution
    from .host.portfwd import PortForward
    from .interpreter import CodeInterpreter


#: how long ``run(background=True)`` waits for the command to exist, so its pid is known
BACKGROUND_START_TIMEOUT = 10.0


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(8)

class LocalProcess(CommandProcess):
    """A tier's process, with the sandbox's secrets redacted from what it hands back."""

    def __init__(self, process: Process, sandbox_id: str, redactor: Redactor | None = None,
                 stream: StreamRedactor | None = None) -> None:
        self._process = process
        self._sandbox_id = sandbox_id
        self._redactor = redactor
        self._stream = stream
        #: set once a wait for the command returned; who is told then (see on_end)
        self._ended = False
        self._end_listeners: list[Callable[[], None]] = []
        self._end_lock = threading.Lock()

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

    def signals_delivered(self, timeout: float) -> bool:
        return self._process.signals_delivered(timeout)

    def kill(self) -> None:
        self._process.kill()

    def resize(self, rows: int, cols: int) -> None:
        self._process.resize(rows, cols)

    def on_end(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` once the command has ended and been waited for (every command is:
        by its ``run``, or by a thread of its own), at once if it has; returns what takes
        ``listener`` back (one who stops waiting for the command leaves nothing behind)."""
        with self._end_lock:
            if not self._ended:
                self._end_listeners.append(listener)
                return lambda: self._forget(listener)
        listener()
        return lambda: None

    def _forget(self, listener: Callable[[], None]) -> None:
        with self._end_lock, contextlib.suppress(ValueError):
            self._end_listeners.remove(listener)

    def _waited(self) -> None:
        with self._end_lock:
            self._ended = True
            listeners, self._end_listeners = self._end_listeners, []
        for listener in listeners:
            listener()

    def wait_quietly(self) -> None:
        """Wait for the command's end, leaving what it ended with to its caller's own ``wait``."""
        try:
            with contextlib.suppress(Exception):
                self._process.wait()
        finally:
            self._waited()

    def wait(self, on_output: OutputCallback | None = None) -> ExecResult:
        with host_errors("wait for a command", self._sandbox_id):
            try:
                result = self._process.wait()
            finally:
                self._waited()
        if self._stream is not None:
            self._stream.flush()
        if self._redactor is not None:
            result.stdout = self._redactor.redact_text(result.stdout)
            result.stderr = self._redactor.redact_text(result.stderr)
        if on_output is not None:  # attached late: what it printed (as the server replays it)
            for stream, data in self._printed(result).items():
                if data:
                    on_output(stream, data)
        return result

    def _printed(self, result: ExecResult) -> dict[str, bytes]:
        """Its output as it wrote it (its result's text had U+FFFD for bytes that are not UTF-8)."""
        kept = self._process.kept_output()
        if kept is None:
            return {"stdout": result.stdout.encode(), "stderr": result.stderr.encode()}
        if self._redactor is not None:
            return {stream: self._redactor.redact(data) for stream, data in kept.items()}
        return kept


class LocalBackend(SandboxBackend):
    """One sandbox of this process."""

    def __init__(self, spec: SandboxSpec, inner: TierSandbox | None, root: Path, registry: Registry,
                 metadata: dict[str, str], parked_record: Parked | None = None) -> None:
        self.id = inner.id if inner is not None else parked_record.sandbox_id if parked_record else ""
        #: paused to disk (``pause(to_disk=True)``, :mod:`corral.parked`): its record, and no ``inner``
        self.parked = parked_record
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
        #: removed contexts whose kernels have not ended yet: they keep their room (before, 48
        #: kernels ran cells at once against a bound of 16)
        self.contexts_ending = 0
        #: the ``Sandbox`` in front of this backend (set by it): what another process's
        #: ``run_code`` runs through (owner_link)
        self.front: weakref.ref[Any] | None = None

    def tier_sandbox(self) -> TierSandbox:
        if self.inner is None and self.parked is not None:
            raise SandboxPaused(f"sandbox {self.id} is paused to disk: resume() it first", sandbox_id=self.id)
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
    def request(self, call: CommandCall, stdin_closed: bool = False) -> ExecRequest:
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
            max_output=limits.max_output if call.keep_output else 0,
            pty=call.pty,
            user=call.user,
            stdin_closed=stdin_closed,
        )

    def run(self, call: CommandCall, stdin: bytes | None, on_output: OutputCallback | None,
            started: Callable[[CommandProcess], None] | None = None) -> ExecResult:
        # no input: the tier may send stdin's end of file with the command (one write, one
        # wake-up of the agent less); closing it again is a no-op then
        process = self.start(call, on_output, stdin_closed=stdin is None, waited=True)
        try:
            if started is not None:
                started(process)
            return run_to_its_end(process, stdin)
        except BaseException:
            # maybe not waited for after all (its stdin refused, the caller interrupted): a thread
            # does (at once if it has ended), so its end is accounted and those attached are told
            _wait_in_the_background(process)
            raise

    def start(self, call: CommandCall, on_output: OutputCallback | None, stdin_closed: bool = False,
              waited: bool = False) -> LocalProcess:
        """Start a command.  Unless ``waited`` (the caller waits for it at once, as ``run`` does), a
        thread of its own waits for it: a command's timeout kills it, and its end is accounted
        (its kill-tree leaf removed, OOM read, workspace written back), whether or not its caller
        ever waits -- a background command nobody waited for ran on past its timeout."""
        request = self.request(call, stdin_closed)
        inner = self.tier_sandbox()
        network = inner.network
        with host_errors("start a command", self.id):
            if network is not None and network.secrets:
                stream = StreamRedactor(network.redactor, on_output) if on_output is not None else None
                process = LocalProcess(inner.start(request, stream.feed if stream else None), self.id,
                                       network.redactor, stream)
            else:
                process = LocalProcess(inner.start(request, on_output), self.id)
        with self._lock:
            self._started = [(p, r) for p, r in self._started if not p.done]
            self._started.append((process, request))
        if not waited:
            _wait_in_the_background(process)
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
        if self.inner is not None:  # commands a live snapshot brought in (a microVM's fork, restore, resume)
            with host_errors("list commands", self.id):
                running += [CommandInfo(*carried) for carried in self.inner.carried_commands()]
        from .interpreter import is_kernel

        return [info for info in running if not is_kernel(info.argv)]

    def command(self, pid: int) -> LocalProcess:
        with self._lock:
            for process, _ in self._started:
                if process.pid == pid and not process.done:
                    return process
        if self.inner is not None and any(carried[0] == pid for carried in self.inner.carried_commands()):
            raise InvalidSpec(f"sandbox {self.id}: command {pid} came with the live state this sandbox was made "
                              "from, and its output and exit status stay with the sandbox that started it: "
                              "it can be listed and killed here, not waited for")
        raise InvalidSpec(f"sandbox {self.id} has no running command with pid {pid}")

    def kill_command(self, pid: int) -> bool:
        try:
            process = self.command(pid)
        except InvalidSpec:
            return self.inner is not None and self.inner.kill_carried(pid)
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
        if self.parked is None:
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
        return self.parked is not None or (self.inner is not None and self.inner.alive())

    @property
    def paused(self) -> bool:
        return self.parked is not None or (self.inner is not None and self.inner.paused)

    def pause(self, to_disk: bool = False, tenant: str | None = None, server: dict[str, Any] | None = None) -> None:
        """``to_disk``: save the whole live state as a snapshot and release everything (a
        microVM's QEMU exits); ``tenant`` and ``server``: the server's facts, kept for its restart."""
        if self.parked is not None:
            raise InvalidState(f"sandbox {self.id} is already paused (to disk)", sandbox_id=self.id)
        if to_disk:
            self._park(tenant, server or {})
            return
        with host_errors("pause the sandbox", self.id):
            self.tier_sandbox().pause()

    def resume(self) -> None:
        if self.parked is not None:
            self._unpark()
            return
        with host_errors("resume the sandbox", self.id):
            self.tier_sandbox().resume()

    def _park(self, tenant: str | None, server: dict[str, Any]) -> None:
        inner = self.tier_sandbox()
        spec = self.spec
        if inner.paused:
            raise InvalidState(f"sandbox {self.id} is already paused", sandbox_id=self.id)
        if tier_class(spec.tier).capabilities.snapshot != "live":
            raise InvalidState(f"sandbox {self.id}: the {spec.tier} tier cannot pause to disk (it saves processes "
                               "and memory only on a tier with live snapshots: microvm); pause() keeps it in memory",
                               sandbox_id=self.id)
        if spec.workspace is not None or spec.network != "none":
            raise InvalidState(f"sandbox {self.id}: a sandbox with a host workspace or a network cannot pause to "
                               "disk (neither is part of its saved state)", sandbox_id=self.id)
        with host_errors("pause the sandbox to disk", self.id):
            snapshot = SnapshotStore(self.root).take(inner, spec, tenant, parked_by=self.id)
        record = Parked(self.id, snapshot.id, spec.to_dict(), dict(self._metadata), self._started_at,
                        self._lifetime.end_at, server)
        parked.save(self.root, record)
        with self._lock:
            self._started = []
        self.inner, self.parked = None, record
        try:
            inner.close()  # its memory goes with its QEMU
        finally:
            self._registry.remove(self.id)

    def _unpark(self) -> None:
        try:
            with parked.claimed(self.root, self.id) as record:
                if record is None:
                    self.parked = None
                    LIVE.pop(self.id, None)
                    raise SandboxNotFound(f"sandbox {self.id} was resumed or killed by another process",
                                          sandbox_id=self.id)
                store = SnapshotStore(self.root)
                _, files, digest = store.files(record.snapshot_id, parked=True)
                with host_errors("resume the sandbox from disk", self.id):
                    self.inner, self._registry = start_inner(self.root, self.spec, self.id, (files, digest),
                                                             self._metadata, self._lifetime.end_at)
                self.parked = None
                store.delete(record.snapshot_id, parked=True)
                parked.remove(self.root, self.id)
        except BlockingIOError:
            raise InvalidState(f"sandbox {self.id} is being resumed by another process", sandbox_id=self.id) from None

    def run_code(self, sandbox: Any, code: str, *, language: str | None, context: str | None,
                 timeout: float | None, envs: dict[str, str] | None, callbacks: dict[str, Any]) -> Execution:
        from .interpreter import interpreter_in

        self.tier_sandbox()
        self._check_code()
        return interpreter_in(self, sandbox, language, context).run(code, timeout=timeout, envs=envs, **callbacks)

    def _check_code(self) -> None:
        """Refuse at once on a tier that runs no interpreter (wasm: each call waited 30 s for a
        kernel that never said it was ready, then blamed the image's python3)."""
        if not tier_class(self.spec.tier).capabilities.code:
            raise InvalidState(f"sandbox {self.id}: the {self.spec.tier} tier runs no code interpreter "
                               "(run_code); run each program as a command", sandbox_id=self.id)

    def create_code_context(self, language: str, cwd: str | None) -> str:
        from .interpreter import MAX_CODE_CONTEXTS, check_language, language_name

        self.tier_sandbox()
        self._check_code()
        check_language(language)
        where = validate_sandbox_path(cwd, "cwd") if cwd is not None else None
        name = "ctx-" + secrets.token_hex(6)
        with self.interpreters_lock:
            if len(self.contexts) + self.contexts_ending >= MAX_CODE_CONTEXTS:
                raise ResourceLimit(f"sandbox {self.id} already has {MAX_CODE_CONTEXTS} code contexts, the most "
                                    "one sandbox may have (each is an interpreter process)", sandbox_id=self.id)
            self.contexts[name] = (language_name(language), where)
        return name

    def code_contexts(self) -> list[tuple[str, str, str | None]]:
        with self.interpreters_lock:
            return [(name, language, cwd) for name, (language, cwd) in self.contexts.items()]

    def remove_code_context(self, name: str) -> None:
        with self.interpreters_lock:
            if name not in self.contexts:
                raise InvalidSpec(f"sandbox {self.id} has no code context {name!r}", sandbox_id=self.id)
            del self.contexts[name]
            interpreter = self.interpreters.pop(name, None)
            self.contexts_ending += 1
        try:
            if interpreter is not None:  # its kernel is killed, a cell running in it ends with it
                interpreter.close()
        finally:
            with self.interpreters_lock:
                self.contexts_ending -= 1

    def audit(self) -> list[AuditEvent]:
        network = self.tier_sandbox().network
        return [] if network is None else network.audit()  # a tier with no network side (wasm) refuses nothing

    def share_cpu(self, weight: float) -> None:
        if self.inner is not None:  # paused to disk: nothing runs, and its resume is a new group
            with host_errors("share the CPU", self.id):
                self.inner.share_cpu(weight)

    def refused_count(self) -> int:
        network = self.tier_sandbox().network
        return 0 if network is None else network.refused_count()

    def expose_port(self, port: int, unix: bool, other_users: Sequence[int] = ()) -> tuple[ExposedPort, Callable[[], None]]:
        forward = self.forward_port(port, unix, other_users)
        return ExposedPort.of(forward), forward.close

    def forward_port(self, port: int, unix: bool, other_users: Sequence[int] = ()) -> PortForward:
        """The forward itself (the owner link keeps it, to close it for another process)."""
        with host_errors("expose a port", self.id):
            return self.tier_sandbox().expose_port(port, unix=unix, other_users=other_users)

    def snapshot(self, tenant: str | None = None, check: Callable[[int], None] | None = None) -> Snapshot:
        """Snapshot the sandbox's files into this state directory's store (owned by ``tenant``;
        ``check``: as :meth:`SnapshotStore.take`'s)."""
        with host_errors("snapshot the sandbox", self.id):
            return SnapshotStore(self.root).take(self.tier_sandbox(), self.spec, tenant, check=check)

    def close(self) -> None:
        self._lifetime.cancel()
        inner, self.inner = self.inner, None
        record, self.parked = self.parked, None
        if record is not None:  # paused to disk: its saved state goes
            SnapshotStore(self.root).delete(record.snapshot_id, parked=True)
            parked.remove(self.root, self.id)
            LIVE.pop(self.id, None)
        if inner is None:
            return
        try:
            inner.close()
        finally:
            self._registry.remove(self.id)
            LIVE.pop(self.id, None)


def start_inner(root: Path, spec: SandboxSpec, sandbox_id: str, seed: tuple[Path, str] | None,
                metadata: dict[str, str], end_at: float | None) -> tuple[TierSandbox, Registry]:
    """Make a sandbox's tier side (from a snapshot's files with ``seed``), registered; nothing is
    left of it if that fails."""
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
    registry.set_record(sandbox_id, {**inner.reap_record(), "corral": {
        "metadata": metadata, "image": spec.image, "end_at": end_at}})
    return inner, registry


def _wait_in_the_background(process: LocalProcess) -> None:
    """A thread that waits for a command nobody else may wait for: its timeout ends it, and its end
    is accounted (see ``LocalBackend.start``)."""
    threading.Thread(target=process.wait_quietly, name="corral-command-end", daemon=True).start()
