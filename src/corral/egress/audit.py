"""Audit events: every refused destination and every withheld secret, per sandbox.

Recorded by the proxy (requests) and by :mod:`corral.egress.nflog` (packets the kernel refused)."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

#: events kept per sandbox; older ones are dropped (and counted) so a loop cannot exhaust memory
MAX_EVENTS = 10_000


@dataclass(frozen=True)
class AuditEvent:
    time: float
    sandbox_id: str
    #: "refused" (a destination), "secret-withheld" (a placeholder sent to an unbound host), or
    #: "refused-unlogged" (packets refused over the kernel log's rate limit, summed per rule)
    kind: str
    #: the destination as the sandbox asked for it (``host:port``; for a packet ``address:port``)
    destination: str
    #: the address it resolved to, when resolution happened
    address: str | None
    #: the rule that refused it (``link-local``, ``not-allowed``, ``raw-socket``, ...)
    rule: str
    #: how it was asked: http, http-connect, socks5 (the proxy); tcp, udp, icmp, icmpv6... (a packet
    #: our nftables rules refused); ``nft:<packets>`` for refused-unlogged
    protocol: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.gmtime(self.time))
        via = f" -> {self.address}" if self.address else ""
        return f"{stamp} {self.sandbox_id} {self.kind} {self.destination}{via} [{self.protocol}] rule={self.rule}"


class AuditLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[AuditEvent] = []
        self.dropped = 0

    def record(self, sandbox_id: str, kind: str, destination: str, address: str | None, rule: str,
               protocol: str) -> AuditEvent:
        event = AuditEvent(time.time(), sandbox_id, kind, destination, address, rule, protocol)
        with self._lock:
            if len(self._events) >= MAX_EVENTS:
                self._events.pop(0)
                self.dropped += 1
            self._events.append(event)
        return event

    def events(self) -> list[AuditEvent]:
        with self._lock:
            return list(self._events)
