"""Commands inside a sandbox: ``sandbox.commands.run/start`` and the handle of a running one.

One class for every transport (see :mod:`corral.transport`): a command's arguments are
checked here, then carried by the sandbox's transport.  Background commands are found again
by pid (``list``, ``connect``, ``kill``, ``send_stdin``), in this process or in a server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

from .errors import ExecTimeout, InvalidSpec, OutOfMemory
from .images import SANDBOX_HOME, SANDBOX_USER
from .spec import validate_argv, validate_env, validate_sandbox_path, validate_user
from .surface import output_callback
from .tiers.base import ExecResult
from .transport import CommandCall, CommandProcess, OutputCallback

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
#: the longest timeout a command may ask for
MAX_TIMEOUT = 7 * 86400
#: what differs for a command run as root
ROOT_ENV = {"HOME": "/root", "USER": "root", "LOGNAME": "root"}


def argv_of(cmd: str | Sequence[str]) -> list[str]:
    """The argv of a command: a shell string runs under ``/bin/sh -c``."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidSpec("command is empty")
        # an argv string ends at its first NUL: "echo a\0; rm x" would run as "echo a", a command
        # other than the one asked for (and checked, logged or approved by the caller)
        if "\0" in cmd:
            raise InvalidSpec(f"command: a shell string cannot contain a NUL byte (one at index {cmd.index(chr(0))})")
        return validate_argv(["/bin/sh", "-c", cmd])
    argv = list(cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidSpec("command must be a shell string or a non-empty list of strings")
    for number, arg in enumerate(argv):
        if "\0" in arg:
            raise InvalidSpec(f"command: argument {number} contains a NUL byte (an argument ends at its first NUL)")
    return validate_argv(argv)


def check_call(cmd: str | Sequence[str], timeout: float | None, env: Mapping[str, str] | None, cwd: str | None,
               pty: tuple[int, int] | None = None, user: str | None = None) -> CommandCall:
    """A command's arguments, checked the same way whichever transport carries them."""
    argv_of(cmd)
    if pty is not None and not (isinstance(pty, (tuple, list)) and len(pty) == 2
                                and all(isinstance(n, int) and 0 < n < 10000 for n in pty)):
        raise InvalidSpec(f"pty: expected (rows, cols) of positive whole numbers, got {pty!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout <= MAX_TIMEOUT):
        raise InvalidSpec(f"timeout: {timeout!r} must be seconds in (0, {MAX_TIMEOUT}]")
    return CommandCall(cmd if isinstance(cmd, str) else list(cmd), timeout,
                       validate_env(env) if env is not None else None,
                       validate_sandbox_path(cwd, "cwd") if cwd is not None else None,
                       (int(pty[0]), int(pty[1])) if pty is not None else None,
                       validate_user(user) if user is not None else None)


class CommandHandle:
    """A running command (``commands.start``, ``run(background=True)``, ``commands.connect``):
    feed stdin, signal, wait for the result."""

    def __init__(self, process: CommandProcess, sandbox_id: str | None = None) -> None:
        self._process = process
        self._sandbox_id = sandbox_id

    def send_stdin(self, data: str | bytes) -> None:
        self._process.write_stdin(data.encode() if isinstance(data, str) else bytes(data))

    def close_stdin(self) -> None:
        self._process.close_stdin()

    def send_signal(self, signum: int) -> None:
        self._process.send_signal(signum)

    def signals_delivered(self, timeout: float) -> bool:
        """True once every signal sent has reached the command (or it ended), waiting up to ``timeout`` s.
        Embedded, the sandbox's agent says when it delivered one (it shares the sandbox's CPU quota:
        seconds late under a fork bomb); through a server or a cluster, and on tiers that signal
        the command directly, it is True at once."""
        return self._process.signals_delivered(timeout)

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

    def wait(self, on_output: OutputCallback | None = None) -> ExecResult:
        """Its result, once it ended.  ``on_output(stream, chunk)`` also gets what it printed, from
        its start (for a handle found by pid, which was started without callbacks)."""
        return self._process.wait(on_output)


@dataclass(frozen=True)
class CommandInfo:
    """A command still running in a sandbox (``commands.list()``)."""

    pid: int
    argv: list[str]
    cwd: str

    def to_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "argv": list(self.argv), "cwd": self.cwd}


class Commands:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def list(self) -> list[CommandInfo]:
        """The commands running now (started with ``start`` or ``run(background=True)``), by pid."""
        return self._sb._backend.commands()

    def connect(self, pid: int) -> CommandHandle:
        """A handle of the running command with this pid (InvalidSpec if none runs)."""
        return CommandHandle(self._sb._backend.command(pid), self._sb.id)

    def kill(self, pid: int) -> bool:
        """Kill the running command with this pid (its whole tree); False if none runs."""
        return self._sb._backend.kill_command(pid)

    def send_stdin(self, pid: int, data: str | bytes) -> None:
        """Write to the stdin of the running command with this pid."""
        self.connect(pid).send_stdin(data)

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
        call = check_call(cmd, timeout, env, cwd or self._sb.cwd, pty, user)
        callback = output_callback(on_stdout, on_stderr, on_output)
        return CommandHandle(self._sb._backend.start(call, callback), self._sb.id)

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
        call = check_call(cmd, timeout, env, cwd or self._sb.cwd, user=user)
        callback = output_callback(on_stdout, on_stderr, on_output)
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin) if stdin is not None else None
        backend = self._sb._backend
        if background:
            return CommandHandle(backend.start_background(call, data, callback), self._sb.id)
        result = backend.run(call, data, callback)
        if check:
            if result.timed_out:
                raise ExecTimeout(f"command timed out after {result.duration_ms:.0f} ms", result, sandbox_id=self._sb.id)
            if result.oom_killed:
                raise OutOfMemory("command was killed by the sandbox's memory limit", result, sandbox_id=self._sb.id)
        return result
