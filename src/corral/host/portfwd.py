"""Port forwarding into a sandbox, through Corral's host side only.

A sandbox's network is never opened for a forward: its namespace keeps
exactly what its network mode gave it (``none``: a private loopback).  The
host makes the connection *from inside* instead:

* :class:`NetnsConnector` -- a thread of this process enters the sandbox's
  network namespace once (``setns``, as root may into any namespace) and does
  nothing there but create sockets; a socket belongs to the namespace it was
  created in, so the caller connects it to ``127.0.0.1:PORT`` *of the
  sandbox*.  No process of the host runs in the sandbox's namespace, and the
  sandbox gets no route, address or interface it did not have.
* :class:`PortForward` -- a listener on the host (TCP on ``127.0.0.1``, or a
  Unix socket) whose every accepted connection is paired with one made by a
  ``connect`` function (the connector above, or a tier's own) and relayed
  both ways until either side closes.  Each forward caps its connections.

Only the forward's own user (and root, and users it was told to let in) reach
the sandbox through it.  Loopback TCP is every local user's: a Unix socket is
0600, and a TCP client is looked up by its connection (:mod:`.peers`, one
netlink round trip) and cut before anything is connected inside if its socket
belongs to another user -- a forwarded port is often a browser's DevTools
endpoint, which is full control of that browser.

Everything a forward owns (its listening socket, its Unix socket file, its
relay threads and their sockets) goes in :meth:`PortForward.close`; the Unix
socket lives in the sandbox's run directory, so the janitor removes it with
that directory if the owner died.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from . import mounts
from .netns import CLONE_NEWNET
from .peers import diag_socket, tcp_peer_uid
from .sockets import bind_private, close_listener

#: connections one forward relays at once; more wait in the listen backlog
MAX_CONNECTIONS = 128
_CHUNK = 1 << 16

Connect = Callable[[int, float], socket.socket]


class NetnsConnector:
    """Makes sockets inside the network namespace of process ``pid`` (a sandbox's)."""

    def __init__(self, pid: int, name: str = "sandbox") -> None:
        self._fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        if os.fstat(self._fd).st_ino == os.stat("/proc/self/ns/net").st_ino:
            os.close(self._fd)
            raise OSError(f"process {pid} is in the host's network namespace")
        self._requests: queue.Queue[tuple[int, queue.Queue[socket.socket | BaseException]] | None] = queue.Queue()
        entered: queue.Queue[BaseException | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, args=(entered,), name=f"portfwd-netns-{name}",
                                        daemon=True)
        self._thread.start()
        error = entered.get()
        if error is not None:
            self.close()
            raise error

    def _serve(self, entered: queue.Queue[BaseException | None]) -> None:
        try:
            mounts.check(mounts.libc().setns(self._fd, CLONE_NEWNET), "entering the sandbox's network namespace")
        except BaseException as exc:
            entered.put(exc)
            return
        entered.put(None)
        # this thread never leaves the namespace and ends with the connector: it only creates sockets
        while (request := self._requests.get()) is not None:
            family, answer = request
            try:
                answer.put(socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC))
            except BaseException as exc:
                answer.put(exc)

    def new_socket(self, family: int = socket.AF_INET) -> socket.socket:
        answer: queue.Queue[socket.socket | BaseException] = queue.Queue(maxsize=1)
        self._requests.put((family, answer))
        made = answer.get(timeout=10)
        if isinstance(made, BaseException):
            raise made
        return made

    def connect(self, port: int, timeout: float) -> socket.socket:
        """A TCP connection to the sandbox's ``127.0.0.1:port`` (then ``[::1]:port``)."""
        last: OSError | None = None
        for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            sock = self.new_socket(family)
            try:
                sock.settimeout(timeout)
                sock.connect((address, port))
                sock.settimeout(None)
                return sock
            except OSError as exc:
                sock.close()
                last = exc
        assert last is not None
        raise last

    def close(self) -> None:
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            os.close(self._fd)


