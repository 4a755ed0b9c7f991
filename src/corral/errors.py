"""Corral's exception tree.

Every error Corral raises on purpose is a :class:`SandboxError`, so callers
can catch one class.  The tree::

    SandboxError
    ├── InvalidSpec            a spec, a limit or an argument is wrong
    ├── HostNotSupported       this host cannot run the requested tier
    ├── SandboxNotFound        no live sandbox with that id (or not yours)
    ├── SandboxClosed          the sandbox was destroyed or died
    ├── ExecError              a command could not run to an outcome
    │   ├── ExecTimeout        a command hit its wall-clock timeout
    │   ├── OutOfMemory        a command was killed by the memory limit
    │   └── ContainmentFailed  a process could not be put under the sandbox's limits; it never ran
    ├── ResourceLimit          a quota or limit refused the request
    ├── FileError              a files-API operation failed
    │   └── FileNotFoundInSandbox
    ├── NetworkDenied          egress policy refused a destination
    └── ImageBuildFailed       an image recipe step failed (names the step and its log)

An :class:`ExecResult` is returned, not raised, for timeouts and OOM kills
from ``commands.run``; the exceptions exist for callers that ask for them
(``check=True``) and for the remote SDK to map HTTP errors back.
"""

from __future__ import annotations

from typing import Any


class SandboxError(Exception):
    """Base class of every error Corral raises on purpose."""

    #: short machine-readable name, used by the server and the CLI's JSON output
    code = "sandbox_error"

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


class SandboxNotFound(SandboxError, LookupError):
    """No live sandbox has this id, or it belongs to someone else (the two are not told apart)."""

    code = "not_found"


class SandboxClosed(SandboxError):
    """The sandbox was destroyed, or its processes died, before the operation could run."""

    code = "sandbox_closed"


class ExecError(SandboxError):
    """A command did not reach a normal outcome; carries the partial result when there is one."""

    code = "exec_error"

    def __init__(self, message: str, result: Any = None) -> None:
        super().__init__(message)
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


class FileError(SandboxError, OSError):
    """A files-API operation failed inside the sandbox; ``errno`` is the in-sandbox error number."""

    code = "file_error"

    def __init__(self, message: str, errno_: int = 0) -> None:
        SandboxError.__init__(self, message)
        self.errno = errno_


class FileNotFoundInSandbox(FileError, FileNotFoundError):
    """The path does not exist inside the sandbox."""

    code = "file_not_found"


class NetworkDenied(SandboxError):
    """The sandbox's network policy refused a destination."""

    code = "network_denied"


class ImageBuildFailed(SandboxError):
    """A step of an image build failed; nothing of the half-built image is kept.

    ``step`` names the step, ``log_path`` is the kept log of that step (host path).
    """

    code = "image_build_failed"

    def __init__(self, message: str, step: str = "", log_path: str = "") -> None:
        super().__init__(message)
        self.step = step
        self.log_path = log_path


_BY_CODE: dict[str, type[SandboxError]] = {}


def _index(cls: type[SandboxError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _index(sub)


_index(SandboxError)


def error_from_code(code: str, message: str) -> SandboxError:
    """Rebuild a typed error from its ``code`` (used by the remote SDK)."""
    cls = _BY_CODE.get(code, SandboxError)
    if issubclass(cls, FileError):
        return cls(message)
    return cls(message)
