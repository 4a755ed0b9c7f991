"""Host uid ranges for sandboxes: 65,536 host uids and gids of its own per sandbox.

Each sandbox (and each image build, each wasm guest) gets a *slot*: the host
uids and gids ``base .. base + 65535``, mapped to ``0 .. 65535`` inside the
sandbox's user namespace where the tier maps a whole range.  The sandbox user
(uid 1000 inside) is ``base + 1000`` on the host; root inside is ``base``.

Slots come from a range reserved for Corral, ``UID_BASE .. UID_TOP``: below
2^31 (tools that keep ids in a signed int), above systemd's container range
(``0x00080000 .. 0x6FFFFFFF``) and below its "foreign" range (``0x7FFE0000``).
A slot is never handed out if it overlaps a user or group of ``/etc/passwd``,
``/etc/group``, or a subordinate range of ``/etc/subuid`` or ``/etc/subgid``
(read again whenever one of them changes), nor the single uids earlier Corral
versions handed out (``LEGACY``), which may still be running on the host.

A slot is reserved twice, both with ``O_EXCL`` files holding its owner's name:

- ``state_dir/uids/<base>``: the record the janitor reads (a dead owner's reap
  record names its uids, and ``gc`` releases them), written before any process
  runs as one of the slot's uids;
- ``/run/corral/uid-ranges/<base>``: the host-wide claim, whatever the state
  directory.  Two Corral instances with different state directories (two
  servers, parallel test runs) would otherwise be able to hand the same range
  to two live sandboxes, which could then reach each other's files and
  processes as the same users.  A claim whose state-directory record no longer
  exists (its state directory was removed without a ``gc``) is stale and is
  taken over.

Both are released by removing the files (:func:`release_range`, given any uid
of the slot).
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import ResourceLimit

#: host ids per sandbox: a whole 16-bit id space, as a Linux system expects
RANGE_SIZE = 65536
#: the range reserved for Corral (see the module docstring)
UID_BASE = 0x7000_0000
UID_TOP = 0x7FFE_0000
SLOTS = (UID_TOP - UID_BASE) // RANGE_SIZE
#: single host uids handed out by Corral before ranges (other instances may still use them)
LEGACY = (2_100_000_000, 2_101_000_000)
#: the uid and gid of the sandbox user inside every sandbox
SANDBOX_UID = 1000
#: the host-wide claims (tmpfs: claims die with the boot, as the processes using them do)
CLAIMS = Path("/run/corral/uid-ranges")
#: the host's id databases a slot must not overlap
ID_FILES = (Path("/etc/passwd"), Path("/etc/group"), Path("/etc/subuid"), Path("/etc/subgid"))


@dataclass(frozen=True)
class UidRange:
    """One sandbox's host ids: ``base .. base + size - 1`` (uids and the same gids)."""

    base: int
    size: int = RANGE_SIZE

    def host(self, inside: int) -> int:
        """The host id of ``inside`` (an id in the sandbox's user namespace)."""
        if not 0 <= inside < self.size:
            raise ValueError(f"id {inside} is outside the sandbox's range")
        return self.base + inside

    @property
    def user(self) -> int:
        """The host uid of the sandbox user (uid 1000 inside)."""
        return self.base + SANDBOX_UID

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.base <= uid < self.base + self.size


