"""``corral gc``: reap sandboxes whose owner died, and what killed image builds left."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("gc", help="reap what dead owners left behind")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from ..images import store
    from ..registry import gc, state_dir

    reaped = gc(state_dir(args.state_dir))
    print(f"reaped {len(reaped)} sandbox(es)" + (": " + ", ".join(reaped) if reaped else ""))
    # host-wide, not one state dir's: what killed image builds left (a build also removes these)
    builds = store.remove_leftovers(store.image_dir(), min_age=store.STALE_BUILD_AGE)
    if builds:
        print(f"removed {builds} stale image build director{'y' if builds == 1 else 'ies'}")
    return 0
