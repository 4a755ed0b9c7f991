"""The low-level contract every isolation tier implements.

This module is to Corral what httpx's ``_transports/base.py`` is to httpx: a
strict cut-off between the friendly API (:mod:`corral.sandbox`) and the
pluggable isolation back ends.  It speaks in plain primitives — argv lists,
byte strings, dicts, paths inside the sandbox — and knows nothing of pools,
servers or registries.

A tier says up front what it offers (:class:`Capabilities`) and creates
:class:`TierSandbox` objects.  A tier sandbox runs commands
(:meth:`TierSandbox.start` returns a :class:`Process`), moves files, and is
destroyed with :meth:`TierSandbox.close`, which must leave nothing behind.
The janitor calls :meth:`Tier.reap` with what :meth:`TierSandbox.reap_record`
returned to release what an owner that died left behind.
"""

from __future__ import annotations

import base64
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import InvalidSpec, InvalidState
from ..spec import SandboxSpec

if TYPE_CHECKING:
    from ..egress.network import SandboxNetwork
    from ..host.portfwd import PortForward

#: ``on_output(stream, chunk)`` with stream ``"stdout"`` or ``"stderr"``
OutputCallback = Callable[[str, bytes], None]


#: entries ``list_dir`` returns at most: a larger directory is refused whole (``FileError``,
#: ``E2BIG``), never cut short in silence (its listing is held in memory on both sides)
MAX_LIST_ENTRIES = 100_000


def too_many_entries(path: str) -> str:
    return (f"{path}: more than {MAX_LIST_ENTRIES:,} entries, more than a listing holds: list it with a "
            "command instead (ls, find)")


#: characters of paths a listing holds at most: each entry carries its whole path, so 88,000
#: entries of a directory 3,769 bytes deep held 333 MiB of a server's memory per listing
MAX_LIST_PATH_CHARS = 64 << 20


def listing_too_long(path: str) -> str:
    return (f"{path}: its entries' paths are more than {MAX_LIST_PATH_CHARS >> 20} Mi characters in all, more than "
            "a listing holds: list it with a command instead (ls, find)")