class PortForward:
    """One listener on the host relaying each connection to ``connect(port, timeout)``."""

    def __init__(self, port: int, connect: Connect, unix_path: Path | None = None,
                 connect_timeout: float = 10.0, other_users: Iterable[int] = ()) -> None:
        self.sandbox_port = port
        self._connect = connect
        #: who may connect over TCP: this process's user, root, and ``other_users`` (uids)
        self.users = frozenset({0, os.geteuid(), *other_users})
        if unix_path is not None and self.users - {0, os.geteuid()}:
            raise ValueError("other_users: a Unix socket forward is its owner's alone (0600)")
        self._timeout = connect_timeout
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        self.unix_path = unix_path
        #: the accept loop's own netlink socket for asking whose each TCP client is (it closes it)
        self._lookups = diag_socket() if unix_path is None else None
        if unix_path is not None:
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            unix_path.unlink(missing_ok=True)
            bind_private(self._listener, unix_path)  # 0600: only the owner (root) may connect
            self.host, self.port = "", 0
        else:
            self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            self._listener.bind(("127.0.0.1", 0))
            self.host, self.port = self._listener.getsockname()[:2]
        self._listener.listen(64)
        self._thread = threading.Thread(target=self._accept_loop, name=f"portfwd-{port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        if self.unix_path is not None:
            return f"http+unix://{str(self.unix_path).replace('/', '%2F')}/"
        return f"http://{self.host}:{self.port}/"

    def _accept_loop(self) -> None:
        lookups = self._lookups
        try:
            while True:
                self._slots.acquire()
                try:
                    client, _ = self._listener.accept()
                except OSError:
                    self._slots.release()
                    return  # closed
                if lookups is not None and not self._from_a_user_let_in(client, lookups):
                    client.close()  # the client sees the connection close, and the sandbox sees nothing
                    self._slots.release()
                    continue
                threading.Thread(target=self._serve, args=(client,), name=f"portfwd-{self.sandbox_port}-conn",
                                 daemon=True).start()
        finally:
            if lookups is not None:
                lookups.close()

    def _track(self, *socks: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._sockets.update(socks)
            return True

    def _serve(self, client: socket.socket) -> None:
        inner: socket.socket | None = None
        try:
            if not self._track(client):
                return
            try:
                inner = self._connect(self.sandbox_port, self._timeout)
            except Exception:  # nothing listens there (yet), or the sandbox is paused or going away:
                return  # the client sees the connection close
            if not self._track(inner):
                return
            if client.family != socket.AF_UNIX:
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if inner.family != socket.AF_UNIX:
                inner.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            back = threading.Thread(target=_pump_back, args=(inner, client), daemon=True,
                                    name=f"portfwd-{self.sandbox_port}-back")
            back.start()
            _pump(client, inner)
            back.join()
        finally:
            with self._lock:
                self._sockets.discard(client)
                if inner is not None:
                    self._sockets.discard(inner)
            client.close()
            if inner is not None:
                inner.close()
            self._slots.release()

    def _from_a_user_let_in(self, client: socket.socket, lookups: socket.socket) -> bool:
        try:
            uid = tcp_peer_uid(client.getpeername()[:2], client.getsockname()[:2], lookups)
        except OSError:
            uid = None  # not found (closed already): refused, as any socket we cannot name
        return uid in self.users

    @property
    def closed(self) -> bool:
        return self._closed

    def connections(self) -> int:
        with self._lock:
            return len(self._sockets)

    def close(self) -> None:
        """Stop listening, cut every relayed connection, remove the Unix socket file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._sockets)
        close_listener(self._listener, live, self._thread)
        if self.unix_path is not None:
            self.unix_path.unlink(missing_ok=True)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until end of stream, then half-close ``dst``."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    try:
        while (n := src.recv_into(buf)) > 0:
            dst.sendall(view[:n])
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (src, dst):  # one side broke: end both directions
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _pump_back(inner: socket.socket, client: socket.socket) -> None:
    """Copy the sandbox's side ``inner`` to ``client`` as :func:`_pump` does, and end both when the
    client of a Unix socket has gone altogether (POLLHUP: closed, not half-closed).  A sandbox's
    server that never answers nor closes held this thread, the one relaying the other way and
    both sockets for as long as the forward lived, after its client had gone (the server's port
    proxy: two threads per finished request).  A TCP client's close looks like a half-close
    until something is sent to it; those clients are the host's local users'."""
    if client.family != socket.AF_UNIX:
        _pump(inner, client)
        return
    poller = select.poll()
    poller.register(inner, select.POLLIN)
    poller.register(client, 0)  # (POLLHUP and POLLERR are reported whatever is asked for)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    try:
        while True:
            events = dict(poller.poll())
            if events.get(client.fileno(), 0) & (select.POLLHUP | select.POLLERR):
                raise BrokenPipeError("the client has gone")
            if not (n := inner.recv_into(buf)):
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_WR)
                return
            client.sendall(view[:n])
    except OSError:
        for sock in (inner, client):  # one side broke or went: end both directions
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
