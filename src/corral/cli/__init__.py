"""The ``corral`` command line.

Each sub-command lives in its own module exposing ``register(subparsers)``;
the module list below is the only place that knows them all, and modules are
imported only to build the parser (their heavy imports stay inside handlers).
"""

from __future__ import annotations

import importlib
import sys

# not typing.TYPE_CHECKING: `corral run`'s fast path imports nothing it does not need
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

#: sub-command -> the module that registers it (in help order)
COMMAND_MODULES = {
    "run": "corral.cli.run",
    "doctor": "corral.cli.doctor",
    "gc": "corral.cli.gc",
    "prepare": "corral.cli.prepare",
    "shell": "corral.cli.shell",
    "image": "corral.cli.image",
    "code": "corral.cli.code",
    "serve": "corral.cli.serve",
    "cluster": "corral.cli.cluster",
    "daemon": "corral.cli.daemon",
    "ls": "corral.cli.remote",
    "exec": "corral.cli.remote",
    "rm": "corral.cli.remote",
    "cp": "corral.cli.remote",
    "mcp": "corral.cli.mcp",
    "snapshot": "corral.cli.snapshot",
}

#: exit code when the sandbox itself could not be made (like `docker run`)
EXIT_SANDBOX_FAILED = 125


def _requested_command(argv: Sequence[str]) -> str | None:
    """The sub-command named on the command line, if it can be told without parsing."""
    args = iter(argv)
    for arg in args:
        if arg == "--state-dir":
            next(args, None)
        elif not arg.startswith("-"):
            return arg
        elif arg in ("-h", "--help") or not arg.startswith("--state-dir="):
            return None
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given ``argv`` naming a known command, only that command's module is imported.

    Importing every sub-command costs tens of milliseconds that ``corral run`` should not pay.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="corral", description="Isolated, ephemeral sandboxes for AI agents.")
    parser.add_argument("--state-dir", help="state directory (default: $CORRAL_STATE_DIR or /var/lib/corral)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = _requested_command(argv) if argv is not None else None
    modules = [COMMAND_MODULES[command]] if command in COMMAND_MODULES else list(COMMAND_MODULES.values())
    for name in dict.fromkeys(modules):
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from .fast_run import try_fast_run

        fast = try_fast_run(argv)  # through a running `corral daemon`, if there is one
        if fast is not None:
            return fast
    import signal  # (after the fast path, which needs none of it)

    from ..errors import SandboxError

    parser = build_parser(argv)
    args = parser.parse_args(argv)
    for stop in (signal.SIGTERM, signal.SIGHUP):  # (`serve` and `daemon` set their own)
        if signal.getsignal(stop) is signal.SIG_DFL:
            signal.signal(stop, _on_stop_signal)
    try:
        code: int = args.handler(args)
        return code
    except SandboxError as exc:
        from ..egress.audit import shown  # (its text may be a sandbox's: a file's name, a guest's error)

        print(f"corral: {shown(str(exc))}", file=sys.stderr)
        return EXIT_SANDBOX_FAILED
    except PermissionError as exc:
        # a user's CLI reading root's state (``image ls`` of the shared image store): a message,
        # not a traceback
        where = f": {exc.filename}" if exc.filename is not None else ""
        print(f"corral: {exc.strerror or 'permission denied'}{where} (Corral's state directory and images "
              "are root's: run as root, or set CORRAL_STATE_DIR to a directory of your own)", file=sys.stderr)
        return EXIT_SANDBOX_FAILED
    except KeyboardInterrupt:
        return 130
    except _Terminated as stopped:
        return 128 + stopped.signum


class _Terminated(BaseException):
    """SIGTERM (``timeout 5 corral run ...``) or SIGHUP (its terminal closed), raised so that the
    sandbox is destroyed on the way out, as on Ctrl-C: killed by the signal's default action, the
    CLI left its run dir, cgroups, registry row and uid range for the next create's janitor or
    ``corral gc``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_stop_signal(signum: int, frame: object) -> None:
    raise _Terminated(signum)


if __name__ == "__main__":
    sys.exit(main())
