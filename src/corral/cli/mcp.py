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
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import os

    from ..mcp_server import main

    if args.state_dir:
        os.environ["CORRAL_STATE_DIR"] = args.state_dir
    if not args.session_idle_timeout > 0:
        from ..errors import InvalidSpec

        raise InvalidSpec(f"--session-idle-timeout: {args.session_idle_timeout!r} must be seconds > 0")
    main("http" if args.http else "stdio", port=args.port, session_idle_timeout=args.session_idle_timeout)
    return 0
