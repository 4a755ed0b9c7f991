"""Commands inside a sandbox: ``sandbox.commands.run/start`` and the handle of a running one.

Split from :mod:`corral.sandbox` (which re-exports both classes): a command's request is built
and validated here, then handed to the tier; background commands are tracked here by pid.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

from .errors import ExecTimeout, InvalidSpec, OutOfMemory, host_errors
from .images import SANDBOX_HOME, SANDBOX_USER
from .secrets import StreamRedactor
from .spec import validate_env, validate_sandbox_path, validate_user
from .surface import output_callback
from .tiers import tier_class
from .tiers.base import ExecRequest, ExecResult, Process

if TYPE_CHECKING:
    from .sandbox import Sandbox

BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": SANDBOX_HOME,
    "USER": SANDBOX_USER,
    "LOGNAME": SANDBOX_USER,
    "LANG": "C.UTF-8",
    "SHELL": "/bin/sh",
}
#: what differs for a command run as root
ROOT_ENV = {"HOME": "/root", "USER": "root", "LOGNAME": "root"}




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


class CommandHandle:
    """A command started with ``commands.start``: feed stdin, signal, wait for the result."""

    def __init__(self, process: Process, redact: Callable[[str], str] | None = None,
                 stream: StreamRedactor | None = None, sandbox_id: str | None = None) -> None:
        self._process = process
        self._redact = redact
        self._stream = stream
        self._sandbox_id = sandbox_id

    def send_stdin(self, data: str | bytes) -> None:
        self._process.write_stdin(data.encode() if isinstance(data, str) else data)

    def close_stdin(self) -> None:
        self._process.close_stdin()

    def send_signal(self, signum: int) -> None:
        self._process.send_signal(signum)

    def kill(self) -> None:
        self._process.kill()

    def resize(self, rows: int, cols: int) -> None:
        self._process.resize(rows, cols)

    @property
    def pid(self) -> int | None:
        """The command's pid inside the sandbox once it started (None until then; 0 in the wasm tier)."""
        return self._process.pid

    @property
    def done(self) -> bool:
        """True once the command has ended; never blocks."""
        return self._process.done

    def wait(self) -> ExecResult:
        with host_errors("wait for a command", self._sandbox_id):
            result = self._process.wait()
        if self._stream is not None:
            self._stream.flush()
        if self._redact is not None:
            result.stdout = self._redact(result.stdout)
            result.stderr = self._redact(result.stderr)
        return result


@dataclass(frozen=True)
class CommandInfo:
    """A command still running in a sandbox (``commands.list()``)."""

    pid: int
    argv: list[str]
    cwd: str

    def to_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "argv": list(self.argv), "cwd": self.cwd}


#: how long ``run(background=True)`` waits for the command to exist, so its pid is known
BACKGROUND_START_TIMEOUT = 10.0


