"""Corral's exception tree.

Every error Corral raises on purpose is a :class:`SandboxError`, so callers
can catch one class.  The tree::

    SandboxError
    ├── InvalidSpec            a spec, a limit or an argument is wrong
    ├── HostNotSupported       this host cannot run the requested tier
    │   └── ClusterUnauthenticated  the Ray cluster lets drivers in without a token
    ├── SandboxNotFound        no live sandbox with that id (or not yours)
    │   └── SnapshotNotFound   no snapshot with that id (or not yours)
    ├── SandboxClosed          the sandbox was destroyed or died
    │   └── SandboxLost        the cluster node holding it was lost
    ├── InvalidState           the call does not fit the sandbox's state (resume one not paused)
    │   ├── SandboxPaused      the sandbox is paused: resume it first
    │   └── StdinNotTaken      a command took none of its stdin for a minute; the rest was not sent
    ├── ExecError              a command could not run to an outcome
    │   ├── ExecTimeout        a command hit its wall-clock timeout
    │   ├── OutOfMemory        a command was killed by the memory limit
    │   └── ContainmentFailed  a process could not be put under the sandbox's limits; it never ran
    ├── SnapshotCorrupt        a snapshot's files do not match its checksums; nothing was started
    ├── ResourceLimit          a quota or limit refused the request (including no free host uid)
    │   └── ClusterFull        every cluster node's slots stayed taken for the create's whole wait
    ├── HostError              a system call Corral made on the host failed (errno kept)
    ├── FileError              a files-API operation failed
    │   └── FileNotFoundInSandbox  the path does not exist inside the sandbox
    ├── ImageBuildFailed       an image recipe step failed (names the step and its log)
    └── TransportError         the remote SDK could not get an answer from the server
        ├── ConnectionLost     the server cannot be reached, or the connection broke
        ├── Unauthorized       the server refused the API key (HTTP 401)
        └── ServerError        the server failed without a typed error (HTTP 5xx)

Errors about one sandbox (:class:`SandboxClosed`, :class:`ExecError` and its
subclasses, :class:`FileError` and its subclass) carry its id in ``sandbox_id``
where the raiser knows it (``None`` otherwise); every error takes it as a
keyword.

An :class:`ExecResult` is returned, not raised, for timeouts and OOM kills
from ``commands.run``; the exceptions exist for callers that ask for them
(``check=True``) and for the remote SDK to map HTTP errors back.

A destination refused by the egress policy is not an exception: the
connection is refused inside the sandbox (the command sees it fail as any
refused connection) and the refusal is recorded in ``sandbox.network.audit()``.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class SandboxError(Exception):
    """Base class of every error Corral raises on purpose."""

    #: short machine-readable name, used by the server and the CLI's JSON output
    code = "sandbox_error"
    #: the sandbox the error is about, where the raiser knows it
    sandbox_id: str | None = None

    def __init__(self, message: str = "", *, sandbox_id: str | None = None) -> None:
        super().__init__(message)
        if sandbox_id is not None:
            self.sandbox_id = sandbox_id

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.code, "message": str(self)}


class InvalidSpec(SandboxError, ValueError):
    """A sandbox spec, limit, path or argument is invalid; the message says which and why."""

    code = "invalid_spec"


class HostNotSupported(SandboxError):
    """The host lacks something the tier needs (bubblewrap, user namespaces, cgroups, root, ...).

    The message names what is missing and how to fix it.
    """

    code = "host_not_supported"


class ClusterUnauthenticated(HostNotSupported):
    """The Ray cluster named lets any driver in without a token.  Ray runs whatever code a driver
    sends, as the user its nodes run as -- root on Corral's nodes -- so such a cluster is root on
    every node for whoever reaches its ports (another user of a machine reaches the loopback).
    Nothing was created.  Enable Ray's token authentication on every node and driver
    (``RAY_AUTH_MODE=token``, the token in ``~/.ray/auth_token`` or ``RAY_AUTH_TOKEN``: see
    docs/cluster.md), or state that nobody else reaches the cluster with
    ``CORRAL_RAY_UNAUTHENTICATED=1`` in the driver's environment."""

    code = "cluster_unauthenticated"


class SandboxNotFound(SandboxError, LookupError):
    """No live sandbox has this id, or it belongs to someone else (the two are not told apart)."""

    code = "not_found"


class SnapshotNotFound(SandboxNotFound):
    """No snapshot has this id, or it belongs to another tenant (the two are not told apart)."""

    code = "snapshot_not_found"


class SnapshotCorrupt(SandboxError):
    """A snapshot's manifest or one of its files does not match the checksum recorded when it was
    taken (or is missing): nothing of the sandbox that was to start from it is left behind."""

    code = "snapshot_corrupt"


class SandboxClosed(SandboxError):
    """The sandbox was destroyed, or its processes died, before the operation could run."""

    code = "sandbox_closed"


class SandboxLost(SandboxClosed):
    """The cluster node that held the sandbox was lost (its Ray node died, or its Corral host
    actor with it): the sandbox is gone with everything in it, and every call on it raises this.
    A new ``Sandbox.create(cluster=...)`` lands on a surviving node."""

    code = "sandbox_lost"


class InvalidState(SandboxError):
    """The call does not fit the sandbox's state: pausing a paused sandbox, resuming one that is
    not paused, pausing or snapshotting on a tier that cannot."""

    code = "invalid_state"


