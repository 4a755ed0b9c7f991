"""The microVM egress bridge without a VM: its port is one end of a socketpair, the test speaks
the guest relay's side of the protocol, and the "proxy" is an echo server on a Unix socket.
The guest is untrusted: window violations, too many connections and oversized frames must
end in CLOSE or a closed port, never in unbounded buffering."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from corral.egress.audit import AuditLog
from corral.egress.tunnel import OWNER_TUNNELS
from corral.tiers.microvm import egress_bridge
from corral.tiers.microvm.egress_bridge import (
    CHUNK,
    DOWN_WINDOW,
    HEADER,
    M_CLOSE,
    M_CREDIT,
    M_DATA,
    M_EOF,
    M_HELLO,
    M_OPEN,
    MAX_CONNECTIONS,
    UP_WINDOW,
    EgressBridge,
)


class Guest:
    """The relay's side of the port."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(10)
        self.buf = b""
        #: DATA received so far per connection
        self.data: dict[int, bytes] = {}

    def send(self, kind: int, conn: int, payload: bytes = b"") -> None:
        self.sock.sendall(HEADER.pack(kind, conn, len(payload)) + payload)

    def frame(self) -> tuple[int, int, bytes]:
        while True:
            if len(self.buf) >= HEADER.size:
                kind, conn, length = HEADER.unpack_from(self.buf)
                if len(self.buf) >= HEADER.size + length:
                    payload = self.buf[HEADER.size:HEADER.size + length]
                    self.buf = self.buf[HEADER.size + length:]
                    return kind, conn, payload
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError
            self.buf += chunk

    def until(self, kind: int, conn: int) -> bytes:
        """Read frames, keeping and crediting every connection's DATA, up to ``conn``'s frame of
        ``kind``; returns what ``conn`` received so far."""
        while True:
            got_kind, got_conn, payload = self.frame()
            if got_kind == M_DATA:
                self.data[got_conn] = self.data.get(got_conn, b"") + payload
                self.send(M_CREDIT, got_conn, struct.pack("<I", len(payload)))
            if (got_kind, got_conn) == (kind, conn):
                return self.data.get(conn, b"")