class Commands:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox
        self._lock = threading.Lock()
        #: every command started and not yet seen to end, with its request (for list/connect/kill by pid)
        self._started: list[tuple[CommandHandle, ExecRequest]] = []

    def _track(self, handle: CommandHandle, request: ExecRequest) -> CommandHandle:
        with self._lock:
            self._started = [(h, r) for h, r in self._started if not h.done]
            self._started.append((handle, request))
        return handle

    def list(self) -> list[CommandInfo]:
        """The commands running now (started with ``start`` or ``run(background=True)``), by pid."""
        with self._lock:
            self._started = [(h, r) for h, r in self._started if not h.done]
            return [CommandInfo(h.pid, list(r.argv), r.cwd) for h, r in self._started if h.pid is not None]

    def connect(self, pid: int) -> CommandHandle:
        """The handle of the running command with this pid (as ``start`` returned it)."""
        with self._lock:
            for handle, _ in self._started:
                if handle.pid == pid and not handle.done:
                    return handle
        raise InvalidSpec(f"sandbox {self._sb.id} has no running command with pid {pid}")

    def kill(self, pid: int) -> bool:
        """Kill the running command with this pid (its whole tree); False if none runs."""
        try:
            handle = self.connect(pid)
        except InvalidSpec:
            return False
        handle.kill()
        return True

    def send_stdin(self, pid: int, data: str | bytes) -> None:
        """Write to the stdin of the running command with this pid."""
        self.connect(pid).send_stdin(data)

    def _request(self, cmd: str | Sequence[str], timeout: float | None, env: Mapping[str, str] | None,
                 cwd: str | None, pty: tuple[int, int] | None = None, user: str | None = None) -> ExecRequest:
        if pty is not None and not (len(pty) == 2 and all(isinstance(n, int) and 0 < n < 10000 for n in pty)):
            raise InvalidSpec(f"pty: expected (rows, cols) of positive whole numbers, got {pty!r}")
        capabilities = tier_class(self._sb.spec.tier).capabilities
        if pty is not None and not capabilities.pty:
            raise InvalidSpec(f"pty: the {self._sb.spec.tier} tier cannot run commands on a terminal")
        if user is not None:
            capabilities.check_user(validate_user(user), self._sb.spec.tier)
        limits = self._sb.spec.limits
        if timeout is not None and (not isinstance(timeout, (int, float)) or not 0 < timeout <= 7 * 86400):
            raise InvalidSpec(f"timeout: {timeout!r} must be seconds in (0, 604800]")
        as_root = (user or self._sb.spec.user) == "root"
        merged = {**BASE_ENV, **(ROOT_ENV if as_root else {}), **self._sb.spec.env, **validate_env(env)}
        return ExecRequest(
            argv=_argv(cmd),
            env=merged,
            cwd=validate_sandbox_path(cwd or self._sb.cwd, "cwd"),
            timeout=float(timeout if timeout is not None else limits.timeout),
            max_output=limits.max_output,
            pty=tuple(pty) if pty is not None else None,  # type: ignore[arg-type]
            user=user,
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
        pty: tuple[int, int] | None = None,
        user: str | None = None,
    ) -> CommandHandle:
        """Start a command; output reaches the callbacks as it is produced (on a reader thread).

        With ``pty=(rows, cols)`` it runs on a terminal: output arrives as stdout only.
        ``user="root"`` runs it as root of the sandbox's own user namespace (tiers that offer
        it), ``user="user"`` as the unprivileged sandbox user; None: the sandbox's ``user``.
        """
        request = self._request(cmd, timeout, env, cwd, pty, user)
        callback = output_callback(on_stdout, on_stderr, on_output)
        inner = self._sb._tier_sandbox()
        network = inner.network
        with host_errors("start a command", self._sb.id):
            if network is not None and network.secrets:
                stream = StreamRedactor(network.redactor, callback) if callback is not None else None
                return self._track(CommandHandle(inner.start(request, stream.feed if stream else None),
                                                 network.redact_text, stream, self._sb.id), request)
            return self._track(CommandHandle(inner.start(request, callback), sandbox_id=self._sb.id), request)

    @overload
    def run(self, cmd: str | Sequence[str], *, timeout: float | None = ..., env: Mapping[str, str] | None = ...,
            cwd: str | None = ..., stdin: str | bytes | None = ..., on_stdout: Callable[[str], None] | None = ...,
            on_stderr: Callable[[str], None] | None = ..., on_output: Callable[[str, bytes], None] | None = ...,
            check: bool = ..., background: Literal[False] = ..., user: str | None = ...) -> ExecResult: ...

    @overload
    def run(self, cmd: str | Sequence[str], *, timeout: float | None = ..., env: Mapping[str, str] | None = ...,
            cwd: str | None = ..., stdin: str | bytes | None = ..., on_stdout: Callable[[str], None] | None = ...,
            on_stderr: Callable[[str], None] | None = ..., on_output: Callable[[str, bytes], None] | None = ...,
            check: bool = ..., background: Literal[True], user: str | None = ...) -> CommandHandle: ...

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
        background: bool = False,
        user: str | None = None,
    ) -> ExecResult | CommandHandle:
        """Run a command to completion. A shell string runs under ``/bin/sh -c``.

        Timeouts and OOM kills come back in the result (``timed_out``,
        ``oom_killed``); with ``check=True`` they raise ExecTimeout/OutOfMemory.
        With ``background=True`` it returns the running command's handle at once, its ``pid``
        known and its stdin open (``commands.list/connect/kill/send_stdin`` find it by pid).
        """
        handle = self.start(cmd, timeout=timeout, env=env, cwd=cwd, on_stdout=on_stdout,
                            on_stderr=on_stderr, on_output=on_output, user=user)
        if stdin is not None:
            handle.send_stdin(stdin)
        if background:
            deadline = time.monotonic() + BACKGROUND_START_TIMEOUT
            while handle.pid is None and not handle.done and time.monotonic() < deadline:
                time.sleep(0.0005)
            return handle
        handle.close_stdin()
        result = handle.wait()
        if check:
            if result.timed_out:
                raise ExecTimeout(f"command timed out after {result.duration_ms:.0f} ms", result, sandbox_id=self._sb.id)
            if result.oom_killed:
                raise OutOfMemory("command was killed by the sandbox's memory limit", result, sandbox_id=self._sb.id)
        return result
