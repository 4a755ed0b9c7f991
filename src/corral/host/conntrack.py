"""Where the host's kernel really sent a connection, and how it routes an address.

The egress proxy checks a destination before it connects, but the host may still deliver the
connection elsewhere: a ``local`` route for an address on no interface (AnyIP, a cloud's
forwarded load-balancer address) hands it to the host's own services, and a NAT rule on the
host's output path (kube-proxy's external and load-balancer addresses, a transparent redirect)
rewrites it to an internal one.  :func:`route_type` asks the kernel (``RTM_GETROUTE``) what a
destination's route is; :func:`nat_destination` asks conntrack (``IPCTNL_MSG_CT_GET``) where a
connected socket's packets really go.  :func:`delete_flows_of` deletes (``IPCTNL_MSG_CT_DELETE``)
what the host's table still tracks of a destroyed ``open`` sandbox's address.  Raw netlink, like :mod:`corral.host.rtnl`: each answer
costs tens of microseconds, where running ``ip`` or ``conntrack`` would cost milliseconds.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from .netlink import HEADER, NLM_F_ACK, NLM_F_REQUEST, NLMSG_ERROR, attr

NETLINK_NETFILTER = 12
RTM_GETROUTE = 26
RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags
RTA_DST = 1
#: route types (linux/rtnetlink.h) that deliver to the host itself or to many: never a destination
RTN_LOCAL, RTN_BROADCAST, RTN_ANYCAST, RTN_MULTICAST = 2, 3, 4, 5
HOST_ROUTE_TYPES = {RTN_LOCAL: "local", RTN_BROADCAST: "broadcast", RTN_ANYCAST: "anycast",
                    RTN_MULTICAST: "multicast"}

IPCTNL_MSG_CT_GET = (1 << 8) | 1  # NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_GET
IPCTNL_MSG_CT_DELETE = (1 << 8) | 2
NLM_F_DUMP = 0x300
NLMSG_DONE = 3
NFGENMSG = struct.Struct("=BBH")  # family, version, resource id
CTA_ID, CTA_ZONE, CTA_FILTER = 12, 18, 25
CTA_FILTER_ORIG_FLAGS, CTA_FILTER_REPLY_FLAGS = 1, 2
CTA_FILTER_FLAG_IP_SRC = 1 << 0
NLA_F_NESTED = 0x8000
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY = 1, 2
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3

#: present while the kernel tracks connections; without conntrack there is no NAT to look through
CONNTRACK_TABLE = Path("/proc/net/nf_conntrack")


def _ask(protocol: int, kind: int, body: bytes) -> bytes | None:
    """The body of the answer to one netlink request (no acknowledgement asked), or None for an
    answer that there is none (no such entry, no route)."""
    request = HEADER.pack(HEADER.size + len(body), kind, NLM_F_REQUEST, 1, 0) + body
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, protocol) as sock:
        sock.settimeout(2)
        sock.send(request)
        data = sock.recv(65536)
    length, answer, _, _, _ = HEADER.unpack_from(data)
    if answer == NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, HEADER.size)[0]
        if code in (errno.ENOENT, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EINVAL):
            return None
        raise OSError(code, f"netlink request {kind}: {errno.errorcode.get(code, code)}")
    return data[HEADER.size:length]


def _attributes(data: bytes) -> dict[int, bytes]:
    found, offset = {}, 0
    while offset + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, offset)
        if length < 4:
            break
        found[kind & ~NLA_F_NESTED] = data[offset + 4:offset + length]
        offset += (length + 3) & ~3
    return found


def route_type(address: str) -> str | None:
    """``local``, ``broadcast``, ``anycast`` or ``multicast`` when the host's route for ``address``
    is of that type (it would not leave the host, or would reach many), else None (a unicast route,
    or none at all: connecting then fails by itself)."""
    ip = ipaddress.ip_address(address)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    body = RTMSG.pack(family, ip.max_prefixlen, 0, 0, 0, 0, 0, 0, 0) + attr(RTA_DST, ip.packed)
    answer = _ask(socket.NETLINK_ROUTE, RTM_GETROUTE, body)
    if answer is None:
        return None
    return HOST_ROUTE_TYPES.get(RTMSG.unpack_from(answer)[7])


def nat_destination(sock: socket.socket) -> str | None:
    """The address a connected TCP socket's packets really reach when the host's NAT rewrote its
    destination, or None when it did not (or the kernel tracks no connections)."""
    if not CONNTRACK_TABLE.exists():
        return None
    local, remote = sock.getsockname(), sock.getpeername()
    ip = ipaddress.ip_address(remote[0])
    family, src_kind, dst_kind = ((socket.AF_INET6, CTA_IP_V6_SRC, CTA_IP_V6_DST) if ip.version == 6 else
                                  (socket.AF_INET, CTA_IP_V4_SRC, CTA_IP_V4_DST))
    tuple_ip = attr(src_kind, ipaddress.ip_address(local[0]).packed) + attr(dst_kind, ip.packed)
    tuple_proto = (attr(CTA_PROTO_NUM, bytes([socket.IPPROTO_TCP])) + attr(CTA_PROTO_SRC_PORT, struct.pack("!H", local[1]))
                   + attr(CTA_PROTO_DST_PORT, struct.pack("!H", remote[1])))
    orig = attr(CTA_TUPLE_IP | NLA_F_NESTED, tuple_ip) + attr(CTA_TUPLE_PROTO | NLA_F_NESTED, tuple_proto)
    body = struct.pack("=BBH", family, 0, 0) + attr(CTA_TUPLE_ORIG | NLA_F_NESTED, orig)
    answer = _ask(NETLINK_NETFILTER, IPCTNL_MSG_CT_GET, body)
    if answer is None:
        return None  # not tracked: nothing rewrote it
    reply = _attributes(_attributes(answer[4:]).get(CTA_TUPLE_REPLY, b""))
    source = _attributes(reply.get(CTA_TUPLE_IP, b"")).get(src_kind)
    if source is None:
        return None
    # the reply comes from where the connection really went: its source is the real destination
    real = ipaddress.ip_address(source)
    return None if real == ip else str(real)


@dataclass(frozen=True)
class _Flow:
    """One entry as the kernel dumped it: what a delete request must name to hit exactly it."""

    orig_tuple: bytes
    entry_id: bytes | None
    zone: bytes | None


def _tuple_source(tuple_attr: bytes | None) -> bytes | None:
    return _attributes(_attributes(tuple_attr or b"").get(CTA_TUPLE_IP, b"")).get(CTA_IP_V4_SRC)


def _dump(sock: socket.socket, body: bytes) -> list[dict[int, bytes]]:
    """Every entry's top-level attributes in one IPv4 dump of the table."""
    sock.send(HEADER.pack(HEADER.size + len(body), IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + body)
    entries: list[dict[int, bytes]] = []
    while True:
        data, offset = sock.recv(1 << 20), 0
        while offset + HEADER.size <= len(data):
            length, kind, _, _, _ = HEADER.unpack_from(data, offset)
            if kind == NLMSG_DONE:
                return entries
            if kind == NLMSG_ERROR:
                code = -struct.unpack_from("=i", data, offset + HEADER.size)[0]
                raise OSError(code, f"conntrack dump: {errno.errorcode.get(code, code)}")
            entries.append(_attributes(data[offset + HEADER.size + NFGENMSG.size:offset + length]))
            offset += (length + 3) & ~3


def _flows_of(sock: socket.socket, packed: bytes) -> list[_Flow]:
    """The entries whose original source or reply source is ``packed``: every flow the address
    opened (masqueraded or not) and every flow that reached it, whatever NAT rewrote on the way.
    The kernel filters by one tuple's source (``CTA_FILTER``, Linux 5.8+); an older kernel ignores
    the filter and sends the whole table, so the match is made here in every case."""
    found: dict[bytes, _Flow] = {}
    for tuple_kind, flags_kind in ((CTA_TUPLE_ORIG, CTA_FILTER_ORIG_FLAGS), (CTA_TUPLE_REPLY, CTA_FILTER_REPLY_FLAGS)):
        wanted = attr(CTA_TUPLE_IP | NLA_F_NESTED, attr(CTA_IP_V4_SRC, packed))
        body = (NFGENMSG.pack(socket.AF_INET, 0, 0) + attr(tuple_kind | NLA_F_NESTED, wanted)
                + attr(CTA_FILTER | NLA_F_NESTED, attr(flags_kind, struct.pack("=I", CTA_FILTER_FLAG_IP_SRC))))
        try:
            entries = _dump(sock, body)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            entries = _dump(sock, NFGENMSG.pack(socket.AF_INET, 0, 0))  # a kernel that refuses the filter
        for entry in entries:
            if packed in (_tuple_source(entry.get(CTA_TUPLE_ORIG)), _tuple_source(entry.get(CTA_TUPLE_REPLY))):
                orig = entry[CTA_TUPLE_ORIG]
                found[orig] = _Flow(orig, entry.get(CTA_ID), entry.get(CTA_ZONE))
    return list(found.values())


def delete_flows_of(address: str) -> int:
    """Delete every entry of the host's conntrack table the IPv4 ``address`` is an end of; return
    how many were deleted.  For an ``open`` sandbox's address once nothing of it runs any more:
    its gVisor or VM guest never closed its connections (the host's table kept them ESTABLISHED,
    5 days), and a later sandbox given the same address would receive their remote side's packets.
    Each entry is deleted by its exact tuple and id (never a flush: an unknown filter attribute
    makes an older kernel's flush delete the whole table)."""
    if not CONNTRACK_TABLE.exists():
        return 0
    packed = ipaddress.IPv4Address(address).packed
    deleted = 0
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER) as sock:
        sock.settimeout(5)
        for sequence, flow in enumerate(_flows_of(sock, packed), start=2):
            body = NFGENMSG.pack(socket.AF_INET, 0, 0) + attr(CTA_TUPLE_ORIG | NLA_F_NESTED, flow.orig_tuple)
            if flow.entry_id is not None:  # the same tuple made again since the dump is not ours to delete
                body += attr(CTA_ID, flow.entry_id)
            if flow.zone is not None:
                body += attr(CTA_ZONE, flow.zone)
            sock.send(HEADER.pack(HEADER.size + len(body), IPCTNL_MSG_CT_DELETE, NLM_F_REQUEST | NLM_F_ACK,
                                  sequence, 0) + body)
            answer = sock.recv(65536)
            code = -struct.unpack_from("=i", answer, HEADER.size)[0]
            if code == 0:
                deleted += 1
            elif code != errno.ENOENT:  # ENOENT: it timed out or closed meanwhile
                raise OSError(code, f"conntrack delete: {errno.errorcode.get(code, code)}")
    return deleted
