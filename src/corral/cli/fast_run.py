"""``corral run`` through a running ``corral daemon``: the same results, without the start-up.

Only the simplest calls take this path: ``corral run [--json] [--timeout S] [--] CMD...``
with a daemon listening for the state directory in use and no ``CORRAL_URL``.  Anything
else, or no daemon, returns None and the caller runs the command in-process as always.
The daemon's sandboxes are the default spec, warm from its pool, one per run, destroyed
after it.  Exit codes and messages are the in-process path's (``corral.cli.run``).
"""

from __future__ import annotations

import os
import sys
from _socket import AF_UNIX, SO_PEERCRED, SOCK_STREAM, SOL_SOCKET, socket  # not `socket`: it imports enum (~1.5 ms)

from . import local_wire as wire

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

EXIT_SANDBOX_FAILED, EXIT_TIMEOUT, EXIT_OOM = 125, 124, 137


def _eligible(argv: Sequence[str]) -> tuple[list[str], bool, str | None] | None:
    """(command, --json, --timeout) when this call can go to the daemon, else None."""
    if not argv or argv[0] != "run" or os.environ.get("CORRAL_URL") or os.environ.get("CORRAL_NO_DAEMON"):
        return None
    rest, as_json, timeout = list(argv[1:]), False, None
    while rest and rest[0].startswith("-") and rest[0] != "--":
        option = rest.pop(0)
        if option == "--json":
            as_json = True
        elif option == "--timeout" and rest:
            timeout = rest.pop(0)
        elif option.startswith("--timeout="):
            timeout = option.partition("=")[2]
        else:
            return None  # any other option: the in-process path knows it
    if rest and rest[0] == "--":
        rest = rest[1:]
    return (rest, as_json, timeout) if rest else None


def try_fast_run(argv: Sequence[str]) -> int | None:
    """The exit code of ``corral run`` done by the daemon, or None to run it in-process."""
    call = _eligible(argv)
    if call is None:
        return None
    cmd, as_json, timeout = call
    sock = socket(AF_UNIX, SOCK_STREAM)
    try:
        sock.connect(wire.socket_path())
        if not wire.daemon_is_trusted(sock.getsockopt(SOL_SOCKET, SO_PEERCRED, 12)):
            # a socket another user made (a state directory they can change): the command and
            # what it prints are not theirs to see; the in-process path refuses such a directory
            sock.close()
            return None
        sock.sendall(wire.encode_request(cmd, timeout))
    except OSError:  # no daemon (or a stale socket of a dead one)
        sock.close()
        return None
    try:
        return _relay(sock, as_json, wire.answer_deadline(timeout))
    finally:
        sock.close()


def _relay(sock: socket, as_json: bool, deadline: float) -> int | None:
    out, err = sys.stdout.buffer, sys.stderr.buffer
    started = False
    while True:
        try:
            frame = wire.read_frame(sock)
        except TimeoutError:
            print(f"corral: the local daemon said nothing for {deadline:g} s while the command ran",
                  file=sys.stderr)
            return EXIT_SANDBOX_FAILED
        except OSError:
            frame = None
        if frame is None:
            if not started:
                return None  # the daemon went away before the command started: run it here
            # (not again here: it may have done what it does, silently or with --json)
            print("corral: the local daemon went away while the command ran", file=sys.stderr)
            return EXIT_SANDBOX_FAILED
        kind, payload = frame
        if kind == wire.STARTED:
            started = True
            sock.settimeout(deadline)  # (before it, a busy daemon's queue may be long: no deadline)
        elif kind in (wire.STDOUT, wire.STDERR):
            started = True
            if not as_json:
                target = out if kind == wire.STDOUT else err
                target.write(payload)
                target.flush()
        elif kind == wire.ERROR:
            from ..egress.audit import shown  # (its text may be a sandbox's)

            print(f"corral: {shown(payload.decode(errors='replace'))}", file=sys.stderr)
            return EXIT_SANDBOX_FAILED
        elif kind == wire.RESULT:
            exit_code, timed_out, oom_killed, duration_ms = wire.RESULT_HEAD.unpack_from(payload)
            if as_json:
                out.write(payload[wire.RESULT_HEAD.size:] + b"\n")
                out.flush()
                return 0
            if timed_out:
                print(f"corral: command timed out after {duration_ms / 1000:.1f} s", file=sys.stderr)
                return EXIT_TIMEOUT
            if oom_killed:
                print("corral: command was killed: out of memory", file=sys.stderr)
                return EXIT_OOM
            return int(exit_code)
