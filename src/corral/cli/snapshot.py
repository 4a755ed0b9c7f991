"""``corral snapshot ls`` and ``corral snapshot rm ID...``: stored snapshots (:mod:`corral.snapshots`).

With ``CORRAL_URL`` set they are the server's (yours, by ``CORRAL_API_KEY``); else this host's
state directory's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("snapshot", help="list and remove snapshots (ls, rm)",
                            description="Snapshots taken with sb.snapshot() or sb.fork().")
    ssub = parser.add_subparsers(dest="snapshot_command", required=True)
    ls = ssub.add_parser("ls", help="list snapshots (id, kind, tier, image, size, age, sandbox)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(handler=handle_ls)
    rm = ssub.add_parser("rm", help="remove snapshots")
    rm.add_argument("ids", nargs="+", metavar="ID")
    rm.set_defaults(handler=handle_rm)


def _where(args: argparse.Namespace) -> dict[str, Any]:
    return {"url": os.environ["CORRAL_URL"]} if os.environ.get("CORRAL_URL") else {"state": args.state_dir}


def handle_ls(args: argparse.Namespace) -> int:
    from ..sandbox import Sandbox

    snapshots = Sandbox.list_snapshots(**_where(args))
    if args.json:
        print(json.dumps([s.to_dict() for s in snapshots]))
        return 0
    now = time.time()
    for s in snapshots:
        print(f"{s.id}  {s.kind}  {s.tier}  {s.image}  {s.size}  {int(now - s.created)}s  {s.sandbox_id}")
    return 0


def handle_rm(args: argparse.Namespace) -> int:
    from ..sandbox import Sandbox

    missing = 0
    for snapshot_id in args.ids:
        if Sandbox.delete_snapshot(snapshot_id, **_where(args)):
            print(snapshot_id)
        else:
            print(f"no snapshot {snapshot_id}")
            missing += 1
    return 1 if missing else 0
