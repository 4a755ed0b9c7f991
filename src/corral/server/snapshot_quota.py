"""A tenant's snapshot quota under concurrent requests: room is reserved before a snapshot is taken.

Checking the store, taking the snapshot, then comparing its size with what the store held
*before* let every concurrent request of a tenant pass: eight snapshot requests at once against
a quota of 2 snapshots and 60 MB all returned 201 (8 snapshots, 210 MB kept; red-team probe 76).
Now each one in flight holds a place in the tenant's count (if it is to be kept) and bytes of
its quota, taken under the tenant's lock together with the check, and given back once the
snapshot is in the store (where it counts from then on) or failed:

- the bytes held are the most the snapshot may hold (:func:`corral.snapshots.bytes_at_most`);
  when that is more than the room left, a request waits for the tenant's snapshots in flight to
  be stored (their real sizes are usually far below their bounds), then holds all the room
  left, alone: near the quota a tenant's snapshots are taken one at a time, below it at once;
- a snapshot larger than what it held (when it held all that was left, or its bound was wrong)
  is kept only if it fits beside the tenant's other snapshots and what the others in flight
  hold, checked before it is put in the store (a live one, whose size is an upper bound while
  its memory image is written, once it is there); else it is refused (429) and nothing of it
  is kept.

Refusals are the quota's own (:class:`ResourceLimit`, 429 ``resource_limit``).  One tenant's
reservations never wait on another's: each tenant has its own lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import ResourceLimit
from ..snapshots import SnapshotStore
from ..spec import format_size


@dataclass
class _InFlight:
    """One tenant's snapshots being taken (guarded by ``changed``'s lock)."""

    changed: threading.Condition = field(default_factory=threading.Condition)
    #: those that will be kept (each has a place in the tenant's count)
    kept: int = 0
    #: all of them, a fork's passing one included
    taking: int = 0
    #: the bytes held for them
    held: int = 0


@dataclass
class Reservation:
    """What one snapshot in flight holds of its tenant's quota."""

    store: SnapshotStore
    tenant: str
    #: bytes held for it (grown by :meth:`fits` when it is larger and there is room)
    held: int
    _quota: SnapshotQuota
    _flight: _InFlight
    #: the room it had when :meth:`fits` last said no
    left: int = 0

    def fits(self, size: int, stored: str | None = None) -> bool:
        """Whether the snapshot, of ``size`` bytes, may be kept: it fits in what it held, or in
        what the quota leaves beside the tenant's other snapshots (``stored``: its own id if it is
        in the store already) and what the others in flight hold -- then that much is held for it."""
        if size <= self.held:
            return True
        with self._flight.changed:
            others = sum(s.size for s in self.store.held_by(self.tenant) if s.id != stored)
            self.left = self._quota.max_bytes - others - (self._flight.held - self.held)
            if size > self.left:
                return False
            self._flight.held += size - self.held
            self.held = size
            return True


class SnapshotQuota:
    """``max_snapshots_per_tenant`` and ``max_snapshot_bytes_per_tenant``, held for snapshots in flight."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._tenants: dict[str, _InFlight] = {}
        self._lock = threading.Lock()

    def _flight(self, tenant: str) -> _InFlight:
        with self._lock:
            flight = self._tenants.get(tenant)
            if flight is None:
                flight = self._tenants[tenant] = _InFlight()
            return flight

    @contextmanager
    def hold(self, store: SnapshotStore, tenant: str, at_most: int, kept: bool = True) -> Iterator[Reservation]:
        """Hold room for a snapshot of at most ``at_most`` bytes (and a place in the count if it is
        ``kept``) while it is taken; 429 if there is none.  Given back on leaving: by then the
        snapshot is in the store (and counted there) or gone."""
        flight = self._flight(tenant)
        with flight.changed:
            held = Reservation(store, tenant, self._reserve(store, tenant, flight, at_most, kept), self, flight)
        try:
            yield held
        finally:
            with flight.changed:
                flight.kept -= kept
                flight.taking -= 1
                flight.held -= held.held
                flight.changed.notify_all()

    def _reserve(self, store: SnapshotStore, tenant: str, flight: _InFlight, at_most: int, kept: bool) -> int:
        while True:
            stored = store.held_by(tenant)
            count = len(stored) + flight.kept
            if kept and count >= self.max_count:
                raise ResourceLimit(f"quota: tenant {tenant!r} holds {count} snapshots"
                                    + (f", {flight.kept} of them being taken" if flight.kept else "")
                                    + f" (max {self.max_count}); remove one first")
            used = sum(s.size for s in stored)
            left = self.max_bytes - used - flight.held
            if at_most <= left or (flight.taking == 0 and left > 0):
                held = min(at_most, left)  # (alone and its bound does not fit: all that is left)
                flight.kept += kept
                flight.taking += 1
                flight.held += held
                return held
            if flight.taking == 0:
                raise ResourceLimit(f"quota: tenant {tenant!r} holds {format_size(used)} of snapshots "
                                    f"(max {format_size(self.max_bytes)}); remove one first")
            flight.changed.wait()  # the tenant's snapshots in flight are stored (or fail): look again