@dataclass(frozen=True)
class ExecRequest:
    """One command to run inside a sandbox."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    timeout: float
    #: bytes of stdout and of stderr kept in the result; the rest is dropped and flagged
    max_output: int
    #: (rows, cols) to run on a terminal (stdout and stderr then arrive merged as stdout)
    pty: tuple[int, int] | None = None
    #: who it runs as (``spec.USERS``); None: the sandbox's user (its spec's ``user``)
    user: str | None = None
    #: the caller has no input for it: a tier may send stdin's end of file with the command
    #: (the caller still calls ``close_stdin``, which must then be harmless)
    stdin_closed: bool = False


@dataclass
class ExecResult:
    """The outcome of one command. Field names match ``corral run --json``."""

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    duration_ms: float = 0.0
    timed_out: bool = False
    oom_killed: bool = False
    #: the signal that ended the main process, if one did
    signal: int | None = None
    #: True if stdout or stderr went over ``max_output`` and was cut
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FileEntry:
    """One directory entry inside a sandbox."""

    name: str
    path: str
    #: "file", "dir", "symlink" or "other"
    type: str
    size: int
    mode: int
    mtime: float

    def to_dict(self) -> dict[str, Any]:
        # (not dataclasses.asdict, which copies each field deeply: a listing of 90,000 entries is
        # one such call per entry, on a server shared by tenants)
        return {"name": self.name, "path": self.path, "type": self.type, "size": self.size, "mode": self.mode,
                "mtime": self.mtime}

    def to_json(self) -> dict[str, Any]:
        """As JSON carries it: a name (or path) that is not UTF-8 -- here with its bytes as
        surrogates, as Python's ``os`` gives them -- is text with U+FFFD in their place, and its
        exact bytes in ``name_b64`` (``path_b64``)."""
        data = self.to_dict()
        for key in ("name", "path"):
            if not data[key].isascii():
                data.update(json_text(key, data[key]))
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FileEntry:
        """The entry ``to_json`` gave (fields it does not know are ignored)."""
        return cls(name=text_of_json(data, "name"), path=text_of_json(data, "path"), type=data["type"],
                   size=data["size"], mode=data["mode"], mtime=data["mtime"])


def json_text(key: str, value: str) -> dict[str, str]:
    """``{key: value}`` for JSON: a ``value`` with bytes that are not UTF-8 (as surrogates) is text
    with U+FFFD in their place, and ``key_b64`` holds its exact bytes."""
    try:
        value.encode()
        return {key: value}
    except UnicodeEncodeError:
        raw = value.encode("utf-8", "surrogateescape")
        return {key: raw.decode(errors="replace"), f"{key}_b64": base64.b64encode(raw).decode()}


def text_of_json(data: dict[str, Any], key: str) -> str:
    """What :func:`json_text` made into ``data``: its bytes that are not UTF-8 as surrogates again."""
    raw = data.get(f"{key}_b64")
    if isinstance(raw, str):
        return base64.b64decode(raw).decode("utf-8", "surrogateescape")
    return str(data[key])


@dataclass(frozen=True)
class Availability:
    """Whether a tier can run on this host, and if not, why and how to fix it."""

    tier: str
    available: bool
    reason: str = ""
    fix: str = ""
    details: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Capabilities:
    """What a tier offers, known before any ``create``: callers check here instead of failing."""

    #: the ``network`` modes of a spec the tier can run
    network_modes: tuple[str, ...]
    #: whether commands can run on a terminal (``pty=(rows, cols)``, ``resize``)
    pty: bool
    #: which images it runs: None for any image of the image store, else these names
    images: tuple[str, ...] | None
    #: who a command runs as inside the sandbox
    users: str
    #: the isolation guarantees it makes, one short line each (docs list the test of each)
    guarantees: tuple[str, ...] = ()
    #: whether its sandboxes can be paused and resumed (:meth:`TierSandbox.pause`)
    pause: bool = False
    #: what :meth:`TierSandbox.snapshot` holds: "filesystem", "live" (memory, devices, processes and
    #: files: the microVM; it can also pause to disk), or "" when the tier cannot snapshot
    snapshot: str = ""
    #: whether ``user="root"`` is offered (root of the sandbox's own user namespace, no host capability)
    root: bool = False
    #: whether ``run_code``'s interpreters (a kernel process per context, fed cells over its stdin) run
    code: bool = True

    def check_user(self, user: str | None, tier: str) -> None:
        """Refuse ``user="root"`` up front on a tier that does not offer it."""
        if user == "root" and not self.root:
            raise InvalidSpec(f"user: the {tier} tier cannot run commands as root (it runs {self.users})")


def keep_output(buf: bytearray, chunk: bytes, limit: int) -> bool:
    """Add to ``buf`` what of ``chunk`` fits under ``limit`` bytes; True if some of it did not
    (the result says ``truncated``)."""
    room = limit - len(buf)
    if room > 0:
        buf += chunk[:room]
    return room < len(chunk)


class Process(ABC):
    """A command running inside a sandbox."""

    #: the command's process id as the sandbox sees it, once its first process exists (None until
    #: then); 0 for tiers whose commands are not processes (wasm)
    pid: int | None = None

    @property
    @abstractmethod
    def done(self) -> bool:
        """True once the command has ended (exited, killed or timed out); never blocks."""

    @abstractmethod
    def write_stdin(self, data: bytes) -> None:
        """Pass ``data`` on to the command's stdin, waiting as a pipe's writer does while the command
        has not taken what came before (what waits inside the sandbox is bounded); never past the
        command's end or timeout.  May raise ``StdinNotTaken`` (the rest was not sent)."""

    @abstractmethod
    def close_stdin(self) -> None: ...

    @abstractmethod
    def send_signal(self, signum: int) -> None:
        """Signal the command's session inside the sandbox (e.g. SIGINT for an interpreter)."""

    def signals_delivered(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every signal sent so far has reached the command (or
        the command ended); True once they have.  Here at once: a tier whose ``send_signal``
        signals the command itself."""
        return True

    @abstractmethod
    def kill(self) -> None:
        """Kill the command's whole process tree, daemonized children included."""

    def resize(self, rows: int, cols: int) -> None:
        """Resize the command's terminal (only for commands started with ``pty``)."""
        raise NotImplementedError("this tier cannot run commands on a terminal")

    @abstractmethod
    def wait(self) -> ExecResult:
        """Block until the command ended or timed out (its tree is killed) and return the result."""

    def kept_output(self) -> dict[str, bytes] | None:
        """The bytes of each stream kept for its result (up to ``max_output``), exactly as the
        command wrote them; None from a tier that keeps only the result's text."""
        return None


#: a file in a live snapshot's ``vm/`` that each VM made from it links into its run directory: the
#: VM maps the snapshot's memory image for its life, and its run directory goes with it (however
#: it ends), so while this has more than one name the snapshot's files are in use
#: (:mod:`corral.snapshots` keeps a deleted one counted until then)
SNAPSHOT_IN_USE = "in-use"


class PendingWrite(ABC):
    """The rest of a snapshot :meth:`TierSandbox.snapshot_begin` returned before it was whole
    (a microVM's memory image, copied out of memory the sandbox no longer uses)."""

    #: the rest adds at most this many bytes to the snapshot
    bytes_at_most: int = 0

    @abstractmethod
    def finish(self, dest: Path) -> int:
        """Write the rest into ``dest`` (the snapshot's files directory where it is now); returns
        bytes written.  Releases what it holds, also when it fails."""

    @abstractmethod
    def abandon(self) -> None:
        """Release what it holds without writing (the snapshot is dropped)."""


class TierSandbox(ABC):
    """One live sandbox of some tier. Thread-safe: commands and file calls may overlap."""

    id: str
    #: the sandbox's network side (proxy, audit log, secrets), for tiers that have one
    network: SandboxNetwork | None = None

    @abstractmethod
    def start(self, request: ExecRequest, on_output: OutputCallback | None = None) -> Process: ...

    def exec(self, request: ExecRequest, on_output: OutputCallback | None = None) -> ExecResult:
        return self.start(request, on_output).wait()

    def with_network_env(self, request: ExecRequest) -> ExecRequest:
        """The request with the network side's environment (proxy variables, secret placeholders)
        under its own: the command's explicit env wins."""
        if self.network is None or not self.network.env:
            return request
        return replace(request, env={**self.network.env, **request.env})

    @abstractmethod
    def read_file(self, path: str, max_bytes: int) -> bytes: ...

    @abstractmethod
    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None: ...

    @abstractmethod
    def list_dir(self, path: str) -> list[FileEntry]: ...

    @abstractmethod
    def stat(self, path: str) -> FileEntry: ...

    @abstractmethod
    def remove(self, path: str, recursive: bool = False) -> None: ...

    @abstractmethod
    def make_dir(self, path: str, mode: int = 0o755) -> None: ...

    def expose_port(self, port: int, unix: bool = False, other_users: Sequence[int] = ()) -> PortForward:
        """Forward a new host listener (TCP on 127.0.0.1, or a Unix socket with ``unix``) into
        ``port`` on the sandbox's own loopback, through the host side: the sandbox's network is
        left as its mode made it. Only this process's user and root connect, and the uids in
        ``other_users`` (TCP only). The forward closes with the sandbox."""
        raise InvalidSpec(f"sandbox {self.id}: its tier cannot forward ports")

    def share_cpu(self, weight: float) -> None:  # noqa: B027 - optional hook: a tier with no host group
        """Weigh this sandbox's CPU against other sandboxes' when the host's CPU is contended
        (``cpu.weight``'s scale, default 100): a server gives each tenant's sandboxes one share
        together (:mod:`corral.server.manager`)."""

    def sync(self) -> None:  # noqa: B027 - optional hook: most tiers have nothing to sync
        """Write workspace changes back to the host, for tiers and modes that do so."""

    @abstractmethod
    def alive(self) -> bool: ...

    @property
    def paused(self) -> bool:
        return False

    def pause(self) -> None:
        """Freeze every process of the sandbox until :meth:`resume`: memory stays held, no CPU is
        used, commands' timeouts stop running, and commands and file calls raise
        :class:`~corral.errors.SandboxPaused` meanwhile."""
        raise InvalidState(f"sandbox {self.id}: its tier cannot pause sandboxes", sandbox_id=self.id)

    def resume(self) -> None:
        """Let a paused sandbox run again, from where it stopped."""
        raise InvalidState(f"sandbox {self.id} is not paused", sandbox_id=self.id)

    def snapshot_begin(self, dest: Path, shared: Path | None = None) -> tuple[int, PendingWrite | None]:
        """As :meth:`snapshot`, but may return once the sandbox runs on and what is left to write
        no longer depends on it: (bytes written, the rest to write or None).  The caller marks
        the snapshot as being written until :meth:`PendingWrite.finish` returns."""
        return self.snapshot(dest, shared), None

    def snapshot(self, dest: Path, shared: Path | None = None) -> int:
        """Write the sandbox's files (what it changed of its image, and its workspace) into the new
        directory ``dest``, consistently (the sandbox is paused meanwhile); contents already in
        ``shared`` (other snapshots' blobs) are linked, not written.  Returns bytes written.
        :meth:`Tier.create_from_snapshot` starts a sandbox from such a directory."""
        raise InvalidState(f"sandbox {self.id}: its tier cannot take snapshots", sandbox_id=self.id)

    def carried_commands(self) -> list[tuple[int, list[str], str]]:
        """(pid, argv, cwd) of each command that came into this sandbox with a live snapshot (a
        microVM's fork, restore or resume) and still runs: no handle of this process started them."""
        return []

    def kill_carried(self, pid: int) -> bool:
        """Kill such a command; False if none has that pid."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Destroy the sandbox: no process, mount, cgroup or file of it survives. Idempotent."""

    @abstractmethod
    def reap_record(self) -> dict[str, Any]:
        """JSON-able facts the janitor needs to reap this sandbox if its owner dies."""


class Tier(ABC):
    """An isolation back end."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    @classmethod
    @abstractmethod
    def probe(cls, state_dir: Path) -> Availability:
        """Say whether this host can run the tier (cheap; used by ``corral doctor``)."""

    @abstractmethod
    def create(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path) -> TierSandbox:
        """Create a sandbox. ``run_dir`` is an empty, root-only directory the sandbox owns."""

    def create_from_snapshot(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path, snapshot: Path,
                             digest: str) -> TierSandbox:
        """Create a sandbox whose files start as ``snapshot`` (written by :meth:`TierSandbox.snapshot`,
        its manifest's sha256 ``digest``), with a fresh identity; a corrupted snapshot raises
        :class:`~corral.errors.SnapshotCorrupt` and leaves nothing behind."""
        raise InvalidState(f"the {self.name} tier cannot start sandboxes from snapshots")

    #: up to how many forks at once :meth:`fork_live` makes (more go through a stored snapshot,
    #: whose memory they share); 0: the tier always forks through a snapshot
    direct_forks: ClassVar[int] = 0

    def fork_live(self, parent: TierSandbox, spec: SandboxSpec,
                  children: list[tuple[str, Path]]) -> list[TierSandbox]:
        """New sandboxes straight from ``parent``'s live state, no snapshot stored (at most
        ``direct_forks``), one per (sandbox id, empty run dir) of ``children``: all made, or none
        (a failure closes those made and raises)."""
        raise InvalidState(f"the {self.name} tier forks through a snapshot")

    @abstractmethod
    def reap(self, sandbox_id: str, run_dir: Path, record: dict[str, Any]) -> None:
        """Release everything a sandbox left behind after its owner died. Idempotent."""