class SandboxPaused(InvalidState):
    """The sandbox is paused (its processes frozen): commands and file calls wait for ``resume()``;
    they are refused rather than left to hang."""

    code = "sandbox_paused"


class StdinNotTaken(InvalidState):
    """A command took none of its stdin for ``WRITE_TIMEOUT`` (60 s) while more of it waited to be
    sent: a write to a command's stdin waits, as a pipe's writer does, while the command has not
    taken the last ``STDIN_WINDOW`` (1 MiB) sent, and gives up after that long without progress.
    What was sent before stays the command's; the rest (the message says how much) was not sent.
    From ``commands.run(stdin=...)`` the command has been ended: it would have answered from part
    of its input."""

    code = "stdin_not_taken"


class ExecError(SandboxError):
    """A command did not reach a normal outcome; carries the partial result when there is one."""

    code = "exec_error"

    def __init__(self, message: str, result: Any = None, *, sandbox_id: str | None = None) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.result = result


class ExecTimeout(ExecError):
    """A command ran past its wall-clock timeout; its whole process tree was killed."""

    code = "timeout"


class OutOfMemory(ExecError):
    """A command was killed because the sandbox reached its memory limit."""

    code = "out_of_memory"


class ContainmentFailed(ExecError):
    """A process could not be placed in every one of the sandbox's limit groups (memory, pids,
    cpu, kill tree), so it was killed before its first instruction: Corral fails closed rather
    than run anything outside the sandbox's limits."""

    code = "containment_failed"


class ResourceLimit(SandboxError):
    """A quota, capacity or size limit refused the request (too many sandboxes, file too large, ...)."""

    code = "resource_limit"


class ClusterFull(ResourceLimit):
    """Every node of the cluster had all its ``corral_slots`` taken for the whole time the caller
    let a create wait (``slot_timeout``); nothing was created."""

    code = "cluster_full"


class HostError(SandboxError):
    """A system call Corral made on the host for a sandbox failed (a mount, a cgroup write, a
    network namespace, a file of the run directory) for a reason that is not the caller's: the
    message names the operation, ``errno`` is the kernel's error number.  Raised in place of a
    bare ``OSError`` where the lifecycle calls into the tiers (see :func:`host_errors`)."""

    code = "host_error"

    def __init__(self, message: str, errno_: int = 0, *, sandbox_id: str | None = None) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.errno = errno_


#: a host error with one of these is the host's capacity running out: a ResourceLimit
_CAPACITY_ERRNOS = frozenset({errno.ENOSPC, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN,
                              errno.EDQUOT, errno.EUSERS})


def quoted(value: object) -> str:
    """``value`` as an error message quotes it: its repr, cut at 200 characters (a request may
    carry megabytes where a name belongs, and the message goes back to it whole)."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


@contextmanager
def host_errors(doing: str, sandbox_id: str | None = None) -> Iterator[None]:
    """Let typed errors through (naming ``sandbox_id`` where they did not yet); turn a bare
    ``OSError`` from the tiers or the host layer into a :class:`ResourceLimit` (the host ran out
    of something) or a :class:`HostError`."""
    try:
        yield
    except SandboxError as exc:
        if sandbox_id is not None and exc.sandbox_id is None:
            exc.sandbox_id = sandbox_id  # raised below the lifecycle, where the id was not known
        raise
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno in _CAPACITY_ERRNOS:
            raise ResourceLimit(f"{doing}: the host is out of capacity ({reason})", sandbox_id=sandbox_id) from exc
        raise HostError(f"{doing}: {reason}", exc.errno or 0, sandbox_id=sandbox_id) from exc


class FileError(SandboxError, OSError):
    """A files-API operation failed inside the sandbox; ``errno`` is the in-sandbox error number."""

    code = "file_error"

    def __init__(self, message: str, errno_: int = 0, *, sandbox_id: str | None = None) -> None:
        SandboxError.__init__(self, message, sandbox_id=sandbox_id)
        self.errno = errno_


class FileNotFoundInSandbox(FileError, FileNotFoundError):
    """The path does not exist inside the sandbox."""

    code = "file_not_found"


class ImageBuildFailed(SandboxError):
    """A step of an image build failed; nothing of the half-built image is kept.

    ``step`` names the step, ``log_path`` is the kept log of that step (host path).
    """

    code = "image_build_failed"

    def __init__(self, message: str, step: str = "", log_path: str = "", *, sandbox_id: str | None = None) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.step = step
        self.log_path = log_path


class TransportError(SandboxError):
    """The remote SDK could not get an answer to a request from the Corral server."""

    code = "transport_error"


class ConnectionLost(TransportError):
    """The server cannot be reached, or the connection (or exec stream) to it could not be opened."""

    code = "connection_lost"


class Unauthorized(TransportError):
    """The server refused the request's API key (HTTP 401): send ``Authorization: Bearer KEY``."""

    code = "unauthorized"


class ServerError(TransportError):
    """The server failed on the request without a typed error (HTTP 5xx); its log says why."""

    code = "server_error"


_BY_CODE: dict[str, type[SandboxError]] = {}


def _index(cls: type[SandboxError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _index(sub)


_index(SandboxError)


def error_from_code(code: str, message: str, sandbox_id: str | None = None) -> SandboxError:
    """Rebuild a typed error from its ``code`` (used by the remote SDK)."""
    return _BY_CODE.get(code, SandboxError)(message, sandbox_id=sandbox_id)