@contextlib.contextmanager
def unix_server(path: Path, serve: Callable[[socket.socket], None], backlog: int) -> Iterator[Path]:
    """A stand-in for the proxy at ``path``: each connection served by ``serve`` on a thread."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(backlog)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):  # a test used up the descriptors
                    time.sleep(0.01)
                    continue
                return  # closed
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield path
    finally:
        server.close()


@pytest.fixture
def echo(tmp_path: Path) -> Iterator[Path]:
    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the bridge may drop a connection (window broken)
            while data := conn.recv(65536):
                conn.sendall(data)

    with unix_server(tmp_path / "proxy.sock", serve, 512) as path:
        yield path


@pytest.fixture
def pair(echo: Path) -> Iterator[tuple[EgressBridge, Guest]]:
    host, guest = socket.socketpair()
    bridge = EgressBridge("sb-test", host, echo)
    try:
        yield bridge, Guest(guest)
    finally:
        bridge.close()
        guest.close()


def test_connections_are_carried_both_ways_and_half_closed(pair: tuple[EgressBridge, Guest]) -> None:
    bridge, guest = pair
    guest.send(M_HELLO, 0)
    big = bytes(range(256)) * 4096  # 1 MiB: four times the window from the guest
    for conn in (1, 2):
        guest.send(M_OPEN, conn)
    sent = 0
    window = UP_WINDOW
    while sent < len(big):  # the guest sends only what the bridge credited
        chunk = big[sent:sent + min(CHUNK, window)]
        if chunk:
            guest.send(M_DATA, 1, chunk)
            sent += len(chunk)
            window -= len(chunk)
        kind, conn, payload = guest.frame()
        if kind == M_CREDIT:
            window += struct.unpack("<I", payload)[0]
        elif kind == M_DATA:
            guest.data[conn] = guest.data.get(conn, b"") + payload
            guest.send(M_CREDIT, conn, struct.pack("<I", len(payload)))
    guest.send(M_DATA, 2, b"second")
    guest.send(M_EOF, 2)
    assert guest.until(M_EOF, 2) == b"second"  # the echo server saw EOF and closed: EOF back
    guest.send(M_EOF, 1)
    assert guest.until(M_EOF, 1) == big
    assert bridge.hello.is_set() and bridge.opened == 2
    assert not bridge._conns  # both halves closed: forgotten


def test_a_guest_breaking_the_window_loses_that_connection_only(pair: tuple[EgressBridge, Guest]) -> None:
    bridge, guest = pair
    guest.send(M_OPEN, 7)
    guest.send(M_OPEN, 8)
    # the echo answers what fits; the rest the bridge must hold. Beyond the window: CLOSE
    for _ in range(UP_WINDOW // CHUNK + 64):
        guest.send(M_DATA, 7, b"x" * CHUNK)
    guest.until(M_CLOSE, 7)
    assert 7 not in bridge._conns
    guest.send(M_DATA, 8, b"still here")
    guest.send(M_EOF, 8)
    assert guest.until(M_EOF, 8) == b"still here"


def test_too_many_connections_are_refused(pair: tuple[EgressBridge, Guest]) -> None:
    bridge, guest = pair
    for conn in range(1, MAX_CONNECTIONS + 2):
        guest.send(M_OPEN, conn)
    assert guest.until(M_CLOSE, MAX_CONNECTIONS + 1) == b""
    assert len(bridge._conns) == MAX_CONNECTIONS


def test_a_guest_that_reads_nothing_is_not_served_past_a_bounded_queue(pair: tuple[EgressBridge, Guest]) -> None:
    """A guest root that stops its relay and repeats OPEN (each answered by a CLOSE it never reads)
    grew the bridge's queue by 10 MB/s: past OUTQ_PORT_HIGH the port is no longer read."""
    bridge, guest = pair
    guest.send(M_OPEN, 7)
    flood = HEADER.pack(M_OPEN, 7, 0) * 4096  # each a second OPEN of 7: refused with CLOSE
    guest.sock.setblocking(False)
    sent, most, start, at = 0, 0, time.monotonic(), 0
    while time.monotonic() - start < 3.0 and sent < 256 << 20:
        try:
            n = guest.sock.send(flood[at:])  # (whole frames: a partial send goes on where it stopped)
            sent, at = sent + n, (at + n) % len(flood)
        except BlockingIOError:
            time.sleep(0.01)  # the bridge stopped reading: nothing more goes
        most = max(most, len(bridge._outq))
    time.sleep(0.2)
    most = max(most, len(bridge._outq))
    bound = 3 << 20  # the module's docstring: about 2.4 MiB
    assert most <= bound, f"{most} bytes queued for a guest that reads nothing ({sent} bytes sent)"
    assert sent < 64 << 20  # the guest's writes were held back, not all answered
    # a guest that reads again is served again: every CLOSE arrives, then a new connection works
    guest.sock.settimeout(10)
    rest = flood[at:at + (-at) % HEADER.size]  # the end of a frame cut by a partial send

    def send_more() -> None:
        guest.sock.sendall(rest)
        guest.send(M_OPEN, 8)
        guest.send(M_DATA, 8, b"after")

    sender = threading.Thread(target=send_more)
    sender.start()  # (its writes go as the reads below let the bridge read again)
    assert guest.until(M_DATA, 8) == b"after"
    sender.join(10)


def test_an_oversized_frame_ends_the_bridge_and_close_leaves_nothing(echo: Path) -> None:
    host, guest_sock = socket.socketpair()
    bridge = EgressBridge("sb-test", host, echo)
    guest = Guest(guest_sock)
    guest.send(M_OPEN, 1)
    guest.sock.sendall(HEADER.pack(M_DATA, 1, CHUNK + 1))
    with pytest.raises(EOFError):  # the bridge closed the port: QEMU would drop the guest's side
        while True:
            guest.frame()
    bridge._thread.join(5)
    assert not bridge._thread.is_alive()
    assert host.fileno() == -1 and not bridge._conns
    bridge.close()  # idempotent after the thread ended by itself
    guest_sock.close()


def test_close_ends_the_thread_and_every_socket(pair: tuple[EgressBridge, Guest]) -> None:
    bridge, guest = pair
    guest.send(M_OPEN, 1)
    guest.send(M_DATA, 1, b"ping")
    assert guest.frame() == (M_DATA, 1, b"ping")
    conns = list(bridge._conns.values())
    bridge.close()
    assert not bridge._thread.is_alive()
    assert all(conn.sock.fileno() == -1 for conn in conns)
    assert [t for t in threading.enumerate() if t.name == "egress-vm-sb-test"] == []


