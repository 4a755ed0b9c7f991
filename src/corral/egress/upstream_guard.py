"""The kernel's backstop behind the egress proxy: its connections never reach the host or a refused range.

The proxy decides on an address, then the host's kernel routes and may rewrite it: a ``local``
route in a table a mark or a source address selects (the transparent-proxy recipe), a NAT in a
conntrack zone, a stateless rewrite that conntrack never sees, an eBPF load balancer.  The proxy
asks the kernel what it can (``host/conntrack.py``: the route, conntrack's reply), but cannot
predict all of it.  So every upstream socket of a proxy whose policy re-enables no range is made
under :data:`UPSTREAM_UID` (the thread's file-system uid for the ``socket()`` call alone: the
socket's owner, which no rule of the host can change, where a packet mark can be overwritten), and
one host-wide table rejects such a packet in the output hook *after* NAT and re-routing (priority
1000: after every NAT, mangle and route chain) when it leaves by ``lo`` (it stays on the host) or
for a refused range (``policy.REFUSED_RANGES``).  The connection then fails (``EHOSTUNREACH`` /
``EACCES`` at once; after a stateless rewrite, whose rejection names a connection the socket does
not know, at the connect timeout): a 502 from the proxy, as for an unreachable host.

The table is static (the same for every sandbox and every Corral process, loaded whole in one
transaction, so concurrent loads agree) and touches only that uid's packets: like the host-wide
settings of ``host/shared_tables.py`` it stays once loaded.  A policy with ``unsafe_allow_ranges``
(the operator's own) is not guarded so: the proxy's own checks are its only ones.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import threading

from ..errors import HostNotSupported
from ..host.netns import nft_load
from ..host.uids import UID_TOP
from .policy import REFUSED_RANGES

#: the owner of the proxy's guarded upstream sockets: the last id below systemd's "foreign" range
#: (``host/uids.py``), the top of the pool's last slot -- id 65,535 inside that slot's sandbox, an
#: id nothing is given -- whose sockets are never made in the host's namespace by anything else
UPSTREAM_UID = UID_TOP - 1
TABLE = "corral_upstream"

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: bool | None = None


def ruleset() -> str:
    guarded = f"meta skuid {UPSTREAM_UID}"
    reject = "counter reject with icmpx type admin-prohibited"
    sets = []
    for name, kind, version in (("refused4", "ipv4_addr", 4), ("refused6", "ipv6_addr", 6)):
        ranges = ", ".join(str(net) for net, _ in REFUSED_RANGES if net.version == version)
        sets.append(f"  set {name} {{ type {kind}; flags interval; auto-merge; elements = {{ {ranges} }} }}")
    return "\n".join([
        f"table inet {TABLE} {{}}",
        f"flush table inet {TABLE}",
        f"table inet {TABLE} {{",
        *sets,
        # after NAT, mangle and route chains: refused at once (the route asked with the packet's
        # mark, as a mark-selected table sends it: the transparent-proxy recipe)
        "  chain output {",
        "    type filter hook output priority 1000; policy accept;",
        f"    {guarded} fib daddr . mark type {{ local, broadcast, anycast, multicast }} {reject}",
        f"    {guarded} ip daddr @refused4 {reject}",
        f"    {guarded} ip6 daddr @refused6 {reject}",
        "  }",
        # the last word, where the device a packet leaves by is the one routing gave it at last
        # (the output hook sees the device of the first route): dropped, as reject cannot be here
        "  chain postrouting {",
        "    type filter hook postrouting priority 1000; policy accept;",
        f'    {guarded} oifname "lo" counter drop',
        f"    {guarded} ip daddr @refused4 counter drop",
        f"    {guarded} ip6 daddr @refused6 counter drop",
        "  }",
        "}",
    ]) + "\n"


def ensure_loaded() -> bool:
    """Load the table (once a process); False where it cannot be (no nftables: the proxy's own
    checks then stand alone, and a warning says so)."""
    global _loaded
    with _lock:
        if _loaded is None and os.geteuid() != 0:
            _loaded = False  # (its sockets' owner is taken with setfsuid, root's to give)
        if _loaded is None:
            try:
                nft_load(ruleset())
                _loaded = True
            except (HostNotSupported, OSError) as exc:
                log.warning("egress: the kernel backstop for the proxy's connections is not loaded: %s", exc)
                _loaded = False
        return _loaded


_libc = ctypes.CDLL(None, use_errno=True)


def guarded_socket(family: int) -> socket.socket:
    """A TCP socket owned by :data:`UPSTREAM_UID`: made while this thread's file-system uid is it
    (a per-thread id: the process's other threads keep theirs), then back to root's."""
    before = _libc.setfsuid(UPSTREAM_UID)
    try:
        if _libc.setfsuid(UPSTREAM_UID) != UPSTREAM_UID:  # (it answers the id it had: this one now)
            raise OSError(errno.EPERM, "egress: cannot take the upstream uid")
        return socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    finally:
        _libc.setfsuid(before)
