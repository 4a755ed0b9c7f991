"""``corral image build|ls|rm|prune``: manage built images."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("image", help="build and manage images (build, ls, rm, prune)",
                            description="Images are read-only root filesystems built from TOML recipes.")
    isub = parser.add_subparsers(dest="image_command", required=True, metavar="SUBCOMMAND")
    build = isub.add_parser("build", help="build an image from a built-in recipe name or a RECIPE.toml")
    build.add_argument("recipe", metavar="NAME|RECIPE.toml")
    build.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    build.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    build.set_defaults(handler=handle_build)
    ls = isub.add_parser("ls", help="list built images (name, digest, size, age)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=handle_ls)
    rm = isub.add_parser("rm", help="remove a name (and its image when nothing else names it)")
    rm.add_argument("names", nargs="+", metavar="NAME|DIGEST")
    rm.set_defaults(handler=handle_rm)
    prune = isub.add_parser("prune", help="delete unnamed images and leftovers of interrupted builds")
    prune.set_defaults(handler=handle_prune)


def _state(args: argparse.Namespace) -> Any:
    from ..registry import state_dir

    return state_dir(args.state_dir)


def handle_build(args: argparse.Namespace) -> int:
    from ..images import recipe as recipes
    from ..images import store

    recipe = recipes.load(args.recipe)
    if not args.force and not recipe.base_image:  # the common no-change case: no build machinery imported
        rec = store.record(store.image_dir(), recipe.digest())
        if rec is not None:
            store.set_name(store.image_dir(), recipe.name, rec.digest)
            print(f"{recipe.name} up to date: {rec.digest[:19]} {_size(rec.size)} {rec.packages} packages")
            return 0

    import signal

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C: no half image, no helper left running

    signal.signal(signal.SIGTERM, interrupted)

    from ..images.build import BuildEvent, build

    console = Console(stderr=True)
    columns = (TextColumn("[bold]{task.description:<28}"), BarColumn(),
               TextColumn("{task.completed:.0f}/{task.total:.0f} steps"),
               TextColumn("{task.fields[packages]:>4} pkgs"), TextColumn("{task.fields[size]:>8}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, disable=args.quiet) as bars:
        tasks: list[Any] = []

        def on_event(event: BuildEvent) -> None:  # only a real build reports events
            if not tasks:
                tasks.append(bars.add_task(recipe.name, total=event.total, packages=0, size=""))
            task = tasks[0]
            fields: dict[str, Any] = {}
            if event.packages:
                fields["packages"] = event.packages
            if event.bytes:
                fields["size"] = _size(event.bytes)
            bars.update(task, description=f"{event.image or recipe.name}: {event.step}", total=event.total,
                        completed=event.index - (0 if event.done else 1), **fields)

        result = build(recipe, _state(args), force=args.force, progress=on_event)
    rec = result.record
    verb = "built" if result.built else "up to date"
    print(f"{recipe.name} {verb}: {rec.digest[:19]} {_size(rec.size)} {rec.packages} packages "
          f"in {result.seconds:.1f} s")
    return 0


def handle_ls(args: argparse.Namespace) -> int:
    from ..images import store

    images = store.list_images()
    if args.json:
        print(json.dumps([{"names": list(r.names), "digest": r.digest, "size": r.size, "created": r.created,
                           "packages": r.packages, "path": str(r.rootfs)} for r in images]))
        return 0
    print(f"{'NAME':<20} {'DIGEST':<19} {'SIZE':>8} {'PACKAGES':>8}  AGE")
    for r in images:
        for name in r.names or ("<none>",):
            print(f"{name:<20} {r.digest[:19]:<19} {_size(r.size):>8} {r.packages:>8}  {_age(r.created)}")
    return 0


def handle_rm(args: argparse.Namespace) -> int:
    from ..images import store

    for name in args.names:
        rec = store.remove(name)
        print(f"removed {name} ({rec.digest[:19]})")
    return 0


def handle_prune(args: argparse.Namespace) -> int:
    from ..images import store

    deleted, leftovers = store.prune()
    for rec in deleted:
        print(f"deleted {rec.digest[:19]} {_size(rec.size)}")
    print(f"{len(deleted)} image(s) deleted, {leftovers} leftover build dir(s) removed", file=sys.stderr)
    return 0


def _size(n: int) -> str:
    for unit, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.1f}{unit}"
    return f"{n}B"


def _age(created: float) -> str:
    seconds = max(0, time.time() - created)
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= factor:
            return f"{int(seconds // factor)}{unit}"
    return f"{int(seconds)}s"