def test_a_stream_the_owner_has_no_descriptor_for_is_closed_and_the_bridge_goes_on(
        pair: tuple[EgressBridge, Guest]) -> None:
    """The owner's descriptors are shared by all its sandboxes: another one holding tunnels can
    use them up for a while.  An EMFILE opening one guest stream's proxy connection ended the
    bridge's thread, and that VM's egress for good; now that stream gets CLOSE and the others,
    and later ones once descriptors are free, are carried."""
    bridge, guest = pair
    guest.send(M_OPEN, 1)
    guest.send(M_DATA, 1, b"before")
    assert guest.until(M_DATA, 1) == b"before"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    # garbage of earlier tests (sockets) closes its descriptors when collected: collected now, not
    # while they are all taken (one freed then let the bridge connect stream 2)
    gc.collect()
    try:
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 32, hard))
        with pytest.raises(OSError):  # (bounded: every number below the new limit taken)
            for _ in range(top + 33):
                fillers.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        guest.send(M_OPEN, 2)
        assert guest.until(M_CLOSE, 2) == b""
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert bridge._thread.is_alive()
    guest.send(M_OPEN, 3)
    guest.send(M_DATA, 3, b"after")
    assert guest.until(M_DATA, 3) == b"after"
    guest.send(M_DATA, 1, b"still")
    assert guest.until(M_DATA, 1) == b"beforestill"


