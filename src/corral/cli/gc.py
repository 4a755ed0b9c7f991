"""``corral gc``: reap sandboxes whose owner died."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("gc", help="reap what dead owners left behind")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from ..registry import gc, state_dir

    reaped = gc(state_dir(args.state_dir))
    print(f"reaped {len(reaped)} sandbox(es)" + (": " + ", ".join(reaped) if reaped else ""))
    return 0
