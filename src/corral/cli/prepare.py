"""``corral prepare``: do each tier's one-time work now, not in a user's first create.

A tier's first sandbox may build things that are then cached: the microVM's
guest kernel, initramfs, image disk and template, the wasm tier's compiled
CPython, an image's layers.  ``corral prepare`` creates one sandbox per tier and
runs one command in it, which takes exactly the path a first create takes (so
nothing can be missed), reports the slow steps as they run (:mod:`corral.progress`)
and prints how long each tier took.  ``make prepare`` runs it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

#: a command every tier's default image can run
SMOKE = {"wasm": ["python", "-c", "pass"]}


def register(sub: Any) -> None:
    parser = sub.add_parser("prepare", help="build what each tier needs ahead of its first sandbox",
                            description="Create one sandbox per tier and run one command in it, so that "
                            "first-use builds (microVM disk and template, wasm compile, images) happen now. "
                            "Exit code 1 if a tier named with --tier is unavailable or fails.")
    parser.add_argument("--tier", action="append", default=[], metavar="TIER",
                        help="a tier to prepare (repeatable; default: every tier this host can run)")
    parser.add_argument("--image", default=None, help="image to prepare for (default: each tier's default)")
    parser.add_argument("--memory", default=None, metavar="SIZE",
                        help="memory limit (the microVM keeps one template per size; default 512M)")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from ..errors import SandboxError
    from ..registry import state_dir
    from ..sandbox import Sandbox
    from ..spec import tier_names
    from ..tiers import tier_class

    root = state_dir(args.state_dir)
    wanted = list(dict.fromkeys(args.tier)) or list(tier_names())
    failed = False
    for tier in wanted:
        try:
            availability = tier_class(tier).probe(root)
        except SandboxError as exc:
            print(f"{tier}: cannot run here: {exc}")
            failed |= bool(args.tier)
            continue
        if not availability.available:
            print(f"{tier}: skipped, not available here: {availability.reason}")
            failed |= bool(args.tier)  # asked for by name: that is a failure
            continue
        start = time.monotonic()
        options = {k: v for k, v in (("image", args.image), ("memory", args.memory)) if v is not None}
        try:
            with Sandbox.create(tier=tier, state=root, **options) as sb:
                result = sb.commands.run(SMOKE.get(tier, ["true"]), timeout=120)
        except SandboxError as exc:
            print(f"{tier}: FAILED after {time.monotonic() - start:.1f} s: {exc}")
            failed = True
            continue
        if result.exit_code != 0:
            print(f"{tier}: FAILED: its first command exited {result.exit_code}: {result.stderr.strip()[-500:]}")
            failed = True
            continue
        print(f"{tier}: ready in {time.monotonic() - start:.1f} s")
    return 1 if failed else 0
