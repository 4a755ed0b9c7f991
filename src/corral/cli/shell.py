"""``corral shell``: an interactive shell on a terminal inside a fresh sandbox, destroyed on exit."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from .run import add_spec_arguments, spec_from_args


def register(sub: Any) -> None:
    parser = sub.add_parser("shell", help="interactive shell in a fresh sandbox (destroyed on exit)")
    add_spec_arguments(parser)
    parser.add_argument("--shell", default="/bin/bash", help="shell to run (default /bin/bash, else /bin/sh)")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import termios
    import tty

    from ..sandbox import Sandbox

    spec = spec_from_args(args)
    interactive = sys.stdin.isatty()
    size = os.get_terminal_size(sys.stdout.fileno()) if sys.stdout.isatty() else os.terminal_size((80, 24))
    if size.lines <= 0 or size.columns <= 0:  # a terminal that never had its size set
        size = os.terminal_size((80, 24))
    out = sys.stdout.buffer
    # TERM is the one host variable passed on purpose: it only names the terminal type
    env = {"TERM": os.environ.get("TERM", "xterm-256color"), "PS1": r"sandbox:\w\$ "}

    def write(_stream: str, chunk: bytes) -> None:
        out.write(chunk)
        out.flush()

    with Sandbox.create(spec, state=args.state_dir) as sb:
        shell = args.shell if sb.files.exists(args.shell) else "/bin/sh"
        # a shell session has no per-command timeout of its own: the spec's is a day at most
        handle_ = sb.commands.start([shell, "-i"], env=env, on_output=write, pty=(size.lines, size.columns),
                                    timeout=max(sb.spec.limits.timeout, 86400.0) if interactive else None)
        saved = termios.tcgetattr(sys.stdin.fileno()) if interactive else None
        if interactive:
            tty.setraw(sys.stdin.fileno(), termios.TCSANOW)  # TCSAFLUSH would drop typed-ahead input
            signal.signal(signal.SIGWINCH, lambda *_: handle_.resize(*reversed(os.get_terminal_size())))

        def pump() -> None:
            while True:
                try:
                    data = os.read(sys.stdin.fileno(), 4096)
                except OSError:
                    data = b""
                if not data:
                    handle_.close_stdin()
                    return
                handle_.send_stdin(data)

        threading.Thread(target=pump, daemon=True).start()
        try:
            result = handle_.wait()
        finally:
            if saved is not None:
                termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)
    return result.exit_code
