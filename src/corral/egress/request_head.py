"""A request head as the egress proxy forwards it: parsed strictly, and the authority it names.

Towards a secret-bound host the proxy rewrites each head (drops ``Range``, ``Accept-Encoding``,
hop-by-hop fields; puts the real values in) and the upstream server parses it again.  Every form
the two could split differently -- a bare LF or CR, a folded line, a space before a colon, a NUL,
a field name that is not a token -- is refused (:class:`MalformedHead`, answered 400), so the
proxy never forwards a field it did not see as the server will.

A real value goes only into a request whose one named authority is the host the connection goes
to (:func:`request_authority`): one ``Host`` field, and a target in absolute form naming the same
host and port.  A request on the bound host's address that names another site (``Host: other``,
two ``Host`` fields, ``http://other/`` in a tunnel, userinfo or backslash forms) could be served
as that other site: on a shared address (a CDN, a hosting provider) it would be another tenant's.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

#: RFC 9110's ``tchar``: what a method and a field name are made of
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


class MalformedHead(ValueError):
    """A request head the proxy does not forward: it is answered 400 and the connection closed."""


@dataclass(frozen=True)
class RequestHead:
    method: bytes
    target: bytes
    version: bytes
    #: (lowercase field name, the whole line as the client sent it), in order
    fields: tuple[tuple[bytes, bytes], ...]

    def values(self, name: bytes) -> list[bytes]:
        """The values of every field called ``name`` (lowercase), stripped of surrounding spaces."""
        return [line.partition(b":")[2].strip(b" \t") for field, line in self.fields if field == name]


def parse_head(head: bytes) -> RequestHead:
    """``head`` (up to, not including, the blank line) as the proxy will forward it."""
    if b"\0" in head:
        raise MalformedHead("a NUL byte in the request head")
    lines = head.split(b"\r\n")
    if any(b"\r" in line or b"\n" in line for line in lines):
        raise MalformedHead("a bare CR or LF in the request head (lines end with CRLF)")
    request_line, *field_lines = lines
    parts = request_line.split(b" ")
    if (len(parts) != 3 or not parts[0] or not _TOKEN.issuperset(parts[0]) or not parts[1]
            or parts[2] not in (b"HTTP/1.0", b"HTTP/1.1")):
        raise MalformedHead(f"request line {request_line[:100]!r}")
    fields = []
    for line in field_lines:
        if line[:1] in (b" ", b"\t"):
            raise MalformedHead("a folded field line (obs-fold)")
        name, colon, _ = line.partition(b":")
        if not colon or not name or not _TOKEN.issuperset(name):
            raise MalformedHead(f"field {line[:60]!r}: the name must be a token followed by a colon")
        fields.append((name.lower(), line))
    return RequestHead(parts[0], parts[1], parts[2], tuple(fields))


def body_framing_problem(head: RequestHead) -> str | None:
    """Why the request's body length is not one the proxy and the server must agree on, or None.

    The proxy forwards what follows the head as it comes; a server that read the body's length
    otherwise than its sender meant (two ``Content-Length`` fields, one with a
    ``Transfer-Encoding``, a coding list not ending in ``chunked``) would take the rest as a
    second request the proxy never saw: its ``Range`` not stripped, towards a bound host."""
    lengths = head.values(b"content-length")
    codings = head.values(b"transfer-encoding")
    if len(lengths) > 1:
        return "more than one Content-Length"
    if lengths and codings:
        return "both Content-Length and Transfer-Encoding"
    if lengths and not lengths[0].isdigit():
        return "a Content-Length that is not a number"
    if codings and b",".join(codings).split(b",")[-1].strip().lower() != b"chunked":
        return "a Transfer-Encoding that does not end in chunked"
    return None


def parse_authority(text: str) -> tuple[str, int | None] | None:
    """(host, port or None) of a ``Host`` value or a URI's authority: the host lowercase and
    without a trailing dot, an IPv6 address without brackets.  None for anything else: userinfo,
    a backslash, a path, spaces or controls, an empty host, a port that is not a number."""
    if not text or any(c in text for c in "@\\/?#%") or any(ord(c) <= 0x20 or ord(c) >= 0x7F for c in text):
        return None
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        try:
            host = str(ipaddress.IPv6Address(inside))
        except ValueError:
            return None
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    else:
        host, colon, port_text = text.partition(":")
        port = port_text if colon else None
        if ":" in port_text:
            return None
    if port is not None and (not port.isdigit() or not 0 < int(port) < 65536):
        return None
    host = host.lower().rstrip(".")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        pass
    return (host, int(port) if port is not None else None) if host else None


def request_authority(head: RequestHead, default_port: int) -> tuple[str, int] | str:
    """The (host, port) the request names, or why it names no single one (for the audit)."""
    hosts = head.values(b"host")
    if len(hosts) != 1:
        return f"{len(hosts)} Host fields"
    named = parse_authority(hosts[0].decode("latin-1"))
    if named is None:
        return f"Host {hosts[0][:80].decode('latin-1')!r}"
    host, port = named[0], named[1] if named[1] is not None else default_port
    target = head.target.decode("latin-1")
    if not target.startswith("/") and head.method != b"CONNECT" and target != "*":
        scheme, sep, rest = target.partition("://")
        if not sep or scheme.lower() not in ("http", "https"):
            return f"target {target[:80]!r}"
        in_target = parse_authority(rest.split("/", 1)[0])
        if in_target is None:
            return f"target {target[:80]!r}"
        target_port = in_target[1] if in_target[1] is not None else (443 if scheme.lower() == "https" else 80)
        if (in_target[0], target_port) != (host, port):
            return f"target {target[:80]!r} and Host {hosts[0][:80].decode('latin-1')!r} differ"
    return host, port


def same_host(named: tuple[str, int], host: str, port: int) -> bool:
    """Whether a request's authority is ``host:port`` (as the proxy decided the connection)."""
    host = host.lower().rstrip(".").strip("[]")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        pass
    return named == (host, port)
