"""Audit events: every refused destination and every withheld secret, per sandbox.

Recorded by the proxy (requests) and by :mod:`corral.egress.nflog` (packets the kernel refused)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

#: events kept per sandbox; older ones are dropped (and counted) so a loop cannot exhaust memory
MAX_EVENTS = 10_000
#: of them, the sandbox's first ones, never dropped: the rest is a ring of the latest
KEPT_FIRST = 1_000
#: distinct (kind, rule, protocol) whose dropped events are counted apart; more share one count
MAX_DROPPED_KINDS = 256
#: characters of an event's destination, address or rule kept (the sandbox's text: a ``CONNECT``
#: to a 60,000-character name was kept whole, and 10,000 of them held 575 MiB of the owner's or
#: the server's memory, outside every sandbox's limit)
MAX_FIELD = 256


def _bounded(text: str) -> str:
    if len(text) <= MAX_FIELD:
        return text
    return f"{text[:MAX_FIELD]}... ({len(text):,} characters)"


def shown(text: str) -> str:
    """``text`` as a terminal may print it: every character that is not printable (control
    characters, ESC, bidirectional overrides) as its escape.  A sandbox's ``CONNECT`` or SOCKS
    name reached the operator's terminal raw through ``corral run --audit``: ``\\r ESC[2K`` wiped
    the line of a real refusal of 169.254.169.254, printed a forged one, and ``ESC[8m`` hid the
    next (helper 92)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escaped(c) for c in text)


def _token(text: str) -> str:
    """A field of an audit line as one token of printable ASCII: every other character escaped,
    spaces too (a SOCKS name of spaces and ``[socks] rule=allow`` planted fields of a forged event
    in a real line, helper 93; an IDNA name decoded to U+2800, printable but blank, did the same,
    helper 96)."""
    if text.isascii() and text.isprintable() and " " not in text:
        return text
    return "".join(c if c.isascii() and c.isprintable() and c != " " else _escaped(c) for c in text)


def _escaped(c: str) -> str:
    """``c`` as Python writes it in a string (``\\x1b``, ``\\u2800``; a space, which it keeps, ``\\x20``)."""
    return "\\x20" if c == " " else c.encode("unicode_escape").decode("ascii")


@dataclass(frozen=True)
class AuditEvent:
    time: float
    sandbox_id: str
    #: "refused" (a destination), "secret-withheld" (a placeholder sent to an unbound host),
    #: "refused-unlogged" (packets refused over the kernel log's rate limit, summed per rule),
    #: "dropped" (events of ``rule`` the log had no room for: ``destination`` says how many, of
    #: which kind; ``time`` is the latest one's), or "rate-limited" (connections held back by
    #: ``rule``, summed: ``destination`` says how many and how long; ``time`` is the latest one's)
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
        via = f" -> {_token(self.address)}" if self.address else ""
        return (f"{stamp} {self.sandbox_id} {self.kind} {_token(self.destination)}{via} [{_token(self.protocol)}] "
                f"rule={_token(self.rule)}")


class AuditLog:
    """The events of one sandbox's egress, bounded: its first :data:`KEPT_FIRST`, then a ring of
    the latest, and a count per rule of what fell out of the ring.  A sandbox flooding the log
    with refusals pushed an earlier attempt (169.254.169.254) out of it, leaving no trace; now
    the first attempts stay, and a later one that falls out is still counted under its rule."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: list[AuditEvent] = []
        self._latest: deque[AuditEvent] = deque()
        self.dropped = 0
        #: (sandbox, kind, rule, protocol) -> [how many dropped, the latest one's time]
        self._dropped_by: dict[tuple[str, str, str, str], list[float]] = {}
        #: (sandbox, kind, rule, protocol) -> [how many, seconds in all, the latest one's time]
        self._tallies: dict[tuple[str, str, str, str], list[float]] = {}
        #: ``refused`` events recorded, dropped ones included (read after every command: no list built)
        self.refused = 0

    def record(self, sandbox_id: str, kind: str, destination: str, address: str | None, rule: str,
               protocol: str) -> AuditEvent:
        event = AuditEvent(time.time(), sandbox_id, kind, _bounded(destination),
                           None if address is None else _bounded(address), _bounded(rule), protocol)
        with self._lock:
            if kind == "refused":
                self.refused += 1
            if len(self._first) < KEPT_FIRST:
                self._first.append(event)
                return event
            if len(self._latest) >= MAX_EVENTS - KEPT_FIRST:
                self._count_dropped(self._latest.popleft())
            self._latest.append(event)
        return event

    def tally(self, sandbox_id: str, kind: str, rule: str, protocol: str, seconds: float = 0.0) -> None:
        """Count one connection of ``kind`` under ``rule`` (held back ``seconds``) without an event
        of its own: :meth:`events` shows one event per rule summing them.  For what can happen
        to every connection of a flood, where an event each would cost what is being bounded."""
        with self._lock:
            key = (sandbox_id, kind, _bounded(rule), protocol)
            if key not in self._tallies and len(self._tallies) >= MAX_DROPPED_KINDS:
                key = (sandbox_id, kind, "other rules", "*")
            count = self._tallies.setdefault(key, [0, 0.0, 0.0])
            count[0] += 1
            count[1] += seconds
            count[2] = time.time()

    def _count_dropped(self, event: AuditEvent) -> None:
        self.dropped += 1
        key = (event.sandbox_id, event.kind, event.rule, event.protocol)
        if key not in self._dropped_by and len(self._dropped_by) >= MAX_DROPPED_KINDS:
            key = (event.sandbox_id, event.kind, "other rules", "*")  # rules may carry the sandbox's text
        count = self._dropped_by.setdefault(key, [0, event.time])
        count[0] += 1
        count[1] = event.time

    def events(self) -> list[AuditEvent]:
        """The first events, then one ``dropped`` event per rule that lost some, then the latest,
        then one event per rule :meth:`tally` counted (``destination``: how many connections, and
        how long they were held in all)."""
        with self._lock:
            dropped = [AuditEvent(latest, sandbox_id, "dropped", f"{int(n)} {kind}", None, rule, protocol)
                       for (sandbox_id, kind, rule, protocol), (n, latest) in self._dropped_by.items()]
            tallied = [AuditEvent(latest, sandbox_id, kind,
                                  f"{int(n)} connections" + (f", held {seconds:.2f} s in all" if seconds else ""),
                                  None, rule, protocol)
                       for (sandbox_id, kind, rule, protocol), (n, seconds, latest) in self._tallies.items()]
            return [*self._first, *dropped, *self._latest, *tallied]
