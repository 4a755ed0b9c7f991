"""The few rtnetlink requests ``allow`` and ``open`` modes' namespaces need, without running ``ip``.

Each ``ip`` run costs 2-3 ms of fork and exec on this loaded host, on every
such sandbox's create; these requests cost microseconds.  Only what is
needed: bring an interface up, add an address, add a default route through an
interface or a gateway, create a veth pair whose peer is in another namespace,
create a bridge and put an interface in it (the microVM's tap).
Like every netlink socket, this one acts in the network namespace of the
thread that opens it.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct

from .netlink import NLMSG_ERROR, attr, message

NLM_F_EXCL, NLM_F_CREATE = 0x200, 0x400
RTM_NEWLINK, RTM_DELLINK, RTM_NEWADDR, RTM_NEWROUTE = 16, 17, 20, 24
IFF_UP = 0x1
IFA_ADDRESS, IFA_LOCAL = 1, 2
IFA_F_NODAD = 0x02
RTA_GATEWAY, RTA_OIF = 5, 4
IFLA_IFNAME, IFLA_MASTER, IFLA_LINKINFO, IFLA_NET_NS_FD = 3, 10, 18, 28
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
RT_TABLE_MAIN, RTPROT_BOOT, RTN_UNICAST = 254, 3, 1
RT_SCOPE_UNIVERSE, RT_SCOPE_LINK = 0, 253
LOOPBACK_INDEX = 1  # lo is always interface 1 of a namespace


class Rtnl:
    """One rtnetlink socket; every request waits for the kernel's acknowledgement."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
        self._sock.bind((0, 0))
        self._sock.settimeout(5)
        self._seq = 0

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()

    def _request(self, kind: int, flags: int, body: bytes) -> None:
        self._seq += 1
        self._sock.send(message(kind, flags, self._seq, body))
        while True:
            data = self._sock.recv(65536)
            offset = 0
            while offset + 16 <= len(data):
                length, msg_type, _, seq, _ = struct.unpack_from("=IHHII", data, offset)
                if msg_type == NLMSG_ERROR and seq == self._seq:
                    code = -struct.unpack_from("=i", data, offset + 16)[0]
                    if code:
                        raise OSError(code, f"rtnetlink request {kind}: {os.strerror(code)}")
                    return
                offset += max((length + 3) & ~3, 16)

    def link_up(self, index: int = LOOPBACK_INDEX) -> None:
        self._request(RTM_NEWLINK, 0, IFINFOMSG.pack(socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP))

    def delete_link(self, name: str) -> bool:
        """Delete an interface by name (a veth: both ends); False if there is none."""
        body = IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + attr(IFLA_IFNAME, name.encode() + b"\0")
        try:
            self._request(RTM_DELLINK, 0, body)
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                return False
            raise
        return True

    def add_veth(self, name: str, peer: str, peer_netns_fd: int) -> None:
        """A veth pair: ``name`` here, ``peer`` in the namespace of ``peer_netns_fd``
        (``ip link add NAME type veth peer name PEER netns NS``)."""
        peer_info = IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + attr(IFLA_IFNAME, peer.encode() + b"\0") + \
            attr(IFLA_NET_NS_FD, struct.pack("=I", peer_netns_fd))
        info = attr(IFLA_INFO_KIND, b"veth") + attr(IFLA_INFO_DATA, attr(VETH_INFO_PEER, peer_info))
        body = IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + attr(IFLA_IFNAME, name.encode() + b"\0") + \
            attr(IFLA_LINKINFO, info)
        self._request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body)

    def add_address(self, cidr: str, index: int = LOOPBACK_INDEX) -> None:
        iface = ipaddress.ip_interface(cidr)
        family = socket.AF_INET if iface.version == 4 else socket.AF_INET6
        flags = IFA_F_NODAD if iface.version == 6 else 0  # no duplicate detection: nothing else is there
        body = struct.pack("=BBBBI", family, iface.network.prefixlen, flags, RT_SCOPE_UNIVERSE, index)
        body += attr(IFA_LOCAL, iface.ip.packed) + attr(IFA_ADDRESS, iface.ip.packed)
        self._request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body)

    def add_default_route(self, version: int, index: int = LOOPBACK_INDEX) -> None:
        """A default route through an interface, no gateway (``ip route add default dev X``)."""
        family = socket.AF_INET if version == 4 else socket.AF_INET6
        scope = RT_SCOPE_LINK if version == 4 else RT_SCOPE_UNIVERSE  # what ip chooses without a gateway
        body = struct.pack("=BBBBBBBBI", family, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, scope, RTN_UNICAST, 0)
        body += attr(RTA_OIF, struct.pack("=I", index))
        self._request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body)

    def add_default_route_via(self, gateway: str, index: int) -> None:
        """An IPv4 default route through a gateway (``ip route add default via GATEWAY``)."""
        body = struct.pack("=BBBBBBBBI", socket.AF_INET, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_UNIVERSE,
                           RTN_UNICAST, 0)
        body += attr(RTA_GATEWAY, socket.inet_aton(gateway)) + attr(RTA_OIF, struct.pack("=I", index))
        self._request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body)

    def add_bridge(self, name: str) -> int:
        """A bridge (``ip link add NAME type bridge``: STP off, so a port forwards at once); its index."""
        info = attr(IFLA_INFO_KIND, b"bridge")
        body = IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + attr(IFLA_IFNAME, name.encode() + b"\0") + \
            attr(IFLA_LINKINFO, info)
        self._request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body)
        return socket.if_nametoindex(name)

    def set_master(self, index: int, master: int) -> None:
        """Make interface ``index`` a port of bridge ``master`` and bring it up (``ip link set X master B up``)."""
        body = IFINFOMSG.pack(socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP) + attr(IFLA_MASTER, struct.pack("=I", master))
        self._request(RTM_NEWLINK, 0, body)
