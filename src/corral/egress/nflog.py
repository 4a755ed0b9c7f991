"""Per-attempt audit of packets our nftables rules refuse: an NFLOG (nfnetlink_log) listener.

Each refusing rule is preceded by ``limit name "audit" log group G prefix "<tag> <rule> ..."``.
The kernel then sends every logged packet to whoever bound group G, as a netlink
message carrying the prefix and the first bytes of the packet.  This module binds
a group, parses those messages and records one :class:`AuditEvent` per packet.

Why our own parser: the PyPI bindings (``nflog`` 2016, ``nflogr``, self-described
beta) wrap libnetfilter_log through C and are not maintained; the protocol
needed here is four message types, and parsing it in Python keeps the
dependency list and the build unchanged.

Groups are per network namespace.  In the host's namespace (``open`` mode) they
are shared with every other program and sandbox, so a group is allocated by
binding random candidates until the kernel accepts one (for a group someone
else holds it answers EPERM, or EBUSY/EEXIST on other code paths).  The kernel releases the
group when the socket closes, including when the owner is killed.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import random
import select
import socket
import struct
import threading
from dataclasses import dataclass

from ..host.netlink import NLMSG_ERROR, attr, message
from .audit import AuditLog

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET = 0
NFULNL_MSG_CONFIG = 1
# config attributes and commands (linux/netfilter/nfnetlink_log.h)
NFULA_CFG_CMD, NFULA_CFG_MODE, NFULA_CFG_NLBUFSIZ, NFULA_CFG_TIMEOUT, NFULA_CFG_QTHRESH = 1, 2, 3, 4, 5
NFULNL_CFG_CMD_BIND = 1
NFULNL_COPY_PACKET = 2
# packet attributes
NFULA_PAYLOAD, NFULA_PREFIX = 9, 10

#: bytes of each packet copied to us: an IPv6 header, a few extension headers and the ports
COPY_RANGE = 128
#: groups tried in the host namespace; low numbers are left to ulogd and hand-written rules
GROUP_RANGE = (20_000, 65_535)
#: what the kernel may buffer for us; beyond it messages are lost (counted, see ``lost``)
RCVBUF = 1 << 20

#: log messages per sandbox (all its rules together): a flood of refused packets cannot grow the
#: audit log without bound.  Only the *logging* is limited; every packet is still refused.
LOG_RATE = "20/second burst 50 packets"
LIMIT_NAME = "audit"

PROTOCOLS = {1: "icmp", 2: "igmp", 6: "tcp", 17: "udp", 58: "icmpv6", 132: "sctp"}
#: IPv6 extension headers to skip to reach the transport header
IPV6_EXTENSIONS = {0, 43, 60}
IPV6_FRAGMENT = 44


@dataclass(frozen=True)
class Refused:
    """One logged packet: the prefix our rule gave it, and what the packet was going to."""

    prefix: str
    protocol: str
    address: str
    port: int | None

    @property
    def destination(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}" if self.port is not None else self.address


def limit_object() -> str:
    """The table's named limit that every log statement shares."""
    return f"  limit {LIMIT_NAME} {{ rate {LOG_RATE} }}"


def log_statement(group: int, tag: str, label: str) -> str:
    """The statement a rule carries before the rule that refuses: ``label`` is the refusing
    rule's comment, so :meth:`NflogListener.unlogged` can compare it with that rule's counter.
    A rule whose limit is exceeded ends there, which is why the refusal is a rule of its own."""
    return f'limit name "{LIMIT_NAME}" log group {group} prefix "{tag} {label} "'


def _attrs(data: bytes) -> dict[int, bytes]:
    """Netlink attributes (type -> payload); the nested flag bits are masked off."""
    out: dict[int, bytes] = {}
    offset = 0
    while offset + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, offset)
        if length < 4 or offset + length > len(data):
            break
        out[kind & 0x3FFF] = data[offset + 4:offset + length]
        offset += (length + 3) & ~3
    return out


def parse_packet(packet: bytes) -> tuple[str, str, int | None] | None:
    """(protocol, destination address, destination port or None) of an IP packet's first bytes."""
    if not packet:
        return None
    version = packet[0] >> 4
    if version == 4 and len(packet) >= 20:
        header = (packet[0] & 0x0F) * 4
        proto = packet[9]
        address = str(ipaddress.IPv4Address(packet[16:20]))
        # only the first fragment carries the transport header
        first_fragment = struct.unpack_from("!H", packet, 6)[0] & 0x1FFF == 0
        transport = packet[header:] if first_fragment else b""
    elif version == 6 and len(packet) >= 40:
        proto = packet[6]
        address = str(ipaddress.IPv6Address(packet[24:40]))
        offset = 40
        while proto in IPV6_EXTENSIONS and offset + 8 <= len(packet):
            proto, offset = packet[offset], offset + (packet[offset + 1] + 1) * 8
        if proto == IPV6_FRAGMENT and offset + 8 <= len(packet):
            later = struct.unpack_from("!H", packet, offset + 2)[0] & 0xFFF8
            proto, offset = packet[offset], offset + 8
            transport = b"" if later else packet[offset:]
        else:
            transport = packet[offset:]
    else:
        return None
    name = PROTOCOLS.get(proto, f"ip-proto-{proto}")
    port = struct.unpack_from("!H", transport, 2)[0] if proto in (6, 17, 132) and len(transport) >= 4 else None
    return name, address, port


