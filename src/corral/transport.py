"""Where a :class:`corral.Sandbox` lives: in this process, or in a server over HTTP.

As httpx's ``Client(transport=...)`` separates the friendly API from how a
request is carried, ``Sandbox`` (with its ``commands``, ``files``, ``ports``)
is one class whose every call goes to a :class:`Transport` and the
:class:`SandboxBackend` it made for one sandbox:

- :class:`corral.local_transport.LocalTransport`: tiers and the registry of a state directory;
- :class:`corral.http_transport.HTTPTransport`: a ``corral serve`` (REST and WebSocket).

Arguments are checked once, in the front classes, before any transport sees
them, so both raise the same errors for the same mistakes.  A new option for
every command (issue 13's ``user=``) is one field of :class:`CommandCall`; a
new option for create is one field of :class:`CreateOptions`; each transport
then carries it (the HTTP one as a field of the request body).
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import StdinNotTaken
from .spec import SandboxSpec
from .tiers.base import ExecResult, FileEntry, Process

if TYPE_CHECKING:
    from .commands import CommandInfo
    from .egress.audit import AuditEvent
    from .execution import Execution
    from .lifecycle import SandboxInfo
    from .ports import ExposedPort
    from .snapshots import Snapshot

OutputCallback = Callable[[str, bytes], None]

#: stdin sent in the request that starts a command up to this size; more goes after it, in parts
#: (a server's request bodies are at most 32 MiB, an owner link's frames 96 MiB, and base64 or
#: JSON escapes may double it)
INLINE_STDIN = 8 << 20


def split_stdin(stdin: bytes | None) -> tuple[bytes | None, bytes | None]:
    """(stdin for the request that starts a command, stdin to write once it has started): one or
    the other."""
    if stdin is not None and len(stdin) > INLINE_STDIN:
        return None, stdin
    return stdin, None


@dataclass(frozen=True)
class CommandCall:
    """One command as the caller asked for it (already checked): what both transports carry."""

    #: a shell string (``/bin/sh -c``) or an argv list
    cmd: str | Sequence[str]
    timeout: float | None = None
    env: Mapping[str, str] | None = None
    #: an absolute in-sandbox path, or None for the sandbox's working directory
    cwd: str | None = None
    pty: tuple[int, int] | None = None
    #: ``"root"`` or ``"user"`` (``spec.USERS``); None: the sandbox's own ``user``
    user: str | None = None
    #: False: the caller takes all the output through its callback and none is kept for the result
    #: (an interpreter's kernel, which lives for days; not carried over REST)
    keep_output: bool = True

    def body(self) -> dict[str, Any]:
        """The JSON request of the REST API (only the fields given)."""
        out: dict[str, Any] = {"cmd": self.cmd if isinstance(self.cmd, str) else list(self.cmd)}
        for name, value in (("timeout", self.timeout), ("env", dict(self.env) if self.env is not None else None),
                            ("cwd", self.cwd), ("user", self.user)):
            if value is not None:
                out[name] = value
        return out


@dataclass(frozen=True)
class CreateOptions:
    """What ``Sandbox.create`` was asked for, beyond the spec."""

    spec: SandboxSpec
    metadata: dict[str, str] = field(default_factory=dict)
    #: seconds from creation until the sandbox is destroyed
    lifetime: float | None = None
    #: seconds without use until a server (or a cluster node) destroys it
    idle_timeout: float | None = None
    #: seconds a create may wait for a free slot (a cluster only)
    slot_timeout: float | None = None
    #: a snapshot id to start from (its tier and image replace the spec's)
    snapshot: str | None = None


class CommandProcess(Process):
    """A command as a transport returns it: a :class:`~corral.tiers.base.Process` whose ``wait``
    can also hand what the command printed to ``on_output`` (attaching late replays it)."""

    @abstractmethod
    def wait(self, on_output: OutputCallback | None = None) -> ExecResult: ...  # type: ignore[override]


def run_to_its_end(process: CommandProcess, stdin: bytes | None) -> ExecResult:
    """Give a started command all of ``stdin`` (if any), close it, and wait for its result."""
    if stdin is not None:
        try:
            process.write_stdin(stdin)
        except StdinNotTaken:
            # a run's command has all its input or does not run on: it took none of it for a
            # minute, and what it would answer with part of it is not what was asked
            process.kill()
            process.wait()
            raise
    process.close_stdin()
    return process.wait()


class SandboxBackend(ABC):
    """One sandbox as a transport reaches it.  Every method may raise :mod:`corral.errors`."""

    id: str
    spec: SandboxSpec
    #: True when the sandbox lives in a server
    remote: bool = False
    #: the Ray node the sandbox lives on (a cluster's sandboxes; None elsewhere)
    node_id: str | None = None

    # -- commands ---------------------------------------------------------------
    @abstractmethod
    def start(self, call: CommandCall, on_output: OutputCallback | None) -> CommandProcess:
        """Start a command, its output reaching ``on_output`` as it comes."""

    def run(self, call: CommandCall, stdin: bytes | None, on_output: OutputCallback | None,
            started: Callable[[CommandProcess], None] | None = None) -> ExecResult:
        """Run a command to its end (a transport may do it in one round trip).  ``started`` gets the
        running command as soon as it exists (a caller that may have to kill it: a server whose
        client left), and then the run is started and waited here."""
        process = self.start(call, on_output)
        if started is not None:
            started(process)
        return run_to_its_end(process, stdin)

    @abstractmethod
    def start_background(self, call: CommandCall, stdin: bytes | None,
                         on_output: OutputCallback | None) -> CommandProcess:
        """Start a command that is found again by pid; returns once its pid is known."""

    @abstractmethod
    def commands(self) -> list[CommandInfo]: ...

    @abstractmethod
    def command(self, pid: int) -> CommandProcess:
        """The running command with this pid (:class:`~corral.errors.InvalidSpec` if none)."""

    @abstractmethod
    def kill_command(self, pid: int) -> bool: ...

    # -- files --------------------------------------------------------------------
    @abstractmethod
    def read_file(self, path: str, max_bytes: int) -> bytes: ...

    @abstractmethod
    def write_file(self, path: str, data: bytes, mode: int) -> None: ...

    @abstractmethod
    def list_dir(self, path: str) -> list[FileEntry]: ...

    @abstractmethod
    def stat(self, path: str) -> FileEntry: ...

    @abstractmethod
    def remove(self, path: str, recursive: bool) -> None: ...

    @abstractmethod
    def make_dir(self, path: str, mode: int) -> None: ...

    # -- the sandbox --------------------------------------------------------------
    @property
    @abstractmethod
    def metadata(self) -> dict[str, str]: ...

    @abstractmethod
    def info(self) -> SandboxInfo: ...

    @abstractmethod
    def set_timeout(self, seconds: float) -> None: ...

    @abstractmethod
    def alive(self) -> bool: ...

    @property
    @abstractmethod
    def paused(self) -> bool: ...

    @abstractmethod
    def pause(self, to_disk: bool = False) -> None: ...

    @abstractmethod
    def resume(self) -> None: ...

    @abstractmethod
    def run_code(self, sandbox: Any, code: str, *, language: str | None, context: str | None,
                 timeout: float | None, envs: dict[str, str] | None, callbacks: dict[str, Any]) -> Execution:
        """A cell in the interpreter of ``context`` (made by :meth:`create_code_context`), else in the
        sandbox's interpreter of ``language`` (default python); ``sandbox`` is the front object."""

    @abstractmethod
    def create_code_context(self, language: str, cwd: str | None) -> str:
        """A new interpreter of its own; returns its name."""

    @abstractmethod
    def code_contexts(self) -> list[tuple[str, str, str | None]]:
        """The code contexts made and not removed: (name, language, cwd) each."""

    @abstractmethod
    def remove_code_context(self, name: str) -> None:
        """End a code context's interpreter and forget it (InvalidSpec if there is none of the name)."""

    @abstractmethod
    def audit(self) -> list[AuditEvent]: ...

    def share_cpu(self, weight: float) -> None:  # noqa: B027 - optional: where the host group is ours to set
        """Weigh the sandbox's CPU against others' (``cpu.weight``'s scale, default 100): a server's
        share per tenant. A back end whose sandbox's host group is not this process's (a server's, a
        cluster node's) leaves it as its own host set it."""

    def refused_count(self) -> int:
        """How many ``refused`` events the sandbox's egress recorded so far (a server's metrics read
        it after every command); a back end with the count at hand answers without the events."""
        return sum(1 for event in self.audit() if event.kind == "refused")

    @abstractmethod
    def expose_port(self, port: int, unix: bool, other_users: Sequence[int] = ()) -> tuple[ExposedPort, Callable[[], None]]:
        """Where the caller reaches ``port`` of the sandbox, and how to close that way; beside the
        caller's user and root, the uids ``other_users`` may connect (a TCP forward on this host)."""

    def snapshot(self) -> Snapshot:
        """Snapshot the sandbox's files (see :mod:`corral.snapshots`)."""
        from .errors import InvalidState

        raise InvalidState(f"sandbox {self.id}: snapshots are not taken through this transport",
                           sandbox_id=self.id)

    @abstractmethod
    def close(self) -> None:
        """Destroy the sandbox (idempotent)."""


