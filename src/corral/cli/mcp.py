"""``corral mcp``, the command: runs the MCP server (:mod:`corral.mcp_server`) over stdio (or streamable
HTTP on loopback)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("mcp", help="serve the Model Context Protocol (stdio by default)",
                            description="Sandboxes as MCP tools. Sandboxes of a session are destroyed when it ends. "
                            "With CORRAL_URL set, sandboxes live in that server.")
    parser.add_argument("--http", action="store_true", help="streamable HTTP on loopback instead of stdio")
    parser.add_argument("--port", type=int, default=7334, help="port for --http (default 7334)")
    parser.add_argument("--session-idle-timeout", type=float, default=30 * 60.0, metavar="SECONDS",
                        help="--http: end a session (and destroy its sandboxes) after this long idle, counted from the end "
                        "of its last request (one in flight keeps it; default 1800)")
    bounds = parser.add_argument_group("what the model may ask for (each create_sandbox and run_command is checked)")
    bounds.add_argument("--max-memory", metavar="SIZE", help="one sandbox's memory at most (default 4G)")
    bounds.add_argument("--max-total-memory", metavar="SIZE",
                        help="all sandboxes' memory limits together at most (default half the host's, at most 16G)")
    bounds.add_argument("--max-cpus", type=float, metavar="N", help="one sandbox's CPUs at most (default the host's)")
    bounds.add_argument("--max-timeout", type=float, metavar="SECONDS",
                        help="a command's timeout at most (default 3600)")
    bounds.add_argument("--max-lifetime", type=float, metavar="SECONDS",
                        help="a sandbox is destroyed this long after it is made, whatever it runs (default 3600)")
    bounds.add_argument("--allow", action="append", default=[], metavar="DEST",
                        help="a destination sandboxes may be allowed (HOST, *.DOMAIN, IP or CIDR, optional :PORT; "
                        "repeat it); the model's allow must stay within these. Default: none, no network")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import os

    from ..mcp_limits import McpLimits
    from ..mcp_server import main
    from ..spec import parse_size

    if args.state_dir:
        os.environ["CORRAL_STATE_DIR"] = args.state_dir
    if not args.session_idle_timeout > 0:
        from ..errors import InvalidSpec

        raise InvalidSpec(f"--session-idle-timeout: {args.session_idle_timeout!r} must be seconds > 0")
    limits = McpLimits.build(
        max_memory=parse_size(args.max_memory, "--max-memory") if args.max_memory is not None else None,
        max_total_memory=(parse_size(args.max_total_memory, "--max-total-memory")
                          if args.max_total_memory is not None else None),
        max_cpus=args.max_cpus, max_timeout=args.max_timeout, allow=args.allow, max_lifetime=args.max_lifetime)
    main("http" if args.http else "stdio", port=args.port, session_idle_timeout=args.session_idle_timeout,
         limits=limits)
    return 0
