"""``corral serve``: run the sandbox API server (loopback only unless API keys are set)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("serve", help="run the HTTP API server",
                            description="Serve the sandbox API over HTTP. Listens on 127.0.0.1 by default; "
                            "other addresses need API keys (CORRAL_API_KEYS=tenant=KEY,... or --api-keys-file).")
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default 7333; 0 picks a free one)")
    parser.add_argument("--config", default=None, metavar="FILE", help="JSON config (quotas, lifetimes, pools)")
    parser.add_argument("--api-keys-file", default=None, metavar="FILE",
                        help="lines of tenant=KEY or tenant=sha256:HEX")
    parser.add_argument("--max-sandboxes", type=int, default=None, help="live sandboxes per tenant (default 32)")
    parser.add_argument("--max-memory", default=None, help="total memory limit per tenant (default 16G)")
    parser.add_argument("--idle-timeout", type=float, default=None, help="seconds unused before destroy (600)")
    parser.add_argument("--max-lifetime", type=float, default=None, help="seconds any sandbox may live (3600)")
    parser.add_argument("--max-concurrent-execs", type=int, default=None, help="commands at once per sandbox (8)")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="open client connections before 503 (16384)")
    parser.add_argument("--pool", action="append", default=[], metavar="MIN:MAX[:SPEC-JSON]",
                        help="a warm pool (repeatable); SPEC-JSON as the POST /v1/sandboxes body")
    parser.add_argument("--cluster", default=None, metavar="ADDRESS",
                        help="hold the sandboxes on the nodes of this Ray cluster (docs/cluster.md)")
    parser.add_argument("--local-user", action="append", default=[], metavar="USER",
                        help="without API keys: a user of this host (name or uid) served besides this "
                             "process's user and root (repeatable)")
    parser.add_argument("--allow", action="append", default=None, metavar="DEST",
                        help="a destination tenants' sandboxes may be given (HOST, *.DOMAIN, IP, CIDR, optional "
                             ":PORT; repeatable): their allow must lie within these (default: any public one)")
    parser.add_argument("--no-network", action="store_true", help="tenants' sandboxes get no network at all")
    parser.add_argument("--log-level", default="warning")
    parser.set_defaults(handler=handle)


def parse_pool(text: str) -> dict[str, Any]:
    import json

    from ..errors import InvalidSpec

    parts = text.split(":", 2)
    try:
        entry: dict[str, Any] = {"min_idle": int(parts[0]), "max_idle": int(parts[1]) if len(parts) > 1 else None}
        entry["spec"] = json.loads(parts[2]) if len(parts) > 2 else {}
    except ValueError as exc:
        raise InvalidSpec(f"--pool {text!r}: expected MIN:MAX[:SPEC-JSON] ({exc})") from None
    return entry


def handle(args: argparse.Namespace) -> int:
    from ..errors import InvalidSpec
    from ..server import ServerConfig, serve

    config = ServerConfig.load(
        args.config, args.api_keys_file, host=args.host, port=args.port,
        max_sandboxes_per_tenant=args.max_sandboxes, max_memory_per_tenant=args.max_memory,
        idle_timeout=args.idle_timeout, max_lifetime=args.max_lifetime,
        max_concurrent_execs=args.max_concurrent_execs, max_connections=args.max_connections,
        state_dir=args.state_dir, cluster=args.cluster, local_users=args.local_user or None,
        allow=[] if args.no_network else args.allow,
    )
    if args.no_network and args.allow:
        raise InvalidSpec("--no-network and --allow: give one of them")
    if args.pool:
        config.pools = [*config.pools, *(parse_pool(p) for p in args.pool)]
    if config.cluster is not None:  # join now, in the main thread, and fail before listening if it cannot
        from ..cluster.transport import ClusterTransport

        ClusterTransport.shared(config.cluster)
    def announce(port: int) -> None:
        host = f"[{config.host}]" if ":" in config.host else config.host
        print(f"corral: serving on http://{host}:{port} "
              f"({'API keys required' if config.auth_required else 'no API keys: loopback, this user and root only'})"
              + (f", sandboxes on the Ray cluster {config.cluster}" if config.cluster else ""), file=sys.stderr,
              flush=True)

    serve(config, args.log_level, announce)
    return 0
