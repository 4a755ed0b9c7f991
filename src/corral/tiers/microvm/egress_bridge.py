"""The host side of a microVM's egress port (network="allow").

The guest has no network device and this host no vsock, so the egress proxy's
Unix socket cannot be bound into the VM as the other tiers do.  Instead the
guest's relay (``corral-agent --relay-mux``, ``agent/relay_mux.c``) accepts on
the guest's loopback and multiplexes every connection over a second
virtio-serial port; this bridge opens one connection to the proxy's socket per
guest connection and copies between them.  The proxy decides everything, as
for every tier: the bridge only carries bytes, and it treats what the guest
sends as untrusted (a command runs as guest root and could speak on the port
itself).

Frames, both directions: ``u8 type | u32 connection | u32 length | payload``.
Flow control is per connection and credit based (``DOWN_WINDOW`` bytes in
flight to the guest, ``UP_WINDOW`` from it): a guest client that stops reading
holds up only its own connection, and neither side buffers more than its
window per connection.

What the guest sends is answered (CLOSE for a refused OPEN, CREDIT for data
passed on), so a guest that does not read the port could make the queue to it
grow without end: a guest root that stopped the relay and repeated OPEN grew
this process by 10 MB/s.  So the port is read only while less than
``OUTQ_PORT_HIGH`` waits for it (backpressure: a guest that does not read its
replies gets no more service; the honest relay always reads the port unless
its own queue is full, which the host's frames alone cannot do), and proxy
connections only while less than ``OUTQ_HIGH`` does.  Whatever the guest sends,
the bridge holds at most: the queue to the guest, below ``OUTQ_PORT_HIGH`` plus
one read of the port answered (``PORT_READ`` / 9 frames of at most 13 bytes) plus a
few KiB of CREDIT and CLOSE frames for the proxy connections, about 2.4 MiB; the
unparsed input, below ``HEADER.size + CHUNK + PORT_READ``; and per connection
at most ``UP_WINDOW`` for the proxy: 64 MiB over ``MAX_CONNECTIONS``.

Each connection to the proxy counts against the owner's tunnel budget
(``egress.tunnel.OWNER_TUNNELS``, in the sandbox's share) from OPEN until it is dropped: a refusal
is a CLOSE and a ``host-connection-limit`` audit event, as the proxy's own.  Its descriptor is
not the proxy's: a connection the proxy has closed (a refused CONNECT answered 403) stayed open
here until the guest said EOF, so a guest holding its clients open made the owner hold up to
``MAX_CONNECTIONS`` sockets no budget counted (24 -> 280 descriptors).  Counted, they are bounded
by the sandbox's share of the budget; and one whose proxy side is closed (both ways: a
half-close is a tunnel still in use), everything sent down credited back by the guest's relay
(it holds nothing of it: a slow client loses no byte) and nothing waiting for the proxy, is
dropped with CLOSE once the guest has said nothing on it for ``LINGER`` seconds.

New connections to the proxy are held to the sandbox's connection rate
(``egress.tunnel.ConnectionRate``: ``CONNECTION_BURST`` at once, then ``CONNECTION_RATE`` a
second), as the proxy holds every tier's: an OPEN past it is not parsed, and the port not
read, until a connection is due (the guest's relay then waits, and its clients' connect()
with it); each connection so held is counted in the audit's one ``rate-limited`` event.
Without it a guest's flood of OPENs cost this thread a socket and a connect each (refused
with CLOSE once the proxy's queue was full), at whatever rate the guest sent them.

One thread per sandbox, one selector: the traffic is bounded by what TCG
moves through virtio-serial, far below what a thread copies.
"""

from __future__ import annotations

import contextlib
import errno
import select
import selectors
import socket
import struct
import threading
import time
from pathlib import Path

from ...egress.audit import AuditLog
from ...egress.tunnel import OWNER_TUNNELS, RATE_RULE, ConnectionRate
from ..linux.agent import STRAY_FRAME_BURST, STRAY_FRAME_RATE, STRAY_HOLD

M_HELLO, M_OPEN, M_DATA, M_EOF, M_CLOSE, M_CREDIT = 1, 2, 3, 4, 5, 6
HEADER = struct.Struct("<BII")
#: the largest DATA payload either side sends (relay_mux.c's MUX_CHUNK)
CHUNK = 65536
#: bytes in flight per connection to the guest (relay_mux.c's DOWN_WINDOW): large, because
#: under TCG a credit takes milliseconds to come back (100 MB through curl: 27 MB/s with
#: 256 KiB, 41 MB/s with 1 MiB); the guest's relay holds it only for a client that does not read
DOWN_WINDOW = 1024 * 1024
#: bytes in flight per connection from the guest (relay_mux.c's UP_WINDOW): what this process
#: may have to hold per connection while the proxy does not read, so small
UP_WINDOW = 256 * 1024
CREDIT_STEP = UP_WINDOW // 4
#: connections at once (relay_mux.c's MUX_MAX): more are refused with CLOSE
MAX_CONNECTIONS = 256
#: stop reading proxy connections while this much waits for the port
OUTQ_HIGH = 1 << 20
#: stop reading the port itself while this much waits for it (its frames make CLOSE and
#: CREDIT frames): a guest that does not read gets no more service, and no more of our memory
OUTQ_PORT_HIGH = 2 << 20
#: the most one read of the port takes
PORT_READ = 1 << 18
#: seconds a connection whose proxy side is closed may stay while the guest says nothing on it
#: (the module's docstring): long enough for the guest's client to close it itself, as it
#: usually does at once, so only one that holds its socket open is cut
LINGER = 2.0