class Transport(ABC):
    """Makes, finds, lists and kills sandboxes of one place (this process's state directory, or a server)."""

    #: True when the sandboxes live in another process (a server, a cluster)
    remote: bool = False
    #: True when a create is placed on one of several nodes and may wait for a slot (a cluster)
    places: bool = False

    @abstractmethod
    def create(self, options: CreateOptions) -> SandboxBackend: ...

    @abstractmethod
    def connect(self, sandbox_id: str) -> SandboxBackend: ...

    @abstractmethod
    def list(self, metadata: dict[str, str] | None) -> list[SandboxInfo]: ...

    @abstractmethod
    def kill(self, sandbox_id: str) -> bool:
        """Destroy the sandbox with this id; False if there is none."""

    # -- snapshots -----------------------------------------------------------------
    def list_snapshots(self) -> builtins.list[Snapshot]:
        from .errors import InvalidState

        raise InvalidState("this transport keeps no snapshots")

    def delete_snapshot(self, snapshot_id: str) -> bool:
        """Remove a snapshot; False if there is none."""
        from .errors import InvalidState

        raise InvalidState("this transport keeps no snapshots")

    def fork(self, backend: SandboxBackend, count: int) -> builtins.list[SandboxBackend]:
        """``count`` new sandboxes from a snapshot of ``backend``'s files (the parent keeps running;
        the snapshot is removed once they exist).  Each gets the parent's limits, env and cwd."""
        from .snapshots import fork_spec

        snapshot = backend.snapshot()
        made: builtins.list[SandboxBackend] = []
        try:
            spec = fork_spec(backend.spec)
            for _ in range(count):
                made.append(self.create(CreateOptions(spec, snapshot=snapshot.id)))
        except BaseException:
            for child in made:
                child.close()
            raise
        finally:
            self.delete_snapshot(snapshot.id)
        return made

    def close(self) -> None:  # noqa: B027 - a transport may hold nothing to release
        """Release what the transport holds (connections); its sandboxes are left as they are."""
