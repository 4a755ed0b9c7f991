"""Who a sandbox may talk to: the allowlist and the SSRF ranges that no allowlist opens.

A destination is decided in three steps, always in this order:

1. the name as asked is normalized (``0xa9fea9fe``, ``2852039166``,
   ``0251.0376.0251.0376`` and ``[::ffff:169.254.169.254]`` all become
   ``169.254.169.254``);
2. it must match an allow rule (exact host, ``*.suffix``, IP, CIDR, each with an
   optional port);
3. it is resolved *once*, and the address that will be connected to must lie
   outside every refused range (unless the operator re-enabled that range).

The caller connects to the address returned here, never to the name again, so a
resolver that answers differently the second time (DNS rebinding) gains nothing.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..host.conntrack import route_type
from ..netrules import (
    HOST_RE,
    AllowRule,
    IPAddress,
    IPNetwork,
    embedded_ipv4,
    isatap_ipv4,
    names_loopback,
    normalize_host,
    parse_ip,
)

Resolver = Callable[[str], list[str]]

#: (range, rule name): refused whatever the allowlist says
REFUSED_RANGES: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(net), rule)
    for net, rule in (
        ("0.0.0.0/8", "this-network"),
        ("10.0.0.0/8", "rfc1918"),
        ("100.64.0.0/10", "cgnat"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "rfc1918"),
        ("192.0.0.0/24", "ietf-reserved"),
        ("192.0.2.0/24", "documentation"),
        ("192.88.99.0/24", "6to4-relay"),
        ("192.168.0.0/16", "rfc1918"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::ffff:0:0/96", "ipv4-mapped"),
        # SIIT's IPv4-translated form: a stateless NAT46 on the host's path would carry it to the
        # IPv4 address it holds (Python counts it global; helper 92 reached a metadata stand-in)
        ("::ffff:0:0:0/96", "ipv4-translated"),
        # the rest of ::/8 is reserved, and the well-known NAT64 prefix may carry an IPv4 address at
        # any RFC 6052 length (/32 to /64), which Python counts global (helper 93 reached a
        # metadata stand-in at 64:ff9b:a9fe:a9fe:: and ::ffff:ffff:a9fe:a9fe)
        ("::/8", "ipv6-reserved"),
        ("64:ff9b::/32", "nat64"),
        ("64:ff9b:1::/48", "nat64"),
        ("100::/64", "discard"),
        ("2001:db8::/32", "documentation"),
        ("2002::/16", "6to4"),
        ("fc00::/7", "ipv6-ula"),
        ("fe80::/10", "ipv6-link-local"),
        ("fec0::/10", "ipv6-site-local"),
        ("ff00::/8", "multicast"),
    )
)

def system_resolver(name: str) -> list[str]:
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class HostAddresses:
    """Every address configured on the host (any interface).

    Read once up front, then refreshed in the background when older than a few seconds, so
    a request never waits for ``ip addr`` (a fork and exec, milliseconds on a busy host).

    A read that fails (no descriptor or process to spare, ``ip`` stuck or gone) keeps the list
    read before, and is tried again a second later; before any read worked, the list is unknown
    (``current()`` is None) and every address counts as the host's.  A failed read made the list
    empty: for the next five seconds every host address was let through to an allowlist that
    covered it."""

    TTL = 5.0
    #: seconds before a failed read is tried again
    RETRY = 1.0

    def __init__(self, read: Callable[[], frozenset[IPAddress] | None] | None = None) -> None:
        self._read = read or _read_host_addresses
        self._lock = threading.Lock()
        self._stamp = 0.0
        self._refreshing = False
        self._addresses: frozenset[IPAddress] | None = None

    def current(self) -> frozenset[IPAddress] | None:
        """The host's addresses, or None while they could never be read (treat every one as the host's)."""
        with self._lock:
            addresses, stale = self._addresses, time.monotonic() - self._stamp > self.TTL
            if addresses is not None and stale and not self._refreshing:
                self._refreshing = True
                threading.Thread(target=self._refresh, daemon=True).start()
        if addresses is None:
            self._refresh()
            addresses = self._addresses
        return addresses

    def _refresh(self) -> None:
        fresh = self._read()
        with self._lock:
            self._refreshing = False
            if fresh is not None:
                self._addresses, self._stamp = fresh, time.monotonic()
            else:  # keep what was read before; try again soon
                self._stamp = time.monotonic() - self.TTL + self.RETRY


def _read_host_addresses() -> frozenset[IPAddress] | None:
    """Every address of every interface (``ip -j addr show``), or None if they could not be read."""
    try:
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, check=True, timeout=5).stdout
        found = set()
        for link in json.loads(out):
            for info in link.get("addr_info", []):
                ip = parse_ip(info.get("local", ""))
                if ip is not None:
                    found.add(ip)
    except (OSError, subprocess.SubprocessError, ValueError, AttributeError, TypeError):
        return None
    return frozenset(found)


HOST_ADDRESSES = HostAddresses()
LOOPBACK: dict[int, IPNetwork] = {4: ipaddress.ip_network("127.0.0.0/8"), 6: ipaddress.ip_network("::1/128")}


@dataclass(frozen=True)
class Decision:
    """The outcome for one destination: where to connect, or which rule refused it."""

    allowed: bool
    host: str
    port: int
    address: str | None = None
    rule: str = ""


class Policy:
    """The allowlist plus the refused ranges, minus what the operator re-enabled."""

    def __init__(self, allow: Sequence[AllowRule], unsafe_ranges: Sequence[IPNetwork] = (),
                 resolver: Resolver | None = None, host_addresses: HostAddresses = HOST_ADDRESSES) -> None:
        self.allow = tuple(allow)
        self.unsafe_ranges = tuple(unsafe_ranges)
        self.resolver = resolver or system_resolver
        self._host_addresses = host_addresses

    def refused_by(self, ip: IPAddress) -> str | None:
        """The rule that forbids connecting to ``ip``, or None."""
        v4 = (embedded_ipv4(ip) or isatap_ipv4(ip)) if isinstance(ip, ipaddress.IPv6Address) else None
        for candidate in (ip, v4) if v4 is not None else (ip,):
            if any(candidate.version == net.version and candidate in net for net in self.unsafe_ranges):
                continue
            for net, rule in REFUSED_RANGES:
                if candidate.version == net.version and candidate in net:
                    return rule
            known = self._host_addresses.current()
            if known is None:
                return "host-addresses-unknown"  # fail closed: it may be one of them
            if candidate in known:
                return "host-address"
            if not candidate.is_global:
                return "not-global"
            try:
                # an address on no interface the host still takes for itself (an AnyIP route, a
                # cloud's forwarded load-balancer address): its services answered an allow rule
                kind = route_type(str(candidate))
            except OSError:
                return "host-route-unknown"  # fail closed, as for the addresses
            if kind is not None:
                return f"{kind}-route"
        return None

    def decide(self, host: str, port: int) -> Decision:
        name = normalize_host(host)
        if not 1 <= port <= 65535:
            return Decision(False, name, port, rule="bad-port")
        literal = parse_ip(name)
        if literal is None and not HOST_RE.match(name):
            return Decision(False, name, port, rule="bad-host")
        name_allowed = literal is None and any(rule.matches_name(name, port) for rule in self.allow)
        if literal is not None:
            candidates: list[IPAddress] = [literal]
        elif names_loopback(name) and not self._loopback_reenabled():
            return Decision(False, name, port, rule="loopback")  # never looked up
        elif not name_allowed and not self._usable_ip_rule():
            return Decision(False, name, port, rule="not-allowed")  # no lookup: DNS can leak data too
        else:
            try:
                candidates = [ip for ip in (parse_ip(a) for a in self.resolver(name)) if ip is not None]
            except (OSError, UnicodeError):
                candidates = []
            if not candidates:
                return Decision(False, name, port, rule="unresolvable" if name_allowed else "not-allowed")
        first_refusal: Decision | None = None
        for ip in candidates:
            # the range rule is named first: "link-local" says more than "not-allowed"
            refused = self.refused_by(ip)
            if refused is None and not (name_allowed or any(r.matches_address(ip, port) for r in self.allow)):
                refused = "not-allowed"
            if refused is not None:
                first_refusal = first_refusal or Decision(False, name, port, str(ip), refused)
                continue
            return Decision(True, name, port, str(ip), "allow")
        assert first_refusal is not None
        return first_refusal

    def _usable_ip_rule(self) -> bool:
        """Whether an IP or CIDR rule could allow some address: a name no name rule matches is
        then looked up, to see whether it lands in one (a lookup is a channel out: the host's
        resolver asks the name's servers). A rule wholly inside a refused range (a documentation
        or private range not re-enabled) allows nothing, and is no reason to look names up."""
        return any(rule.network is not None and not self._wholly_refused(rule.network) for rule in self.allow)

    def _wholly_refused(self, network: IPNetwork) -> bool:
        if any(network.version == net.version and network.overlaps(net) for net in self.unsafe_ranges):  # type: ignore[arg-type]
            return False
        return any(network.version == net.version and network.subnet_of(net)  # type: ignore[arg-type]
                   for net, _ in REFUSED_RANGES)

    def _loopback_reenabled(self) -> bool:
        return any(net.overlaps(LOOPBACK[net.version]) for net in self.unsafe_ranges)  # type: ignore[arg-type]
