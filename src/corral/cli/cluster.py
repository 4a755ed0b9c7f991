"""``corral cluster up|down|status``: the host actors of a Ray cluster's nodes (docs/cluster.md)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("cluster", help="start, stop or show the Corral hosts of a Ray cluster",
                            description="Every node started with --resources '{\"corral_slots\": N}' gets one "
                            "host actor that owns its sandboxes (at most N at once).")
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--address", default="auto", help="the Ray cluster (what ray.init(address=...) takes)")
    parser.add_argument("--pool", action="append", default=[], metavar="MIN:MAX[:SPEC-JSON]",
                        help="a warm pool on every node (repeatable), as corral serve --pool")
    parser.add_argument("--janitor-interval", type=float, default=2.0,
                        help="seconds between janitor runs on each node (default 2)")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from ..cluster.node.actor import down, start_hosts
    from ..cluster.nodes import NAMESPACE, host_name, join, slot_nodes
    from .serve import parse_pool

    if args.action == "down":
        print(f"destroyed {down(args.address)} sandbox(es); hosts ended")
        return 0
    ray = join(args.address)
    if args.action == "up":
        hosts = start_hosts(ray, state=args.state_dir, pools=[parse_pool(p) for p in args.pool] or None,
                            janitor_interval=args.janitor_interval)
        print(f"{len(hosts)} host(s) up")
    for node in slot_nodes(ray):
        try:
            actor = ray.get_actor(host_name(node.node_id), namespace=NAMESPACE)
            load = ray.get(actor.load.remote(), timeout=10)
        except Exception as exc:  # a node without a host (yet) is shown as such
            load = {"node_id": node.node_id, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({"address": node.address, **load}))
    return 0
