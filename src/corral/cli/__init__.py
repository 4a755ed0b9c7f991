"""The ``corral`` command line.

Each sub-command lives in its own module exposing ``register(subparsers)``;
the module list below is the only place that knows them all, and modules are
imported only to build the parser (their heavy imports stay inside handlers).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMAND_MODULES = [
    "corral.cli.run",
    "corral.cli.doctor",
    "corral.cli.gc",
    "corral.cli.shell",
    "corral.cli.image",
    "corral.cli.code",
    "corral.cli.serve",
    "corral.cli.remote",
    "corral.cli.mcp",
]

#: exit code when the sandbox itself could not be made (like `docker run`)
EXIT_SANDBOX_FAILED = 125


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corral", description="Isolated, ephemeral sandboxes for AI agents.")
    parser.add_argument("--state-dir", help="state directory (default: $CORRAL_STATE_DIR or /var/lib/corral)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ..errors import SandboxError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
        return code
    except SandboxError as exc:
        print(f"corral: {exc}", file=sys.stderr)
        return EXIT_SANDBOX_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
