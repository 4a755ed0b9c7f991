"""Destination syntax shared by the spec and the egress policy: IP spellings and allow rules.

Kept at the bottom of the import graph (it needs only :mod:`corral.errors`) so
that :class:`~corral.spec.SandboxSpec` can validate an allowlist when it is
built, while the policy that enforces it lives in :mod:`corral.egress`.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from .errors import InvalidSpec

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: names that mean the loopback whatever the resolver says (RFC 6761)
LOOPBACK_NAMES = frozenset({"localhost", "localhost."})


def names_loopback(hostname: str) -> bool:
    """A host name, without port or brackets, that can only be this machine's loopback (a
    loopback address, ``localhost`` or a ``*.localhost`` name), never resolved."""
    name = hostname.lower()
    if name in LOOPBACK_NAMES or name.endswith((".localhost", ".localhost.")):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


HOST_RE = re.compile(r"^(\*\.)?[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*\.?\Z")


def parse_ip(text: str) -> IPAddress | None:
    """An address in any spelling a C resolver accepts, canonical; IPv4-mapped IPv6 becomes IPv4.

    ``inet_aton`` is the reference for IPv4 because it is what curl, Python's
    ``socket`` and glibc apply to a bare host: decimal (``2852039166``), hex
    (``0xa9fea9fe``), octal (``0251.0376.0251.0376``) and short forms
    (``169.254.43518``) all name an address.
    """
    text = text.strip().lower()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    text = text.split("%", 1)[0]  # a zone index does not change the address
    if ":" in text:
        try:
            ip6 = ipaddress.IPv6Address(text)
        except ValueError:
            return None
        return embedded_ipv4(ip6) or ip6
    if not text or not re.fullmatch(r"[0-9a-fx.]+", text) or not text[0].isdigit():
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text.rstrip(".")))
    except (OSError, ValueError):
        return None


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (mapped, translated, compatible, NAT64, 6to4), if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    packed = ip.packed
    if packed[:12] == bytes(8) + b"\xff\xff\x00\x00":  # SIIT's IPv4-translated ::ffff:0:a.b.c.d (RFC 6145)
        return ipaddress.IPv4Address(packed[12:])
    if packed[:12] == bytes(12) and int(ip) > 1:  # deprecated IPv4-compatible ::a.b.c.d
        return ipaddress.IPv4Address(packed[12:])
    if ip in ipaddress.IPv6Network("64:ff9b::/96"):
        return ipaddress.IPv4Address(packed[12:])
    return None


def isatap_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an ISATAP interface id (``::5efe:a.b.c.d``, ``::200:5efe:a.b.c.d``, RFC
    5214) names: a real IPv6 address (not spelt as that IPv4 one), but an ISATAP router on the
    way delivers it there, so its refusal is that address's."""
    packed = ip.packed
    if packed[8:12] in (b"\x00\x00\x5e\xfe", b"\x02\x00\x5e\xfe"):
        return ipaddress.IPv4Address(packed[12:])
    return None


def normalize_host(host: str) -> str:
    """Lower-case name without trailing dot, or the canonical text of an address."""
    ip = parse_ip(host)
    if ip is not None:
        return str(ip)
    return host.strip().lower().rstrip(".")


@dataclass(frozen=True)
class AllowRule:
    """One allowlist entry: ``host``, ``*.suffix``, an IP or a CIDR, with an optional port."""

    text: str
    host: str | None = None
    suffix: str | None = None
    network: IPNetwork | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> AllowRule:
        if not isinstance(text, str) or not text.strip():
            raise InvalidSpec(f"allow {text!r}: expected HOST, *.DOMAIN, IP or CIDR, with an optional :PORT")
        raw = text.strip().lower()
        port: int | None = None
        body = raw
        if raw.startswith("["):  # [v6]:port or [v6]
            end = raw.find("]")
            if end < 0:
                raise InvalidSpec(f"allow {text!r}: unbalanced '['")
            body, rest = raw[1:end], raw[end + 1:]
            if rest:
                port = _parse_port(rest.removeprefix(":"), text)
        elif raw.count(":") == 1:
            body, port_text = raw.split(":")
            port = _parse_port(port_text, text)
        if "/" in body:
            try:
                network = ipaddress.ip_network(body, strict=False)
            except ValueError:
                raise InvalidSpec(f"allow {text!r}: {body!r} is not a valid CIDR") from None
            return cls(text, network=network, port=port)
        ip = parse_ip(body)
        if ip is not None:
            return cls(text, network=ipaddress.ip_network(ip), port=port)
        if not HOST_RE.match(body) or len(body) > 253:
            raise InvalidSpec(f"allow {text!r}: not a host name, *.domain wildcard, IP or CIDR")
        if body.startswith("*."):
            return cls(text, suffix=body[1:].rstrip("."), port=port)
        return cls(text, host=body.rstrip("."), port=port)

    def covers(self, asked: AllowRule) -> bool:
        """Whether every destination ``asked`` allows is one this rule allows too (an operator's
        bound on what a tenant or a model may ask for)."""
        if self.port is not None and self.port != asked.port:
            return False
        if asked.network is not None:
            return (self.network is not None and asked.network.version == self.network.version
                    and asked.network.subnet_of(self.network))  # type: ignore[arg-type]
        if self.suffix is not None:  # ".example.com" covers "a.example.com" and "*.a.example.com"
            name = asked.host if asked.host is not None else asked.suffix
            return name is not None and name.endswith(self.suffix) and (
                asked.host is None or len(name) > len(self.suffix))
        return asked.host is not None and asked.host == self.host

    def matches_name(self, name: str, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.host is not None:
            return name == self.host
        if self.suffix is not None:
            return name.endswith(self.suffix) and len(name) > len(self.suffix)
        return False

    def matches_address(self, ip: IPAddress, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        return self.network is not None and ip.version == self.network.version and ip in self.network


def _parse_port(text: str, whole: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise InvalidSpec(f"allow {whole!r}: port {text!r} must be a number from 1 to 65535")
    return int(text)


def parse_range(text: str) -> IPNetwork:
    """A CIDR given to ``--unsafe-allow-range``."""
    try:
        return ipaddress.ip_network(str(text).strip(), strict=False)
    except ValueError:
        raise InvalidSpec(f"unsafe allow range {text!r}: expected a CIDR such as 10.20.0.0/16") from None


