"""Host uid ranges for sandboxes: 65,536 host uids and gids of its own per sandbox.

Each sandbox (and each image build, each wasm guest) gets a *slot*: the host
uids and gids ``base .. base + 65535``, mapped to ``0 .. 65535`` inside the
sandbox's user namespace where the tier maps a whole range.  The sandbox user
(uid 1000 inside) is ``base + 1000`` on the host; root inside is ``base``.

Slots come from a pool reserved for Corral, ``UID_BASE .. UID_TOP``, aligned
to 65,536 ids, below 2^31 (tools that keep ids in a signed int) and below
systemd's "foreign" range (``0x7FFE0000``).  Its floor is detected once, at
import (:func:`detect_pool`):

- on a host whose init is systemd (``/run/systemd/system`` exists, as
  ``sd_booted(3)`` checks), or when Corral does not run in the host's initial
  pid namespace (a container may share the host's ids while the host's systemd
  is out of sight), the pool starts at ``0x70000000``, above systemd's
  container range (``0x00080000 .. 0x6FFFFFFF``) that ``systemd-nspawn
  --private-users=pick`` and ``machined`` draw from: 4,094 slots;
- on a host whose init is not systemd, nothing draws from that range, and the
  pool also takes its upper part: it starts at ``0x40000000``, above the ids
  LXD/Incus map by default (``1000000 .. 1000999999``) and above anything
  ``useradd`` hands out: 16,382 slots;
- ``CORRAL_UID_POOL=narrow`` (or ``wide``) overrides the detection, e.g. on a
  host that runs a container manager of its own in that range.

Every Corral process on a host detects the same pool; a narrow pool's slots
are slots of the wide one (same alignment), so the claims below keep two
instances apart whichever pool each uses.
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
of the slot and the owner it was reserved for).  Who releases a slot is named by its
owner: a sandbox's (``sb-...``) by its destroy, or by ``gc`` once its row is gone; a
slot a process holds for its own brief use (a probe, a microVM template's boot:
:func:`process_owner`) by that process, or by ``gc`` once that process is gone
(:func:`release_ranges_of_dead_processes`).

A release removes the files only while the record still names the owner it is given,
and the claim still names that record: a slot is released once, for its holder, never
for the next one.  Two releasers may be told to release the same slot -- an owner that
was stopped past its lifetime, whose sandbox the janitor reaped meanwhile, closes it
when it runs again; a janitor reaps a dead owner's row after the slot that row's
reap record names was released and handed to another sandbox -- and the slot may have
been reserved again in between: the later release then finds another owner's record
and leaves it.  Releases (and the take-over of a stale claim) hold a host-wide
``flock`` on ``/run/corral/uid-ranges/.lock`` around reading and removing, so that no
two of them act on one reading; a reservation takes no lock (``O_EXCL`` files only:
it never removes a file it did not just make), so that a create costs what it did.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidSpec, ResourceLimit
from .procs import process_start_time

#: host ids per sandbox: a whole 16-bit id space, as a Linux system expects
RANGE_SIZE = 65536
#: the top of Corral's pool, the start of systemd's "foreign" range (see the module docstring)
UID_TOP = 0x7FFE_0000
#: the pool's floor where something may draw from systemd's container range (a systemd host)
NARROW_BASE = 0x7000_0000
#: the pool's floor on a host whose init is not systemd: the container range's upper part too
WIDE_BASE = 0x4000_0000
#: present when systemd is the host's init (sd_booted(3))
SYSTEMD_MARKER = Path("/run/systemd/system")


def detect_pool(systemd_marker: Path = SYSTEMD_MARKER, proc: Path = Path("/proc"),
                override: str | None = None) -> int:
    """The pool's floor on this host: :data:`WIDE_BASE` where nothing else draws from systemd's
    container range, else :data:`NARROW_BASE` (``override``: ``CORRAL_UID_POOL``)."""
    choice = os.environ.get("CORRAL_UID_POOL", "") if override is None else override
    if choice in ("narrow", "wide"):
        return NARROW_BASE if choice == "narrow" else WIDE_BASE
    if choice:
        raise InvalidSpec(f"CORRAL_UID_POOL must be 'narrow' or 'wide', not {choice!r}")
    if systemd_marker.exists():
        return NARROW_BASE
    try:  # the host's initial pid namespace is the only one where kthreadd is pid 2, with no parent
        status = (proc / "2" / "status").read_text()
    except OSError:
        return NARROW_BASE
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("Name", "").strip() == "kthreadd" and fields.get("PPid", "").strip() == "0":
        return WIDE_BASE
    return NARROW_BASE


#: this host's pool: ``UID_BASE .. UID_TOP``, ``SLOTS`` slots of ``RANGE_SIZE`` ids
try:
    UID_BASE = detect_pool()
    _POOL_ERROR: InvalidSpec | None = None
except InvalidSpec as exc:  # said at the first allocation, as a typed error, not as a failed import
    UID_BASE, _POOL_ERROR = NARROW_BASE, exc
SLOTS = (UID_TOP - UID_BASE) // RANGE_SIZE
#: single host uids handed out by Corral before ranges (other instances may still use them)
LEGACY = (2_100_000_000, 2_101_000_000)
#: the uid and gid of the sandbox user inside every sandbox
SANDBOX_UID = 1000
#: the host-wide claims (tmpfs: claims die with the boot, as the processes using them do)
CLAIMS = Path("/run/corral/uid-ranges")
#: the lock file in :data:`CLAIMS` that releases and stale-claim take-overs hold (not a slot's name)
LOCK_NAME = ".lock"
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
    """The slot that holds host uid ``uid`` (any uid of it, its base included; either pool's)."""
    if not WIDE_BASE <= uid < UID_TOP:
        raise ValueError(f"uid {uid} is not one of Corral's")
    return UidRange(WIDE_BASE + (uid - WIDE_BASE) // RANGE_SIZE * RANGE_SIZE)


# -- slots the host uses itself ---------------------------------------------------
_taken_lock = threading.Lock()
_taken_cache: tuple[tuple[object, ...], frozenset[int]] | None = None


def _slots_between(first: int, last: int, base: int) -> range:
    """The slots of the pool from ``base`` that ids ``first .. last`` (inclusive) touch."""
    lo = max(first, base)
    hi = min(last, UID_TOP - 1)
    if lo > hi:
        return range(0)
    return range((lo - base) // RANGE_SIZE, (hi - base) // RANGE_SIZE + 1)


def host_slots(files: tuple[Path, ...] | None = None, base: int | None = None) -> frozenset[int]:
    """Slots of the pool from ``base`` (default: this host's) that overlap a host user or group,
    a subordinate id range, or the legacy uids."""
    base = UID_BASE if base is None else base
    taken: set[int] = set(_slots_between(LEGACY[0], LEGACY[1] - 1, base))
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
                    taken.update(_slots_between(start, start + count - 1, base))
                elif not subordinate and len(fields) >= 3:
                    ident = int(fields[2])
                    taken.update(_slots_between(ident, ident, base))
            except ValueError:
                continue
    return frozenset(taken)


def _host_slots_cached(base: int) -> frozenset[int]:
    """:func:`host_slots`, read again only when one of the files changed (a stat each)."""
    global _taken_cache
    signature: list[object] = [base]
    for path in ID_FILES:
        try:
            st = path.stat()
            signature.append((st.st_mtime_ns, st.st_size))
        except OSError:
            signature.append((0, -1))
    key = tuple(signature)
    with _taken_lock:
        if _taken_cache is None or _taken_cache[0] != key:
            _taken_cache = (key, host_slots(base=base))
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


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Hold the host-wide lock of releases and stale-claim take-overs (an ``flock``: it goes with
    a killed holder).  Whatever a holder reads of a record or claim stays so until it lets go,
    except for a reservation's ``O_EXCL`` creates of files that did not exist."""
    path = CLAIMS / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        CLAIMS.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


def _claim(base: int, record: Path) -> bool:
    """Claim the slot at ``base`` host-wide for the record at ``record``; take over a stale claim.

    The take-over holds the lock: two instances that both found the same stale claim would
    otherwise each remove what they read as stale -- the second one the first's fresh claim --
    and both hold the slot."""
    claim = CLAIMS / str(base)
    if _create(claim, str(record)):
        return True
    with _locked():
        try:
            holder = Path(claim.read_text())
        except FileNotFoundError:  # released meanwhile
            return _create(claim, str(record))
        except (OSError, ValueError):
            return False
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


def _reserve(records: Path, base: int, owner: str) -> bool:
    record = records / str(base)
    if not _create(record, owner):
        return False
    if _claim(base, record):
        return True
    record.unlink(missing_ok=True)  # another state directory's live sandbox holds it
    return False


def allocate_range(state_dir: Path, owner: str, pool: int | None = None) -> UidRange:
    """Reserve a range of host ids no host user and no other live sandbox on this host uses,
    from the pool starting at ``pool`` (default: this host's, :data:`UID_BASE`).

    Random draws (O(1) while the pool is not nearly full); after 100 misses, one pass over
    every slot from a random one, so that a nearly full pool still yields its last slots."""
    if pool is None and _POOL_ERROR is not None:
        raise _POOL_ERROR
    pool = UID_BASE if pool is None else pool
    slots = (UID_TOP - pool) // RANGE_SIZE
    records = _records(state_dir)
    taken = _host_slots_cached(pool)
    rng = random.SystemRandom()
    for _ in range(100):
        slot = rng.randrange(slots)
        if slot not in taken and _reserve(records, pool + slot * RANGE_SIZE, owner):
            return UidRange(pool + slot * RANGE_SIZE)
    first = rng.randrange(slots)
    for slot in [*range(first, slots), *range(first)]:
        if slot not in taken and _reserve(records, pool + slot * RANGE_SIZE, owner):
            return UidRange(pool + slot * RANGE_SIZE)
    raise ResourceLimit(f"all {slots} ranges of host uids are in use (or a host user's): no sandbox can start")


def release_range(state_dir: Path, uid: int, *, owner: str) -> bool:
    """Release the slot holding ``uid`` (its record in ``state_dir`` and its host-wide claim) if
    it is still ``owner``'s: its record names ``owner``.  Returns whether it released it.

    A slot released already and reserved again since is another owner's: its record and claim
    are left to it (see the module docstring)."""
    try:
        base = range_of(uid).base
    except ValueError:
        return False  # not one of ours (a record from before ranges): nothing host-wide to release
    record = state_dir / "uids" / str(base)
    claim = CLAIMS / str(base)
    with _locked():
        try:
            if record.read_text().strip() != owner:
                return False  # released already (and maybe another owner's now)
        except FileNotFoundError:
            return False
        try:
            if Path(claim.read_text()) == record.resolve():
                claim.unlink(missing_ok=True)
        except (FileNotFoundError, ValueError):
            pass
        record.unlink(missing_ok=True)
    return True


def process_owner(kind: str) -> str:
    """The owner name of a slot this process holds for its own brief use: ``KIND@PID.START``
    (its start time tells a reused pid apart), which :func:`release_ranges_of_dead_processes`
    releases once the process is gone."""
    pid = os.getpid()
    return f"{kind}@{pid}.{process_start_time(pid)}"


def release_ranges_of_dead_processes(state_dir: Path) -> list[int]:
    """Release the slots of :func:`process_owner` owners that are gone (killed mid-probe or
    mid-boot: their QEMU died with them); returns their bases.  The janitor's (``gc``)."""
    released = []
    records = state_dir / "uids"
    for record in records.glob("[0-9]*") if records.is_dir() else ():
        try:
            owner = record.read_text().strip()
        except OSError:
            continue
        if owner_is_gone(owner) and release_range(state_dir, int(record.name), owner=owner):
            released.append(int(record.name))
    return released


def owner_is_gone(owner: str) -> bool:
    """Whether the process a :func:`process_owner` name names has ended (False for any other name).

    Also the older ``KIND:PID`` names (the wasm tier's standby guests before they took
    :func:`process_owner` names): gone when no process has that pid."""
    if "@" not in owner:
        kind, colon, pid = owner.rpartition(":")
        return bool(kind and colon and pid.isdigit()) and process_start_time(int(pid)) is None
    pid, _, start = owner.rpartition("@")[2].partition(".")
    if not pid.isdigit() or not start.isdigit():
        return False
    return process_start_time(int(pid)) != int(start)


def set_owner(state_dir: Path, uid: int, owner: str, *, previous: str) -> None:
    """Hand the slot holding ``uid`` from ``previous`` to ``owner`` (the janitor reaps it by that
    name); an error if it is no longer ``previous``'s."""
    record = state_dir / "uids" / str(range_of(uid).base)
    with _locked():
        try:
            holder = record.read_text().strip()
        except FileNotFoundError:
            holder = None
        if holder != previous:
            raise ResourceLimit(f"the uid range {record.name} is no longer {previous}'s (released)")
        record.write_text(owner)


def allocate_uid(state_dir: Path, owner: str) -> int:
    """Reserve a range and return its sandbox-user uid, for owners that run as one host uid."""
    return allocate_range(state_dir, owner).user


#: the same as :func:`release_range`: any uid of the slot releases it
release_uid = release_range
