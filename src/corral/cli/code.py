"""``corral code``: run Python from a file or stdin in a fresh sandbox's interpreter."""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path
from typing import Any

from .run import add_spec_arguments, spec_from_args


def register(sub: Any) -> None:
    parser = sub.add_parser("code", help="run code in a sandbox's code interpreter (rich results)",
                            description="Run FILE (or stdin) as one cell of a stateful interpreter in a fresh "
                            "sandbox. Exit code 1 if the cell raised, 124 if it timed out.")
    add_spec_arguments(parser)
    parser.add_argument("--language", default="python", help="interpreter language (default: python)")
    parser.add_argument("--cell-timeout", type=float, default=None, metavar="SECONDS",
                        help="interrupt the cell after this long (default 60)")
    parser.add_argument("--json", action="store_true", help="print the Execution as one JSON object")
    parser.add_argument("--save-images", metavar="DIR", default=None,
                        help="write PNG/JPEG results to DIR as result-N.png")
    parser.add_argument("file", nargs="?", default="-", help="source file, or - for stdin (default)")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from ..errors import InvalidSpec
    from ..sandbox import Sandbox

    if args.file == "-":
        code = sys.stdin.read()
    else:
        try:
            code = Path(args.file).read_text()
        except OSError as exc:
            raise InvalidSpec(f"cannot read {args.file}: {exc}")
    spec = spec_from_args(args)
    stream = not args.json
    with Sandbox.create(spec, state=args.state_dir) as sb:
        execution = sb.run_code(
            code, language=args.language, timeout=args.cell_timeout,
            on_stdout=(lambda text: sys.stdout.write(text)) if stream else None,
            on_stderr=(lambda text: sys.stderr.write(text)) if stream else None,
        )
    if args.save_images:
        out = Path(args.save_images)
        out.mkdir(parents=True, exist_ok=True)
        for index, result in enumerate(execution.results):
            for fmt in ("png", "jpeg"):
                data = getattr(result, fmt)
                if data:
                    path = out / f"result-{index}.{fmt}"
                    path.write_bytes(base64.b64decode(data))
                    print(f"corral: wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(execution.to_dict()))
    else:
        for result in execution.results:
            kinds = ", ".join(result.formats())
            if result.is_main_result and result.text is not None:
                print(result.text)
            else:
                print(f"[result: {kinds}]" + (f" {result.text}" if result.text else ""))
        if execution.error is not None:
            print(execution.error.traceback or f"{execution.error.name}: {execution.error.value}",
                  file=sys.stderr, end="" if execution.error.traceback.endswith("\n") else "\n")
            if execution.timed_out or execution.restarted:
                print(f"corral: {execution.error.value}", file=sys.stderr)
    if execution.timed_out:
        return 124
    return 1 if execution.error is not None else 0
