"""Tunnels: the bytes of a sandbox's connection through the egress proxy, copied between its
client and the upstream server once the proxy has allowed it, with what that may make the host
hold bounded (:mod:`.proxy` decides; this copies).

Threads, not asyncio: each tunnel is two ``os.splice`` loops that copy in the kernel without
holding the GIL, which is what keeps bulk transfers fast.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

#: client connections one sandbox may hold open at once (each costs the host up to two threads)
MAX_CONNECTIONS = 256
#: the owner's descriptors one tunnel holds at most: the client's socket, the upstream's, and
#: the two ends of each direction's pipe
TUNNEL_FDS = 6
#: seconds a tunnel whose client is done (its half-close passed on) may go without a byte from
#: the far end before it is closed (HAProxy's ``timeout server-fin``).  From here a client that
#: closed its socket, or died, looks like one that only half-closed it; a far end that never
#: answers nor closes held the tunnel -- one of the sandbox's MAX_CONNECTIONS, ~6 of the owner's
#: descriptors and 2 threads -- for the sandbox's whole life: a long session ran out of egress
HALF_CLOSED_IDLE = 60.0
#: seconds a tunnel thread waits for another tunnel before it ends
WORKER_IDLE = 30.0
#: new connections per second one sandbox's proxy takes in, once CONNECTION_BURST are spent
#: (a token bucket per sandbox, :class:`ConnectionRate`).  Every connection costs the owner,
#: which no cgroup bounds, its CPU (a refused CONNECT 0.07-0.2 ms here): one sandbox refused
#: 8,000-11,000 a second cost the owner 2.9-3.5 s of CPU in 5 s, charged to no sandbox.  Past
#: the rate a connection is not refused: the proxy does not accept for a while, so the kernel
#: holds it in the listening socket's queue and the sandbox's connect() waits, which costs the
#: owner nothing
CONNECTION_RATE = 256.0
#: connections one sandbox may open at once before CONNECTION_RATE holds it (a package
#: manager's burst: a few hundred connections in a second go through at full speed)
CONNECTION_BURST = 512
#: the audit's rule for connections CONNECTION_RATE held back (one ``rate-limited`` event sums them)
RATE_RULE = "connection-rate"

# What a tunnel makes the host hold while the sandbox reads nothing: the upstream socket's
# receive queue (up to twice its receive buffer), its send queue, and two pipes.  The host's
# TCP memory is one pool (``net.ipv4.tcp_mem``) charged to no sandbox: with the kernel's
# autotuning and 1 MiB pipes, one sandbox's 512 tunnels that read nothing held 1.3 GB of it
# (the window grows to ``tcp_rmem``'s maximum, 32 MiB here), at the pool's hard limit with the
# far ends' buffers, after which every TCP socket on the host is starved.  So the first
# BULK_TUNNELS open tunnels of a sandbox move data at full speed, and the others through small
# windows: per sandbox at most ~64 MiB for the 8 and ~40 MiB for the other 248 (docs/egress.md).
#: tunnels of one sandbox with full-speed buffers at once (a download, a clone, a push)
BULK_TUNNELS = 8
BULK_WINDOW = 2 << 20  # SO_RCVBUF: a window of ~2-3 MiB, ~50 MB/s per tunnel at 50 ms round trip
BULK_SEND = 1 << 20
PIPE_SIZE = 1 << 20
SMALL_WINDOW = 32 << 10
SMALL_SEND = 32 << 10
SMALL_PIPE = 16 << 10
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class ConnectionRate:
    """A token bucket of new connections: :data:`CONNECTION_BURST` at once, then
    :data:`CONNECTION_RATE` a second.  One thread takes from it (a proxy's accept loop, a
    microVM's egress bridge): no lock.  The constants are read when it is made."""

    __slots__ = ("_at", "_held", "_tokens", "burst", "rate")

    def __init__(self, rate: float | None = None, burst: int | None = None) -> None:
        self.rate = CONNECTION_RATE if rate is None else rate
        self.burst = float(CONNECTION_BURST if burst is None else burst)
        self._tokens = self.burst
        self._at = time.monotonic()
        self._held = 0.0

    def take(self) -> float:
        """One connection: 0.0 if it may go now (its token taken), else the seconds until it
        may (nothing taken: ask again then; the wait is counted in :meth:`settle`)."""
        now = time.monotonic()
        tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if tokens >= 1.0:
            self._tokens = tokens - 1.0
            return 0.0
        self._tokens = tokens
        wait = (1.0 - tokens) / self.rate
        self._held += wait
        return wait

    def settle(self) -> float:
        """The seconds :meth:`take` made its caller wait since the last call (0.0: none), for
        the audit's one ``rate-limited`` event (``AuditLog.tally``)."""
        held, self._held = self._held, 0.0
        return held


class _Waiting:
    """An idle worker: ``wake`` is released once ``job`` is set for it."""

    __slots__ = ("job", "wake")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.job: tuple[Callable[..., None], tuple[Any, ...]] | None = None


class Workers:
    """Reused daemon threads: starting a thread per connection costs a scheduling round trip
    (``Thread.start`` waits for the thread to run), which showed up as ~0.5 ms a request on
    a busy host.  Daemon threads, so a tunnel left open never blocks interpreter exit.

    A worker idle for :attr:`idle` seconds ends: the peak of one burst (two threads per tunnel,
    up to the owner's tunnel budget) is not kept for the process's life (a long session's peak
    of ~270 tunnels left ~540 idle threads in ``corral serve`` for good).  The worker idle the
    shortest time takes the next job, so a trickle of tunnels keeps a few threads busy and lets
    the rest of a peak end.  Each worker waits on a lock of its own: a ``SimpleQueue`` shared by
    all, read with a timeout, can block for ever in CPython 3.11 (a wake-up whose item another
    reader took leaves the next wait with a negative timeout: 5 workers in 60 bursts here)."""

    def __init__(self, idle: float = WORKER_IDLE) -> None:
        self._lock = threading.Lock()
        self._waiting: list[_Waiting] = []  # the longest idle first
        self.idle = idle
        #: live worker threads (tests read it)
        self.threads = 0

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            worker = self._waiting.pop() if self._waiting else None
            if worker is None:
                self.threads += 1
        if worker is None:
            threading.Thread(target=self._work, args=(fn, args), name="corral-egress", daemon=True).start()
        else:
            worker.job = (fn, args)
            worker.wake.release()

    def _work(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        me = _Waiting()
        while True:
            try:
                fn(*args)
            except Exception:  # a job's failure must not kill the worker
                pass
            del fn, args  # (an idle worker holds no tunnel's sockets)
            with self._lock:
                self._waiting.append(me)
            if not me.wake.acquire(timeout=self.idle):
                with self._lock:
                    if me in self._waiting:
                        self._waiting.remove(me)
                        self.threads -= 1
                        return
                me.wake.acquire()  # a submit took this worker as its time ran out: the job is coming
            assert me.job is not None
            (fn, args), me.job = me.job, None


WORKERS = Workers()


class OwnerTunnels:
    """Client connections of every sandbox's proxy in this process at once.  Each holds up to ~6
    of the owner's descriptors (two sockets, two pipes), so at most a twelfth of the open-files
    limit of them are open at once (:meth:`limit`), and the rest of the owner's work keeps half
    its descriptors: where root cannot raise the limit (no ``CAP_SYS_RESOURCE``: 20,000 on this
    VM) a dozen sandboxes' tunnels left ``corral serve`` no descriptor for any tenant's create.

    Past half of that budget, a *share* holding its part of it (the budget over the live shares)
    gets no more: one sandbox's tunnels cannot keep another's from opening.  A proxy's share is
    its sandbox's own unless :meth:`assign` put the sandbox in a larger one: ``corral serve`` puts
    each tenant's sandboxes in one, so that a tenant with 32 sandboxes does not hold 32 parts
    against another's one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0
        #: live proxies (by the sandbox they serve) -> the tunnels each holds
        self._proxies: dict[str, int] = {}
        #: sandbox id -> the share it is in, where not its own (:meth:`assign`)
        self._shares: dict[str, str] = {}

    @staticmethod
    def limit() -> int:
        """The budget: half the open-files limit, over :data:`TUNNEL_FDS` each.  No floor of 256
        as before: with an owner limited to 600 descriptors it allowed 256 tunnels, ~1,500
        descriptors, and another sandbox's tunnels made every socket() fail with EMFILE.  The
        minimum is one tunnel, so that egress is never refused outright by a budget of 0: a
        limit that small (below 12) leaves no room to run a sandbox anyway."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return 1 << 30 if soft == resource.RLIM_INFINITY else max(1, soft // (2 * TUNNEL_FDS))

    def assign(self, sandbox_id: str, share: str | None) -> None:
        """Count ``sandbox_id``'s tunnels in ``share`` from now on (None: its own share again).
        It may be called before the sandbox's proxy exists, or again after it was remade."""
        with self._lock:
            if share is None:
                self._shares.pop(sandbox_id, None)
            else:
                self._shares[sandbox_id] = share

    def share_of(self, sandbox_id: str) -> str:
        with self._lock:
            return self._shares.get(sandbox_id, sandbox_id)

    def joined(self, sandbox_id: str) -> None:
        with self._lock:
            self._proxies[sandbox_id] = 0

    def left(self, sandbox_id: str) -> None:
        with self._lock:
            self._proxies.pop(sandbox_id, None)

    def take(self, sandbox_id: str) -> bool:
        """One more connection for ``sandbox_id``'s proxy; False: refuse it."""
        with self._lock:
            limit = self.limit()
            if self.held >= limit:
                return False
            if self.held >= limit // 2:  # a walk over the live proxies, only once half is taken
                share = self._shares.get(sandbox_id, sandbox_id)
                held_by: dict[str, int] = {}
                for proxy, tunnels in self._proxies.items():
                    key = self._shares.get(proxy, proxy)
                    held_by[key] = held_by.get(key, 0) + tunnels
                if held_by.get(share, 0) >= limit // max(1, len(held_by)):
                    return False
            self.held += 1
            if sandbox_id in self._proxies:
                self._proxies[sandbox_id] += 1
            return True

    def give(self, sandbox_id: str) -> None:
        with self._lock:
            self.held -= 1
            if self._proxies.get(sandbox_id):
                self._proxies[sandbox_id] -= 1


OWNER_TUNNELS = OwnerTunnels()


def _splice_one_way(src: socket.socket, dst: socket.socket, abort: threading.Event, pipe_size: int,
                    last_moved: list[float] | None = None) -> None:
    """Copy ``src`` to ``dst`` until its end; ``last_moved[0]``, if given, is when bytes last came."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            pipe_size = fcntl.fcntl(write_end, _F_SETPIPE_SZ, pipe_size)
        src_fd, dst_fd = src.fileno(), dst.fileno()
        while True:
            moved = os.splice(src_fd, write_end, pipe_size)
            if moved == 0:
                break
            if last_moved is not None:
                last_moved[0] = time.monotonic()
            while moved:
                moved -= os.splice(read_end, dst_fd, moved)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)  # pass the half-close on
    except OSError:
        abort.set()
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    finally:
        os.close(read_end)
        os.close(write_end)


def pump(client: socket.socket, upstream: socket.socket, early: bytes, pipe_size: int = PIPE_SIZE) -> None:
    """Copy both ways until both sides are done; ``early`` is client data already read."""
    client.settimeout(None)
    upstream.settimeout(None)
    if early:
        upstream.sendall(early)
    abort = threading.Event()
    back_done = threading.Event()
    back_moved = [time.monotonic()]

    def back() -> None:
        try:
            _splice_one_way(upstream, client, abort, pipe_size, back_moved)
        finally:
            back_done.set()

    WORKERS.submit(back)
    _splice_one_way(client, upstream, abort, pipe_size)
    # the client is done: the far end has HALF_CLOSED_IDLE seconds between bytes to answer it
    back_moved[0] = time.monotonic()
    while not back_done.wait(max(0.0, back_moved[0] + HALF_CLOSED_IDLE - time.monotonic())):
        if time.monotonic() - back_moved[0] >= HALF_CLOSED_IDLE:
            for sock in (client, upstream):  # wakes the copy: it ends, and so does the tunnel
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            back_done.wait()
            break
