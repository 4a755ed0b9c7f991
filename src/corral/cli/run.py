"""``corral run``: create a sandbox, run one command, destroy it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any

EXIT_TIMEOUT = 124
EXIT_OOM = 137
#: 128 + SIGPIPE: what a shell reports for a program whose reader left
EXIT_BROKEN_PIPE = 141


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that define a sandbox; shared by every command that creates one."""
    parser.add_argument("--image", default=None, help="image name (default: host)")
    parser.add_argument("--tier", default=None, help="process | gvisor | microvm | wasm (default: process)")
    parser.add_argument("--workspace", default=None, metavar="DIR[:ro|:rw|:cow]",
                        help="host directory shown at /workspace (default mode rw: changes written back)")
    parser.add_argument("--memory", default=None, metavar="SIZE", help="memory limit, e.g. 512M (default 512M)")
    parser.add_argument("--pids", default=None, metavar="N", help="max processes (default 256)")
    parser.add_argument("--cpus", default=None, metavar="F", help="CPU quota in cores (default 1)")
    parser.add_argument("--disk", default=None, metavar="SIZE", help="writable layer size (default 1G)")
    parser.add_argument("--timeout", default=None, metavar="SECONDS", help="per-command wall clock (default 60)")
    parser.add_argument("--max-output", default=None, metavar="SIZE", help="stdout/stderr kept per command (16M)")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="environment variable (repeatable)")
    parser.add_argument("--network", default=None, choices=("none", "allow", "open"),
                        help="none (default: loopback only), allow (only --allow destinations, through the "
                        "egress proxy), open (own namespace with NAT; SSRF ranges still refused)")
    parser.add_argument("--allow", action="append", default=[], metavar="HOST[:PORT]",
                        help="allow a destination: host, *.domain, IP or CIDR (repeatable; implies --network allow)")
    parser.add_argument("--unsafe-allow-range", action="append", default=[], metavar="CIDR",
                        help="re-enable a range the SSRF defences refuse (loopback, RFC1918, link-local, ...)")
    parser.add_argument("--secret", action="append", default=[], metavar="NAME@HOST[,HOST...]",
                        help="bind secret NAME (value from the environment or --secrets-file) to hosts; "
                        "the sandbox only sees a placeholder")
    parser.add_argument("--secrets-file", default=None, metavar="FILE",
                        help="NAME=VALUE lines to take secret values from (must not be world-readable)")
    parser.add_argument("--user", default=None, choices=("user", "root"),
                        help="run as the sandbox user (uid 1000, default) or as root of the sandbox's own "
                             "user namespace (no host privilege), or of its own guest kernel on the microVM; not wasm")


def spec_from_args(args: argparse.Namespace) -> Any:
    from ..spec import Limits, SandboxSpec, parse_env_assignments
    from ..surface import build_spec

    limits = Limits.build(args.memory, args.pids, args.cpus, args.disk, args.timeout, args.max_output)
    base = SandboxSpec(limits=limits)
    return build_spec(base, image=args.image, tier=args.tier, workspace=args.workspace,
                      env=parse_env_assignments(args.env), network=args.network, allow=args.allow or None,
                      unsafe_allow_ranges=args.unsafe_allow_range or None, secrets=args.secret or None,
                      user=args.user)


def register(sub: Any) -> None:
    parser = sub.add_parser("run", help="run one command in a fresh sandbox",
                            description="Create a sandbox, run CMD in it, destroy it. "
                            "Exit code: the command's; 124 on timeout; 137 on OOM kill; 125 if no sandbox.")
    add_spec_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object with the result")
    parser.add_argument("--audit", action="store_true",
                        help="print every refused destination and withheld secret to stderr afterwards")
    parser.add_argument("--expose", action="append", default=[], type=int, metavar="PORT",
                        help="forward a host port on 127.0.0.1 into PORT on the sandbox's loopback while the "
                        "command runs, whatever the network mode (repeatable); the address goes to stderr "
                        "(and to the JSON as ports)")
    parser.add_argument("--expose-to", action="append", default=[], metavar="USER",
                        help="let this user of the host (name or uid) connect to the --expose ports too; "
                        "by default only the user running corral and root do (repeatable)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from ..errors import InvalidSpec, SandboxClosed
    from ..ports import other_uids
    from ..sandbox import Sandbox

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise InvalidSpec("no command given: corral run [OPTIONS] -- CMD [ARGS...]")
    spec = spec_from_args(args)
    if args.expose_to and not args.expose:
        raise InvalidSpec("--expose-to: it names who may connect to --expose ports; give --expose PORT too")
    expose_to = other_uids(args.expose_to, "--expose-to")  # a user this host lacks: an error before any sandbox
    out, err = sys.stdout.buffer, sys.stderr.buffer
    running: list[Any] = []
    reader_left = threading.Event()

    def stream(name: str, chunk: bytes) -> None:
        if reader_left.is_set():
            return
        target = out if name == "stdout" else err
        try:
            target.write(chunk)
            target.flush()
        except BrokenPipeError:
            # `corral run -- yes | head -1`: the reader left; end the command as SIGPIPE ends a
            # program (it ran on to its timeout here, and said it timed out; the daemon's path
            # and the launcher end at once), and keep the interpreter's exit from writing again
            reader_left.set()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, target.fileno())
            os.close(devnull)
            if running:
                running[0].kill()

    values = None
    if args.secrets_file:
        from ..secrets import read_secrets_file

        values = read_secrets_file(args.secrets_file)
    with Sandbox.create(spec, state=args.state_dir, secret_values=values) as sb:
        ports = getattr(sb, "ports", None)
        if args.expose and ports is None:  # a server's sandbox (CORRAL_URL): its proxy route instead
            raise InvalidSpec(f"--expose: sandbox {sb.id} is a server's; reach its port through "
                              f"/v1/sandboxes/{sb.id}/ports/PORT/ on that server")
        exposed = [ports.expose(port, local_users=expose_to) for port in args.expose] if ports is not None else []
        for port in exposed:  # before the command starts, so a caller can connect as soon as it listens
            print(f"corral: port {port.sandbox_port} exposed at {port.host}:{port.port} ({port.url})",
                  file=sys.stderr, flush=True)
        if args.json:
            result = sb.commands.run(cmd)
        else:
            running.append(sb.commands.start(cmd, on_output=stream))
            # its stdin ends at once, as through the daemon (and as `run` does for --json): the
            # CLI's own stdin is not forwarded, and `echo hi | corral run -- cat` waited out its timeout
            running[0].close_stdin()
            if reader_left.is_set():  # (before the handle was in hand)
                running[0].kill()
            result = running[0].wait()
            if reader_left.is_set():
                return EXIT_BROKEN_PIPE
        events = []
        if args.audit:  # reading the kernel's counters costs a libnftables call: only when asked
            try:
                events = sb.network.audit()
            except SandboxClosed:  # a tier without a network side
                pass
        if args.json:
            payload = {"sandbox_id": sb.id, **result.to_dict()}
            if exposed:
                payload["ports"] = [p.to_dict() for p in exposed]
            if args.audit:
                payload["audit"] = [e.to_dict() for e in events]
            print(json.dumps(payload))
            return 0
        if args.audit:
            for event in events:
                print(f"corral audit: {event}", file=sys.stderr)
    if result.timed_out:
        print(f"corral: command timed out after {result.duration_ms / 1000:.1f} s", file=sys.stderr)
        return EXIT_TIMEOUT
    if result.oom_killed:
        print("corral: command was killed: out of memory", file=sys.stderr)
        return EXIT_OOM
    return result.exit_code