def range_of(uid: int) -> UidRange:
    """The slot that holds host uid ``uid`` (any uid of it, its base included)."""
    if not UID_BASE <= uid < UID_TOP:
        raise ValueError(f"uid {uid} is not one of Corral's")
    return UidRange(UID_BASE + (uid - UID_BASE) // RANGE_SIZE * RANGE_SIZE)


# -- slots the host uses itself ---------------------------------------------------
_taken_lock = threading.Lock()
_taken_cache: tuple[tuple[tuple[int, int], ...], frozenset[int]] | None = None


def _slots_between(first: int, last: int) -> range:
    """The slots that ids ``first .. last`` (inclusive) touch."""
    lo = max(first, UID_BASE)
    hi = min(last, UID_TOP - 1)
    if lo > hi:
        return range(0)
    return range((lo - UID_BASE) // RANGE_SIZE, (hi - UID_BASE) // RANGE_SIZE + 1)


def host_slots(files: tuple[Path, ...] | None = None) -> frozenset[int]:
    """Slots that overlap a host user or group, a subordinate id range, or the legacy uids."""
    taken: set[int] = set(_slots_between(LEGACY[0], LEGACY[1] - 1))
    for path in ID_FILES if files is None else files:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        subordinate = path.name in ("subuid", "subgid")
        for line in lines:
            fields = line.split(":")
            try:
                if subordinate and len(fields) >= 3:
                    start, count = int(fields[1]), int(fields[2])
                    taken.update(_slots_between(start, start + count - 1))
                elif not subordinate and len(fields) >= 3:
                    ident = int(fields[2])
                    taken.update(_slots_between(ident, ident))
            except ValueError:
                continue
    return frozenset(taken)


def _host_slots_cached() -> frozenset[int]:
    """:func:`host_slots`, read again only when one of the files changed (a stat each)."""
    global _taken_cache
    signature = []
    for path in ID_FILES:
        try:
            st = path.stat()
            signature.append((st.st_mtime_ns, st.st_size))
        except OSError:
            signature.append((0, -1))
    key = tuple(signature)
    with _taken_lock:
        if _taken_cache is None or _taken_cache[0] != key:
            _taken_cache = (key, host_slots())
        return _taken_cache[1]


# -- reservations -----------------------------------------------------------------
def _create(path: Path, content: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, content.encode())
    finally:
        os.close(fd)
    return True


def _claim(base: int, record: Path) -> bool:
    """Claim the slot at ``base`` host-wide for the record at ``record``; take over a stale claim."""
    claim = CLAIMS / str(base)
    if _create(claim, str(record)):
        return True
    try:
        holder = Path(claim.read_text())
    except (FileNotFoundError, ValueError):
        return _create(claim, str(record))
    if holder == record or holder.exists():
        return False
    # the record behind the claim is gone (its state directory was deleted): stale
    claim.unlink(missing_ok=True)
    return _create(claim, str(record))


_records_made: dict[Path, Path] = {}


def _records(state_dir: Path) -> Path:
    """``state_dir/uids``, made and resolved once per process (claims name records by real path)."""
    records = _records_made.get(state_dir)
    if records is None or not records.is_dir():
        records = state_dir / "uids"
        records.mkdir(mode=0o700, exist_ok=True)
        CLAIMS.mkdir(mode=0o700, parents=True, exist_ok=True)
        records = _records_made[state_dir] = records.resolve()
    return records


def allocate_range(state_dir: Path, owner: str) -> UidRange:
    """Reserve a range of host ids no host user and no other live sandbox on this host uses."""
    records = _records(state_dir)
    taken = _host_slots_cached()
    rng = random.SystemRandom()
    for _ in range(100):
        slot = rng.randrange(SLOTS)
        if slot in taken:
            continue
        base = UID_BASE + slot * RANGE_SIZE
        record = records / str(base)
        if not _create(record, owner):
            continue
        if _claim(base, record):
            return UidRange(base)
        record.unlink(missing_ok=True)  # another state directory's live sandbox holds it
    raise ResourceLimit("could not reserve a free range of host uids for the sandbox")


def release_range(state_dir: Path, uid: int) -> None:
    """Release the slot holding ``uid`` (its record in ``state_dir`` and its host-wide claim)."""
    try:
        base = range_of(uid).base
    except ValueError:
        return  # not one of ours (a record from before ranges): nothing host-wide to release
    record = state_dir / "uids" / str(base)
    claim = CLAIMS / str(base)
    try:
        if Path(claim.read_text()) == record.resolve():
            claim.unlink(missing_ok=True)
    except (FileNotFoundError, ValueError):
        pass
    record.unlink(missing_ok=True)


def set_owner(state_dir: Path, uid: int, owner: str) -> None:
    """Hand the slot holding ``uid`` to another owner (the janitor reaps it by that name)."""
    (state_dir / "uids" / str(range_of(uid).base)).write_text(owner)


def allocate_uid(state_dir: Path, owner: str) -> int:
    """Reserve a range and return its sandbox-user uid, for owners that run as one host uid."""
    return allocate_range(state_dir, owner).user


#: the same as :func:`release_range`: any uid of the slot releases it
release_uid = release_range