def _wait(predicate: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_bridge_connections_count_against_the_owners_tunnel_budget(
        pair: tuple[EgressBridge, Guest], echo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each connection to the proxy is one of the owner's descriptors: uncounted, a guest could
    make the owner hold MAX_CONNECTIONS of them past the budget (24 -> 280 in the probe)."""
    bridge, guest = pair
    before = OWNER_TUNNELS.held
    for conn in (1, 2, 3):
        guest.send(M_OPEN, conn)
        guest.send(M_DATA, conn, b"x")
        assert guest.until(M_DATA, conn) == b"x"
    assert OWNER_TUNNELS.held == before + 3
    guest.send(M_CLOSE, 2)
    assert _wait(lambda: OWNER_TUNNELS.held == before + 2)
    # the budget is full: a bridge refuses as the proxy does, and audits it
    monkeypatch.setattr(OWNER_TUNNELS, "limit", lambda: OWNER_TUNNELS.held)
    guest.send(M_OPEN, 4)
    assert guest.until(M_CLOSE, 4) == b""
    assert 4 not in bridge._conns and OWNER_TUNNELS.held == before + 2
    host, other_sock = socket.socketpair()
    audit = AuditLog()
    other = EgressBridge("sb-other", host, echo, audit)
    try:
        Guest(other_sock).send(M_OPEN, 1)
        assert Guest(other_sock).until(M_CLOSE, 1) == b""
        assert [e.rule for e in audit.events()] == ["host-connection-limit"]
    finally:
        other.close()
        other_sock.close()
    bridge.close()
    assert OWNER_TUNNELS.held == before  # what it still held, given back


@pytest.fixture
def refusing(tmp_path: Path) -> Iterator[Path]:
    """A "proxy" that answers 403 and closes; one sent "half" answers, half-closes, and reads on."""
    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            if conn.recv(4096).startswith(b"half"):
                conn.sendall(b"answer")
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(4096):
                    pass
            else:
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\n\r\n")

    with unix_server(tmp_path / "refusing.sock", serve, 64) as path:
        yield path


def test_a_connection_whose_proxy_side_closed_is_dropped_once_the_guest_is_silent(
        refusing: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused CONNECT: the proxy answers 403, closes and gives its tunnel back; the bridge's
    connection stayed open until the guest's client closed, and a client that held its sockets
    open made the owner hold 256 of them.  Now it goes (CLOSE to the guest) after LINGER seconds of
    silence, unless the guest's relay may still hold some of it for a slow client (not all
    credited back) or the proxy only half-closed (it still reads)."""
    monkeypatch.setattr(egress_bridge, "LINGER", 0.3, raising=False)  # (raising: the old code had none)
    host, guest_sock = socket.socketpair()
    bridge = EgressBridge("sb-test", host, refusing)
    guest = Guest(guest_sock)
    before = OWNER_TUNNELS.held
    try:
        # 2: answered and closed, but not credited back (the relay still holds it for its client)
        guest.send(M_OPEN, 2)
        guest.send(M_DATA, 2, b"CONNECT other:80 HTTP/1.1\r\n\r\n")
        got = b""
        while (frame := guest.frame())[:2] != (M_EOF, 2):
            got += frame[2]
        assert got.startswith(b"HTTP/1.1 403")
        # 3: the proxy half-closed only; 1: refused, all credited (Guest.until does)
        guest.send(M_OPEN, 3)
        guest.send(M_DATA, 3, b"half")
        assert guest.until(M_EOF, 3) == b"answer"
        guest.send(M_OPEN, 1)
        guest.send(M_DATA, 1, b"CONNECT other:80 HTTP/1.1\r\n\r\n")
        assert guest.until(M_EOF, 1).startswith(b"HTTP/1.1 403")
        eof_at = time.monotonic()
        guest.sock.settimeout(3)  # (the old code never sent it: socket.timeout)
        guest.until(M_CLOSE, 1)
        assert time.monotonic() - eof_at >= 0.25  # not before the grace
        assert _wait(lambda: 1 not in bridge._conns)
        assert OWNER_TUNNELS.held == before + 2
        time.sleep(1.0)  # three more graces: the other two stay
        assert sorted(bridge._conns) == [2, 3]
        assert bridge._conns[2].window < DOWN_WINDOW
        # the relay passes the rest on and credits it: then 2 goes too; 3 ends as before
        guest.send(M_CREDIT, 2, struct.pack("<I", DOWN_WINDOW - bridge._conns[2].window))
        guest.until(M_CLOSE, 2)
        guest.send(M_EOF, 3)
        assert _wait(lambda: not bridge._conns)
        assert OWNER_TUNNELS.held == before
    finally:
        bridge.close()
        guest_sock.close()


def _thread_cpu(thread: threading.Thread) -> float:
    """Seconds of CPU ``thread`` (of this process) has used."""
    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_guest_flooding_opens_is_held_to_the_connection_rate(echo: Path) -> None:
    """A guest (root: it may speak on the port itself) that opens and closes connections as fast
    as it can cost the bridge a socket and a connect to the proxy each, at whatever rate it
    sent them (2,800-4,300 in 3 s here, the bridge's thread 1.6 s busy; the stand-in proxy's
    threads, in this process, took the rest).  Now an OPEN past the
    sandbox's connection rate waits unread in the port, as the proxy's own connections wait in
    its queue: a bounded number are opened, at a bounded cost, and the audit sums them up."""
    from corral.egress.tunnel import CONNECTION_BURST, CONNECTION_RATE

    host, guest_sock = socket.socketpair()
    audit = AuditLog()
    bridge = EgressBridge("sb-rate", host, echo, audit)
    stop = threading.Event()

    def flood() -> None:
        ids = iter(range(1, 1 << 30))
        with contextlib.suppress(OSError):  # (the port closes under a blocked write at the end)
            while not stop.is_set():
                guest_sock.sendall(b"".join(HEADER.pack(M_OPEN, i, 0) + HEADER.pack(M_CLOSE, i, 0)
                                            for i in (next(ids) for _ in range(64))))

    def drain() -> None:  # the guest reads what the bridge says (EOF and CLOSE of the echoes)
        with contextlib.suppress(OSError):
            while guest_sock.recv(1 << 16):
                pass

    threads = [threading.Thread(target=flood), threading.Thread(target=drain)]
    cpu_before, start = _thread_cpu(bridge._thread), time.monotonic()
    for t in threads:
        t.start()
    try:
        time.sleep(3.0)
        opened, seconds = bridge.opened, time.monotonic() - start
        cpu = _thread_cpu(bridge._thread) - cpu_before
    finally:
        stop.set()
        bridge.close()
        guest_sock.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(10)
        guest_sock.close()
    assert opened <= CONNECTION_BURST + CONNECTION_RATE * seconds, opened
    assert opened >= CONNECTION_BURST  # (the burst is served at once)
    assert cpu < 0.5, f"the bridge's thread used {cpu:.2f} s of CPU in {seconds:.1f} s ({opened} opened)"
    held = [e for e in audit.events() if e.kind == "rate-limited"]
    assert [(e.rule, e.protocol) for e in held] == [("connection-rate", "proxy")], held
    # how many waited depends on the load: a thread that wakes late finds the tokens of the time
    # it slept and lets that many through unheld (a CI run with the suite beside it: 409 of 1,270,
    # against 630 past the burst); a quarter of them at least, never more than were opened
    assert (opened - CONNECTION_BURST) * 0.25 <= int(held[0].destination.split()[0]) <= opened