def parse_messages(data: bytes) -> tuple[list[Refused], list[int]]:
    """Packets and netlink error codes (0 = ack) in one datagram from the socket."""
    packets: list[Refused] = []
    errors: list[int] = []
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16 or offset + length > len(data):
            break
        body = data[offset + 16:offset + length]
        if kind == NLMSG_ERROR and len(body) >= 4:
            errors.append(-struct.unpack_from("=i", body)[0])
        elif kind == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET and len(body) >= 4:
            attrs = _attrs(body[4:])  # after the nfgenmsg header (family, version, group)
            parsed = parse_packet(attrs.get(NFULA_PAYLOAD, b""))
            prefix = attrs.get(NFULA_PREFIX, b"").split(b"\0", 1)[0].decode("ascii", "replace")
            if parsed is not None:
                packets.append(Refused(prefix, *parsed))
        offset += (length + 3) & ~3
    return packets, errors


def _config(group: int, seq: int, *attrs: tuple[int, bytes]) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(group)) + b"".join(attr(k, v) for k, v in attrs)
    return message((NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG, 0, seq, body)


class NflogListener:
    """One bound NFLOG group, turned into audit events by one thread; :meth:`close` ends both.

    Create it in the network namespace whose rules log to it (a netlink socket
    belongs to the namespace of the thread that created it).  A message whose
    prefix does not start with ``tag`` is ignored: in the host's namespace a
    stale table of a dead owner could still name the group we were given.
    """

    def __init__(self, sandbox_id: str, log: AuditLog, tag: str, group: int | None = None) -> None:
        self.sandbox_id = sandbox_id
        self.tag = tag
        self._log = log
        self._lock = threading.Lock()  # one reader at a time: the thread, or drain()
        #: packets the kernel could not queue for us (socket buffer full)
        self.lost = 0
        #: events recorded per label (rule comment); the counters tell how many were not logged
        self.logged: dict[str, int] = {}
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._seq = 0
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            self._sock.bind((0, 0))
            self._sock.settimeout(5)
            self.group = self._bind(group)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise

    def _request(self, group: int, *attrs: tuple[int, bytes]) -> int:
        self._seq += 1
        self._sock.send(_config(group, self._seq, *attrs))
        while True:
            _, errors = parse_messages(self._sock.recv(65536))
            if errors:
                return errors[0]

    def _bind(self, group: int | None) -> int:
        candidates = [group] if group is not None else random.sample(range(*GROUP_RANGE), 64)
        for candidate in candidates:
            code = self._request(candidate, (NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_BIND])))
            # someone else's group: EPERM (bound by another socket: what 6.18 answered here),
            # EBUSY or EEXIST (other kernel versions' code paths, and a race between two binds)
            if code in (errno.EPERM, errno.EBUSY, errno.EEXIST) and group is None:
                continue
            if code:
                raise OSError(code, f"NFLOG bind of group {candidate}: {os.strerror(code)}")
            # copy the packet's first bytes; deliver each message at once (the default
            # batches up to 100 of them or 1 s, so audit() would lag behind the refusal)
            for setting in ((NFULA_CFG_MODE, struct.pack("!IBB", COPY_RANGE, NFULNL_COPY_PACKET, 0)),
                            (NFULA_CFG_QTHRESH, struct.pack("!I", 1)), (NFULA_CFG_TIMEOUT, struct.pack("!I", 0))):
                code = self._request(candidate, setting)
                if code:
                    raise OSError(code, f"NFLOG config of group {candidate}: {os.strerror(code)}")
            return candidate
        raise OSError(errno.EBUSY, "no free NFLOG group for the sandbox's audit log (64 tried; "
                      "EPERM for all of them would also mean this process lacks CAP_NET_ADMIN)")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"nflog-{self.sandbox_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._wake_r in ready or not self.drain():
                return

    def drain(self) -> bool:
        """Record every message already queued (audit() calls this so it never lags the kernel).

        False if the socket is closed or failed: the thread then stops rather than spin."""
        with self._lock:
            if self._sock.fileno() < 0:
                return False
            while True:
                try:
                    data = self._sock.recv(65536)
                except BlockingIOError:
                    return True
                except OSError as exc:
                    if exc.errno == errno.ENOBUFS:  # the kernel dropped messages; the counters show them
                        self.lost += 1
                        continue
                    return False
                for packet in parse_messages(data)[0]:
                    self._record(packet)

    def _record(self, packet: Refused) -> None:
        parts = packet.prefix.split()
        if len(parts) < 2 or parts[0] != self.tag:
            return
        rule, label = parts[1], " ".join(parts[1:])
        self.logged[label] = self.logged.get(label, 0) + 1
        self._log.record(self.sandbox_id, "refused", packet.destination, packet.address, rule, packet.protocol)

    def unlogged(self, counters: dict[str, int]) -> list[tuple[str, int]]:
        """(label, packets) refused but not logged: over the rate limit, or lost by the kernel.

        Read the counters *before* calling this: it drains first, so a packet
        counted a moment ago has had its message recorded too."""
        self.drain()
        with self._lock:
            return [(label, n - self.logged.get(label, 0)) for label, n in counters.items()
                    if n > self.logged.get(label, 0)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            self._sock.close()  # the kernel unbinds the group with it
        os.close(self._wake_r)
        os.close(self._wake_w)
