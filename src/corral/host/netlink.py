"""Netlink framing shared by our rtnetlink (:mod:`corral.host.rtnl`) and nfnetlink_log
(:mod:`corral.egress.nflog`) clients: a message header and type-length-value attributes."""

from __future__ import annotations

import struct

NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 2
HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id


def attr(kind: int, value: bytes) -> bytes:
    """One attribute, padded to 4 bytes."""
    return struct.pack("=HH", 4 + len(value), kind) + value + bytes(-len(value) % 4)


def message(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    """A request: header (asking for an acknowledgement) and body."""
    return HEADER.pack(HEADER.size + len(body), kind, NLM_F_REQUEST | NLM_F_ACK | flags, seq, 0) + body
