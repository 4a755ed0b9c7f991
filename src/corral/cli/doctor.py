"""``corral doctor``, the command: prints the host checks (:mod:`corral.host_checks`) and the tier probes."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("doctor", help="check what this host supports")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from ..host_checks import host_checks
    from ..registry import state_dir
    from ..tiers import probe_all

    checks = host_checks()
    tiers = probe_all(state_dir(args.state_dir))
    if args.json:
        print(json.dumps({"host": [c.__dict__ for c in checks], "tiers": [t.__dict__ for t in tiers]}, indent=2))
    else:
        for c in checks:
            print(f"{'ok ' if c.ok else 'NO '} {c.name:<16} {c.detail}" + (f"\n     fix: {c.fix}" if not c.ok else ""))
        print()
        for t in tiers:
            print(f"{'ok ' if t.available else 'NO '} tier {t.tier:<11} {t.reason}"
                  + (f"\n     fix: {t.fix}" if not t.available and t.fix else ""))
    return 0 if all(c.ok for c in checks if c.name not in ("landlock", "workspace watch")) else 1
