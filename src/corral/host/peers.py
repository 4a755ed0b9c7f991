"""Who is at the other end of a loopback TCP connection: the uid owning the client's socket.

TCP has no ``SO_PEERCRED``; the kernel's socket diagnostics (``NETLINK_SOCK_DIAG``, what ``ss``
reads) know every socket's owner. One exact lookup by the connection's four addresses is one
netlink round trip (tens of microseconds), no fork and no walk of ``/proc/net/tcp``.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import threading

from ..errors import InvalidSpec
from .netlink import HEADER, NLM_F_REQUEST, NLMSG_ERROR

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
#: an exact lookup without the socket's cookie
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
#: inet_diag_req_v2: family, protocol, extensions, pad, states, then the socket id
_REQUEST = struct.Struct("=BBBxI")
#: inet_diag_sockid: ports (big-endian), addresses (16 bytes each), interface, cookie
_SOCKID = struct.Struct("!HH16s16s")
_SOCKID_TAIL = struct.Struct("=III")
#: inet_diag_msg up to idiag_uid: family, state, timer, retrans, sockid (48), expires, rqueue, wqueue, uid
_MSG_UID = struct.Struct("=BBBB48xIIII")

_local = threading.local()


def diag_socket() -> socket.socket:
    """A socket for :func:`tcp_peer_uid` lookups, to be used by one thread at a time."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
    sock.settimeout(2)
    return sock


def _thread_diag_socket() -> socket.socket:
    sock: socket.socket | None = getattr(_local, "sock", None)
    if sock is None:
        sock = _local.sock = diag_socket()
    return sock


def _packed(address: str) -> tuple[int, bytes]:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a v4 client of a dual-stack socket is a v4 socket
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    return family, ip.packed.ljust(16, b"\0")


def tcp_peer_uid(client: tuple[str, int], server: tuple[str, int], sock: socket.socket | None = None) -> int | None:
    """The uid owning the socket at ``client`` connected to ``server`` (both on this host, in
    this network namespace), or None if there is no such socket (it closed, or it is not local).
    ``sock``: a :func:`diag_socket` the caller owns (default: one kept for the calling thread)."""
    family, source = _packed(client[0])
    server_family, destination = _packed(server[0])
    if server_family != family:
        return None
    sockid = _SOCKID.pack(client[1], server[1], source, destination) + _SOCKID_TAIL.pack(
        0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + sockid
    if sock is None:
        sock = _thread_diag_socket()
    _local.seq = seq = getattr(_local, "seq", 0) + 1
    sock.send(HEADER.pack(HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body)
    while True:
        data = sock.recv(65536)
        length, kind, _flags, got_seq, _port = HEADER.unpack_from(data)
        if got_seq != seq:
            continue  # an answer to an earlier lookup that timed out
        if kind == NLMSG_ERROR:
            return None  # ENOENT: no such socket
        if kind != SOCK_DIAG_BY_FAMILY or length < HEADER.size + _MSG_UID.size:
            return None
        uid: int = _MSG_UID.unpack_from(data, HEADER.size)[7]
        return uid


def local_uid(user: object, what: str = "local_users") -> int:
    """A user of this host, by name or uid (an int or a digit string): its uid; InvalidSpec naming
    ``what`` otherwise."""
    import pwd

    if isinstance(user, str) and user.isdigit():
        user = int(user)
    if isinstance(user, int) and not isinstance(user, bool) and 0 <= user < 2**32 - 1:
        return user
    if isinstance(user, str) and user:
        try:
            return pwd.getpwnam(user).pw_uid
        except KeyError:
            pass
    raise InvalidSpec(f"{what}: {user!r} is not a user of this host (a name from /etc/passwd, or a uid)")
