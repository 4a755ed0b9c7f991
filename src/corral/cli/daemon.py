"""``corral daemon``: warm sandboxes for ``corral run`` on a root-only Unix socket.

``corral run -- CMD`` pays for Python's start-up and Corral's imports, and then
for a cold create; with a daemon running, ``corral run``'s fast path
(:mod:`corral.cli.fast_run`) sends the command here instead, where a warm pool
hands it a fresh default sandbox at once.  Each run gets its own sandbox,
destroyed after the result is sent: the same isolation and the same results
as the in-process path, which stays the fallback whenever no daemon answers.

The socket (``<state dir>/daemon.sock``) is created 0600 and every connection's
peer credentials are checked: only the daemon's own uid (root) is served.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..host.sockets import bind_private
from . import local_wire as wire

#: commands run at once; further connections wait their turn (never refused)
MAX_CONCURRENT = 32
#: how often a run's watcher looks for its client's end (ms)
CLIENT_WATCH_MS = 100
#: seconds a stopping daemon waits for the runs it ended to tell their clients
CLOSE_WAIT = 5.0
#: seconds between the main thread's looks for a stop asked by a signal
ACCEPT_WAKE = 0.5


def register(sub: Any) -> None:
    parser = sub.add_parser("daemon", help="keep warm sandboxes for `corral run` (root-only local socket)",
                            description="Serve `corral run [--json] [--timeout S] -- CMD` from a warm pool "
                            "of default sandboxes over <state dir>/daemon.sock (0600, root only). "
                            "`corral run` uses it when it is running and falls back to running in-process.")
    parser.add_argument("--pool", type=int, default=2, metavar="N", help="idle sandboxes kept warm (default 2)")
    parser.set_defaults(handler=handle)


def _peer_uid(conn: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)


def _listen(path: Path) -> socket.socket:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)  # a dead daemon's socket
    else:
        from ..errors import InvalidSpec

        raise InvalidSpec(f"a daemon already listens on {path}")
    finally:
        probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    bind_private(listener, path)  # 0600 from the start: no moment where others may connect
    listener.listen(128)
    return listener


class Daemon:
    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        self.served = 0
        self._lock = threading.Lock()
        self._running: set[Any] = set()  # sandboxes handed to runs under way
        self._closed = False

    def close(self) -> None:
        """Destroy the sandboxes of the runs under way (their clients get an error): a stopped
        daemon's serving threads die with it, and their sandboxes' run dirs, cgroups and rows
        stayed for gc."""
        with self._lock:
            self._closed = True
            running = list(self._running)
        for sandbox in running:
            sandbox.kill()
        deadline = time.monotonic() + CLOSE_WAIT
        while self._running and time.monotonic() < deadline:  # their clients told, not left hanging
            time.sleep(0.01)

    def serve_connection(self, conn: socket.socket) -> None:
        with conn:
            if _peer_uid(conn) != os.geteuid():
                return  # the socket is 0600 already; this is the second lock
            header = wire.read_exact(conn, wire.LENGTH.size)
            if len(header) < wire.LENGTH.size:
                return
            (length,) = wire.LENGTH.unpack(header)
            if length > wire.MAX_REQUEST:
                return
            body = wire.read_exact(conn, length)
            if len(body) != length:  # the client stopped short: what came is not its command
                return
            with self._slots:
                self._run(conn, body)

    def _run(self, conn: socket.socket, raw: bytes) -> None:
        from ..errors import InvalidSpec, SandboxError
        from ..spec import Limits

        try:
            argv, timeout_text = wire.decode_request(raw)
            if not argv or not all(argv):
                raise InvalidSpec("no command given: corral run [OPTIONS] -- CMD [ARGS...]")
            # parsed exactly as `corral run --timeout` parses it in-process (same errors)
            timeout = Limits.build(None, None, None, None, timeout_text, None).timeout
        except (ValueError, SandboxError) as exc:
            wire.send_frame(conn, wire.ERROR, str(exc).encode())
            return
        try:
            sandbox = self._pool.acquire()
        except SandboxError as exc:
            wire.send_frame(conn, wire.ERROR, str(exc).encode())
            return
        with self._lock:
            closed = self._closed
            self._running.add(sandbox)
        try:
            if closed:
                raise SandboxError("the daemon is stopping")
            self._exec(conn, sandbox, argv, timeout)
        except SandboxError as exc:
            with contextlib.suppress(OSError):
                wire.send_frame(conn, wire.ERROR, str(exc).encode())
        finally:
            sandbox.kill()
            with self._lock:
                self._running.discard(sandbox)
            self.served += 1

    def _exec(self, conn: socket.socket, sandbox: Any, argv: list[str], timeout: float) -> None:
        from ..errors import SandboxError

        gone = threading.Event()

        def forward(stream: str, chunk: bytes) -> None:
            if gone.is_set():
                return
            try:
                wire.send_frame(conn, wire.STDOUT if stream == "stdout" else wire.STDERR, chunk)
            except OSError:
                gone.set()  # the client left (Ctrl-C): the command is killed

        try:
            # said before the start, not after: the command may run (and be seen running) before
            # start() returns, and a client that has not heard it would run the command again if
            # the daemon died then (a CI run's); a daemon that dies before its start costs the
            # client a 125, never a second run
            try:
                wire.send_frame(conn, wire.STARTED, b"")
            except OSError:
                return  # the client left before the command started: it is not started
            handle = sandbox.commands.start(argv, timeout=timeout, on_output=forward)
            handle.close_stdin()
            threading.Thread(target=_kill_when_gone, args=(gone, handle, conn), daemon=True).start()
            result = handle.wait()
            if self._closed:  # (ended by close(): its exit status is the kill's, not the command's)
                raise SandboxError("the daemon stopped while the command ran")
        except SandboxError as exc:
            with contextlib.suppress(OSError):
                wire.send_frame(conn, wire.ERROR, str(exc).encode())
            return
        finally:
            gone.set()
        line = json.dumps({"sandbox_id": sandbox.id, **result.to_dict()}).encode()
        head = wire.RESULT_HEAD.pack(result.exit_code, result.timed_out, result.oom_killed, result.duration_ms)
        # one line per run, written before the reply: what an operator (and the tests, once the
        # client has its answer) can tell the daemon served
        print(f"corral: daemon ran {sandbox.id}: exit {result.exit_code}", file=sys.stderr, flush=True)
        try:
            wire.send_frame(conn, wire.RESULT, head + line)
        except OSError:
            pass


def _kill_when_gone(gone: threading.Event, handle: Any, conn: socket.socket) -> None:
    """Kill the command once its client left: a write to it failed, or its connection shows an
    end (the client sends nothing after its request, so anything readable is one).  A command
    that printed nothing ran on to its timeout after the client's Ctrl-C, holding one of the
    daemon's slots: 32 such runs made every later ``corral run`` wait."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN | select.POLLRDHUP)
    while not gone.is_set():
        if poller.poll(CLIENT_WATCH_MS):
            gone.set()
    if not handle.done:
        handle.kill()


def handle(args: argparse.Namespace) -> int:
    from ..pool import SandboxPool
    from ..registry import state_dir
    from ..spec import SandboxSpec

    if args.pool < 0:
        from ..errors import InvalidSpec

        raise InvalidSpec(f"--pool: {args.pool} must be 0 or more")
    root = state_dir(args.state_dir)
    path = root / wire.SOCKET_NAME
    listener = _listen(path)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        listener.shutdown(socket.SHUT_RDWR)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    pool = SandboxPool(SandboxSpec(), min_idle=args.pool, max_idle=max(args.pool, 1), state=root)
    pool.start()
    daemon = Daemon(pool)
    print(f"corral: daemon serving `corral run` on {path} (pool of {args.pool})", file=sys.stderr, flush=True)
    # the main thread wakes twice a second: the kernel may hand SIGTERM to any thread, and then
    # nothing interrupts the main thread's accept() to run the handler (a stopped daemon was seen
    # still accepting a minute after its SIGTERM)
    listener.settimeout(ACCEPT_WAKE)
    try:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            threading.Thread(target=daemon.serve_connection, args=(conn,), daemon=True).start()
    finally:
        listener.close()
        path.unlink(missing_ok=True)
        daemon.close()
        pool.close()
    return 0
