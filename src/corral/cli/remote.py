"""``corral ls``, ``corral exec``, ``corral rm``, ``corral cp``: sandboxes living in a server.

They talk to the server named by ``CORRAL_URL`` (key: ``CORRAL_API_KEY``).
Without a server, ``ls`` lists this host's local registry; the others need one,
since an embedded sandbox lives only as long as the process that made it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path, PurePosixPath
from typing import Any


def register(sub: Any) -> None:
    ls = sub.add_parser("ls", help="list sandboxes (the server's with CORRAL_URL, else this host's)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(handler=handle_ls)

    exe = sub.add_parser("exec", help="run a command in a server sandbox: corral exec ID -- CMD")
    exe.add_argument("id")
    exe.add_argument("--timeout", type=float, default=None, help="seconds")
    exe.add_argument("--json", action="store_true", help="print one JSON object with the result")
    exe.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")
    exe.set_defaults(handler=handle_exec)

    rm = sub.add_parser("rm", help="destroy server sandboxes")
    rm.add_argument("ids", nargs="+", metavar="ID")
    rm.set_defaults(handler=handle_rm)

    cp = sub.add_parser("cp", help="copy files: corral cp LOCAL ID:PATH | corral cp ID:PATH LOCAL")
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.set_defaults(handler=handle_cp)


def _need_server() -> str:
    from ..errors import InvalidSpec

    url = os.environ.get("CORRAL_URL")
    if not url:
        raise InvalidSpec("this command needs a Corral server: set CORRAL_URL (and CORRAL_API_KEY)")
    return url


def handle_ls(args: argparse.Namespace) -> int:
    if os.environ.get("CORRAL_URL"):
        from ..client import Client

        rows = [{"id": s["id"], "state": s["state"], "image": s["spec"]["image"], "tier": s["spec"]["tier"],
                 "expires_at": s["expires_at"]} for s in Client().list()]
    else:
        from .. import parked
        from ..registry import Registry, state_dir

        root = state_dir(args.state_dir)
        rows = [{"id": r.id, "state": "running" if r.owner_alive() else "orphaned", "tier": r.tier,
                 "owner_pid": r.owner_pid} for r in Registry(root).rows()]
        # paused to disk: no row and no owner process (parked.py), listed all the same
        rows += [{"id": p.sandbox_id, "state": "paused", "tier": str(p.spec.get("tier", "")), "owner_pid": None}
                 for p in parked.every(root)]
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:
            print("  ".join("-" if v is None else str(v) for v in row.values()))
    return 0


def _options_before_dashes(args: argparse.Namespace, cmd: list[str]) -> list[str]:
    """The command after ``--``, with exec's own options given between the id and ``--`` taken
    into ``args`` (argparse's REMAINDER took everything after the id: ``corral exec ID --timeout 5
    -- CMD`` ran ``--timeout``).  A command of its own that holds ``--`` is left whole."""
    if "--" not in cmd:
        return cmd
    at = cmd.index("--")
    if at and not cmd[0].startswith("-"):
        return cmd
    options = argparse.ArgumentParser(prog="corral exec ID", add_help=False)
    options.add_argument("--timeout", type=float, default=args.timeout)
    options.add_argument("--json", action="store_true", default=args.json)
    parsed = options.parse_args(cmd[:at])  # (an option exec does not know: argparse's error, exit 2)
    args.timeout, args.json = parsed.timeout, parsed.json
    return cmd[at + 1:]


def handle_exec(args: argparse.Namespace) -> int:
    from ..client import RemoteSandbox
    from ..errors import InvalidSpec
    from .run import EXIT_OOM, EXIT_TIMEOUT

    cmd = _options_before_dashes(args, list(args.cmd))
    if not cmd:
        raise InvalidSpec("no command given: corral exec ID -- CMD [ARGS...]")
    sb = RemoteSandbox.connect(args.id, url=_need_server())
    out, err = sys.stdout.buffer, sys.stderr.buffer

    def stream(name: str, chunk: bytes) -> None:
        target = out if name == "stdout" else err
        target.write(chunk)
        target.flush()

    result = sb.commands.run(cmd, timeout=args.timeout, on_output=None if args.json else stream)
    if args.json:
        print(json.dumps({"sandbox_id": sb.id, **result.to_dict()}))
        return 0
    if result.timed_out:
        return EXIT_TIMEOUT
    if result.oom_killed:
        return EXIT_OOM
    return result.exit_code


def handle_rm(args: argparse.Namespace) -> int:
    from ..client import Client

    client = Client(_need_server())
    for sandbox_id in args.ids:
        client.request("DELETE", f"/v1/sandboxes/{sandbox_id}")
    return 0


def _split(target: str) -> tuple[str | None, str]:
    """``ID:PATH`` -> (ID, PATH); a local path (no colon, or starting with / or .) -> (None, path)."""
    head, sep, tail = target.partition(":")
    if sep and head.startswith("sb-") and "/" not in head:
        return head, tail or "."
    return None, target


def handle_cp(args: argparse.Namespace) -> int:
    from ..client import RemoteSandbox
    from ..errors import InvalidSpec

    (src_id, src), (dst_id, dst) = _split(args.src), _split(args.dst)
    if (src_id is None) == (dst_id is None):
        raise InvalidSpec("cp: exactly one side must be ID:PATH, e.g. corral cp ./in.txt sb-1234:in.txt")
    url = _need_server()
    if dst_id is not None:
        sb = RemoteSandbox.connect(dst_id, url=url)
        local = Path(src)
        if local.is_dir():
            sb.files.upload_dir(local, dst)
        elif local.is_file():
            sb.files.write(dst, local.read_bytes(), local.stat().st_mode & 0o755 | 0o600)
        else:
            raise InvalidSpec(f"cp: {src} does not exist")
        return 0
    assert src_id is not None
    sb = RemoteSandbox.connect(src_id, url=url)
    # as cp -r and docker cp: into an existing directory goes a directory or file of the source's
    # name (a directory's contents were merged into it: a sandbox's .bashrc over the user's own)
    target = Path(dst)
    if target.is_dir():
        target = target / PurePosixPath(src.rstrip("/") or "/").name
    if sb.files.stat(src).type == "dir":
        sb.files.download_dir(src, target)
    else:
        from ..host.download import write_file

        write_file(target, sb.files.read(src, format="bytes"))
    return 0