class _Conn:
    __slots__ = ("consumed", "got_eof", "id", "mask", "out", "sent_eof", "shut", "sock", "window")

    def __init__(self, conn_id: int, sock: socket.socket) -> None:
        self.id = conn_id
        self.sock = sock
        self.out = bytearray()  # from the guest, not yet taken by the proxy
        self.window = DOWN_WINDOW  # bytes we may still send the guest
        self.consumed = 0  # passed to the proxy, not yet credited to the guest
        self.sent_eof = False  # the proxy closed its side: EOF sent to the guest
        self.got_eof = False  # the guest's client is done sending
        self.shut = False  # our write side to the proxy is shut
        self.mask = 0  # what the selector watches


class EgressBridge:
    """Copies between the guest's egress port (``port``, connected) and the proxy's socket.

    :meth:`close` ends the thread and closes every socket it holds, the port's included."""

    def __init__(self, sandbox_id: str, port: socket.socket, proxy_socket: Path,
                 audit: AuditLog | None = None) -> None:
        self._sandbox_id = sandbox_id
        self._audit = audit
        self._port = port
        self._proxy_socket = str(proxy_socket)
        self._port.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._port_mask = selectors.EVENT_READ
        self._sel.register(self._port, self._port_mask, self._port)
        self._conns: dict[int, _Conn] = {}
        #: connection -> when to look again whether it only lingers (its proxy side has ended)
        self._linger: dict[int, float] = {}
        self._inbuf = bytearray()
        self._outq = bytearray()
        self._closing = False
        #: new connections the guest may open (the proxy's rate, held here before a socket is made)
        self._rate = ConnectionRate()
        self._strays = ConnectionRate(rate=STRAY_FRAME_RATE, burst=STRAY_FRAME_BURST)
        #: while over that rate: when the next may open (the port is not read until then)
        self._held_until: float | None = None
        #: set when the guest's relay said HELLO (it listens and the port is connected)
        self.hello = threading.Event()
        #: connections the guest opened so far (tests, bench)
        self.opened = 0
        self._thread = threading.Thread(target=self._run, name=f"egress-vm-{sandbox_id}", daemon=True)
        self._thread.start()

    # -- lifecycle -------------------------------------------------------
    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _teardown(self) -> None:
        for conn in list(self._conns.values()):
            conn.sock.close()
            OWNER_TUNNELS.give(self._sandbox_id)
        self._conns.clear()
        self._sel.close()
        for sock in (self._port, self._wake_r, self._wake_w):
            sock.close()

    def _run(self) -> None:
        try:
            while not self._closing:
                due = min(self._linger.values()) if self._linger else None
                if self._held_until is not None:
                    due = self._held_until if due is None else min(due, self._held_until)
                timeout = None if due is None else max(0.0, due - time.monotonic())
                for key, mask in self._sel.select(timeout):
                    if key.data is None:
                        return  # woken by close()
                    if key.data is self._port:
                        if (mask & selectors.EVENT_READ and len(self._outq) < OUTQ_PORT_HIGH
                                and not self._read_port()):
                            return  # QEMU is gone (or the guest broke the protocol)
                        if mask & selectors.EVENT_WRITE and not self._flush_port():
                            return
                    else:
                        conn: _Conn = key.data
                        if self._conns.get(conn.id) is not conn:
                            continue  # dropped earlier in this round
                        if mask & selectors.EVENT_WRITE:
                            self._flush_conn(conn)
                        if (mask & selectors.EVENT_READ and self._conns.get(conn.id) is conn
                                and len(self._outq) < OUTQ_HIGH):  # (others read in this round)
                            self._read_conn(conn)
                if self._held_until is not None and time.monotonic() >= self._held_until:
                    self._held_until = None
                    if not self._parse_port():  # the OPEN held back, and what came after it
                        return
                if due is not None and time.monotonic() >= due:
                    self._expire()
                if self._outq and not self._flush_port():
                    return
                self._rearm()
        except OSError:
            pass  # a socket we rely on failed: the sandbox's egress ends with this thread
        finally:
            self._teardown()

    # -- the port (guest side) ------------------------------------------------
    def _queue(self, kind: int, conn_id: int, payload: bytes = b"") -> None:
        self._outq += HEADER.pack(kind, conn_id, len(payload))
        self._outq += payload

    def _flush_port(self) -> bool:
        try:
            while self._outq:
                sent = self._port.send(self._outq)
                del self._outq[:sent]
        except BlockingIOError:
            pass
        except OSError:
            return False
        return True

    def _read_port(self) -> bool:
        try:
            data = self._port.recv(PORT_READ)
        except BlockingIOError:
            return True
        if not data:
            return False
        self._inbuf += data
        return self._parse_port()

    def _parse_port(self) -> bool:
        """Act on the whole frames read so far, up to an OPEN the connection rate holds back
        (:meth:`_rate_holds`); False: not the relay speaking."""
        buf = self._inbuf
        at = 0
        view = memoryview(buf)
        try:
            while len(buf) - at >= HEADER.size:
                kind, conn_id, length = HEADER.unpack_from(buf, at)
                if length > CHUNK:
                    return False  # not the relay speaking: stop serving this VM
                end = at + HEADER.size + length
                if end > len(buf):
                    break
                if kind == M_OPEN and self._rate_holds(conn_id):
                    break  # this frame and the rest wait in the buffer, and the port is not read
                if self._is_stray(kind, conn_id) and self._strays_hold():
                    break  # (as above)
                self._guest_frame(kind, conn_id, view[at + HEADER.size:end])
                at = end
        finally:
            view.release()
        del buf[:at]
        return True

    def _guest_frame(self, kind: int, conn_id: int, payload: memoryview) -> None:
        if kind == M_OPEN:
            self._open(conn_id)
            return
        if kind == M_HELLO:
            self.hello.set()
            return
        conn = self._conns.get(conn_id)
        if conn is None:
            return  # closed meanwhile: late frames are expected
        if conn_id in self._linger:  # the guest spoke: its grace starts again
            self._linger[conn_id] = time.monotonic() + LINGER
        if kind == M_DATA:
            if conn.got_eof or len(conn.out) + len(payload) > UP_WINDOW:
                self._drop(conn, tell_guest=True)  # the guest broke the window
                return
            if conn.out:
                conn.out += payload
            else:
                try:
                    sent = conn.sock.send(payload)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    self._drop(conn, tell_guest=True)
                    return
                conn.out += payload[sent:]
                self._consumed(conn, sent)
        elif kind == M_EOF:
            conn.got_eof = True
            self._flush_conn(conn)
        elif kind == M_CLOSE:
            self._drop(conn, tell_guest=False)
        elif kind == M_CREDIT and len(payload) == 4:
            conn.window = min(DOWN_WINDOW, conn.window + struct.unpack("<I", payload)[0])

    # -- connections to the proxy ----------------------------------------------
    def _refused_anyway(self, conn_id: int) -> bool:
        return conn_id in self._conns or len(self._conns) >= MAX_CONNECTIONS

    def _is_stray(self, kind: int, conn_id: int) -> bool:
        """A frame that asks nothing of the bridge: a HELLO again, an OPEN refused anyway, a
        frame for no connection (a few come late, after a close), a kind the relay never sends."""
        if kind == M_HELLO:
            return self.hello.is_set()
        if kind == M_OPEN:
            return self._refused_anyway(conn_id)
        return kind not in (M_DATA, M_EOF, M_CLOSE, M_CREDIT) or conn_id not in self._conns

    def _strays_hold(self) -> bool:
        """Whether a stray frame must wait for STRAY_FRAME_RATE (the port is not read meanwhile)."""
        wait = self._strays.take()
        if wait:
            self._held_until = time.monotonic() + max(wait, STRAY_HOLD)
            return True
        return False

    def _rate_holds(self, conn_id: int) -> bool:
        """Whether the OPEN of ``conn_id`` must wait for the connection rate (an OPEN refused
        anyway, with a CLOSE and no socket, takes nothing from it)."""
        if self._refused_anyway(conn_id):
            return False
        wait = self._rate.take()
        if wait:
            self._held_until = time.monotonic() + wait
            return True
        held = self._rate.settle()  # how long this OPEN, at the head of the input, was held
        if held and self._audit is not None:
            self._audit.tally(self._sandbox_id, "rate-limited", RATE_RULE, "proxy", held)
        return False

    def _open(self, conn_id: int) -> None:
        if self._refused_anyway(conn_id):
            self._queue(M_CLOSE, conn_id)
            return
        if not OWNER_TUNNELS.take(self._sandbox_id):
            if self._audit is not None:  # (the refusal the proxy records for the other tiers)
                self._audit.record(self._sandbox_id, "refused", "*", None, "host-connection-limit", "proxy")
            self._queue(M_CLOSE, conn_id)
            return
        # a failure here is this stream's, not the port's: it is answered with CLOSE and the bridge
        # goes on.  EMFILE is the likely one (the owner's descriptors are shared by every sandbox:
        # another one's tunnels can use them up for a while); letting it end the thread cut this
        # VM's egress for good, even once descriptors were free again
        sock = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.setblocking(False)
            # a Unix socket connects at once, or fails at once (EAGAIN: the proxy's backlog is full)
            sock.connect(self._proxy_socket)
        except OSError as exc:
            if sock is not None:
                sock.close()
            OWNER_TUNNELS.give(self._sandbox_id)
            self._queue(M_CLOSE, conn_id)
            if self._audit is not None:  # counted, one event in all: it may happen to each of a flood
                name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
                self._audit.tally(self._sandbox_id, "refused", f"proxy-connection-failed: {name}", "proxy")
            return
        self._conns[conn_id] = _Conn(conn_id, sock)
        self.opened += 1

    def _consumed(self, conn: _Conn, count: int) -> None:
        conn.consumed += count
        if conn.consumed >= CREDIT_STEP:
            self._queue(M_CREDIT, conn.id, struct.pack("<I", conn.consumed))
            conn.consumed = 0

    def _flush_conn(self, conn: _Conn) -> None:
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except BlockingIOError:
                return
            except OSError:
                self._drop(conn, tell_guest=True)
                return
            del conn.out[:sent]
            self._consumed(conn, sent)
        if not conn.out and conn.got_eof and not conn.shut:
            conn.shut = True
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
            self._maybe_finish(conn)

    def _read_conn(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(min(conn.window, CHUNK))
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn, tell_guest=True)
            return
        if not data:
            conn.sent_eof = True
            self._queue(M_EOF, conn.id)
            self._maybe_finish(conn)
            if self._conns.get(conn.id) is conn:
                self._linger[conn.id] = time.monotonic() + LINGER
            return
        conn.window -= len(data)
        self._queue(M_DATA, conn.id, data)

    def _maybe_finish(self, conn: _Conn) -> None:
        # both halves done and nothing left for the proxy: both sides forget it
        if conn.sent_eof and conn.shut:
            self._drop(conn, tell_guest=False)

    def _expire(self) -> None:
        """Drop each lingering connection whose grace is over and that only lingers (the module's
        docstring); look again at the others (a half-closed proxy side may close later) later."""
        now = time.monotonic()
        for conn_id, due in list(self._linger.items()):
            if due > now:
                continue
            conn = self._conns[conn_id]
            if conn.window == DOWN_WINDOW and not conn.out and _peer_closed(conn.sock):
                self._drop(conn, tell_guest=True)
            else:
                self._linger[conn_id] = now + LINGER

    def _drop(self, conn: _Conn, *, tell_guest: bool) -> None:
        if tell_guest:
            self._queue(M_CLOSE, conn.id)
        if self._conns.get(conn.id) is conn:
            del self._conns[conn.id]
            OWNER_TUNNELS.give(self._sandbox_id)
        self._linger.pop(conn.id, None)
        if conn.mask:
            with contextlib.suppress(KeyError):  # (a failed modify has unregistered it already)
                self._sel.unregister(conn.sock)
        conn.sock.close()

    def _rearm(self) -> None:
        """Watch each socket for exactly what it can do now: the port for output when queued,
        and for input only while its queue is below ``OUTQ_PORT_HIGH``."""
        reading = len(self._outq) < OUTQ_HIGH
        failed: list[_Conn] = []
        for conn in self._conns.values():
            mask = 0
            if reading and not conn.sent_eof and conn.window > 0:
                mask |= selectors.EVENT_READ
            if conn.out:
                mask |= selectors.EVENT_WRITE
            if mask != conn.mask:
                try:
                    if not conn.mask:
                        self._sel.register(conn.sock, mask, conn)
                    elif not mask:
                        self._sel.unregister(conn.sock)
                    else:
                        self._sel.modify(conn.sock, mask, conn)
                except OSError:  # (epoll's ENOMEM or ENOSPC, its per-user watch limit): this stream only
                    failed.append(conn)
                    continue
                conn.mask = mask
        for conn in failed:
            self._drop(conn, tell_guest=True)
        reading_port = len(self._outq) < OUTQ_PORT_HIGH and self._held_until is None
        port_mask = ((selectors.EVENT_READ if reading_port else 0)
                     | (selectors.EVENT_WRITE if self._outq else 0))
        if port_mask != self._port_mask:
            self._sel.modify(self._port, port_mask, self._port)
            self._port_mask = port_mask


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the proxy closed its end both ways (a Unix stream socket reports POLLHUP only then;
    after a half-close the proxy may still read, and the connection is in use)."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return any(events & select.POLLHUP for _, events in poller.poll(0))
