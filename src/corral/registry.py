"""The on-disk registry of live sandboxes, and the janitor that reaps orphans.

Every sandbox is recorded (SQLite, in the state directory) *before* any of its
resources exist, with its owner's pid and start time.  When an owner dies
(``kill -9``), its sandboxes' processes die with it (``--die-with-parent``; a frozen
sandbox's by the watch its owner started at its first pause, :mod:`corral.host.owner_watch`),
and :func:`gc` — run by ``corral gc`` and at every library start — releases
what is left: cgroups, mounts, directories, reserved uids.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import HostNotSupported
from .host import cgroups, grace
from .host.procs import named_process_lives, process_start_time
from .host.sockets import staging_of_dead_processes
from .host.uids import release_ranges_of_dead_processes, release_uid

DEFAULT_STATE_DIR = Path("/var/lib/corral")

#: what a janitor in another environment needs to find a sandbox's host side, kept in every row
#: from its first moment: the parent its cgroups are made under is the owner's
#: ``CORRAL_CGROUP_PARENT``, and a ``corral gc`` run without it looked under its own
#: (reaped the sandbox's mounts and directory, kept its cgroups)
_OWNERS_HOST_SIDE = {"cgroup_parent": cgroups.PARENT}


def is_a_state_dir(path: Path) -> bool:
    """Whether ``path`` has a state directory's layout (this instance's or any other's): its
    ``sandboxes/`` and its registry (an SQLite file) or its owners' or uid ranges' records."""
    if not (path / "sandboxes").is_dir():
        return False
    if (path / "owners").is_dir() or (path / "uids").is_dir():
        return True
    try:  # (non-blocking, not followed: the path is anybody's, a FIFO or a link there is no registry)
        fd = os.open(path / "registry.db", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 16) == b"SQLite format 3\0"
    finally:
        os.close(fd)


def state_dir(explicit: str | Path | None = None) -> Path:
    """The state directory: explicit, else $CORRAL_STATE_DIR, else /var/lib/corral."""
    path = Path(explicit or os.environ.get("CORRAL_STATE_DIR") or DEFAULT_STATE_DIR)
    try:
        path.mkdir(parents=True, exist_ok=True)
        _check_only_we_can_change(path)
        # 0711: sandbox launchers (unprivileged uids) traverse it; nobody lists it
        os.chmod(path, 0o711)
        (path / "sandboxes").mkdir(exist_ok=True)
        os.chmod(path / "sandboxes", 0o711)
    except PermissionError as exc:
        raise HostNotSupported(f"cannot use state directory {path}: {exc}; run as root or set CORRAL_STATE_DIR") from exc
    return path


def _check_only_we_can_change(path: Path) -> None:
    """Refuse a state directory that another user could change or replace (as OpenSSH's
    StrictModes does): Corral trusts what it finds there (images, owner sockets, records of
    what to unmount and kill) and, as root, chmods and writes in it.  A ``/tmp/corral`` made in
    advance by another user, or a link of theirs to ``/etc``, would hand them all of that.

    The directory must be owned by this process's user; every directory above it, on the path
    as given and on the path its links lead to, by root or by that user, and writable by nobody
    else unless sticky (``/tmp``); every link on the way, made by one of them."""
    trusted = (0, os.geteuid())
    given = Path(os.path.abspath(path))
    for step in (*reversed(given.parents), given):
        st = os.lstat(step)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
            raise HostNotSupported(f"cannot use state directory {path}: {step} is a link made by uid {st.st_uid}")
    real = Path(os.path.realpath(path))
    st = os.stat(real)
    if st.st_uid != trusted[1]:
        raise HostNotSupported(f"cannot use state directory {path}: it belongs to uid {st.st_uid}, not to this "
                               f"process's user ({trusted[1]}); use a directory only you can change")
    for above in {*given.parents, *real.parents}:
        st = os.stat(above)
        if st.st_uid not in trusted or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise HostNotSupported(f"cannot use state directory {path}: {above} (uid {st.st_uid}, mode "
                                   f"{stat.S_IMODE(st.st_mode):o}) may be changed by another user")


_self_identity: tuple[int, int] = (-1, 0)


def self_identity() -> tuple[int, int]:
    """(pid, start time) of this process, recomputed after a fork."""
    global _self_identity
    pid = os.getpid()
    if _self_identity[0] != pid:
        _self_identity = (pid, process_start_time(pid) or 0)
    return _self_identity


@dataclass
class Row:
    id: str
    tier: str
    run_dir: Path
    owner_pid: int
    owner_start: int
    created: float
    record: dict[str, Any]

    def owner_alive(self) -> bool:
        return process_start_time(self.owner_pid) == self.owner_start


#: how long a first connection retries a database another connection is turning to WAL
PREPARE_TIMEOUT = 30.0


def _prepare(db: sqlite3.Connection) -> None:
    """WAL mode and the table, on a connection of a database other threads and processes may be
    preparing at the same moment (the first creates of a burst on a new state directory).

    Turning a database to WAL takes an exclusive lock, and SQLite answers "database is locked"
    at once, without waiting out the busy timeout, when another connection holds a lock it
    cannot wait for: so the mode is read first (WAL persists in the file) and the whole is
    retried until :data:`PREPARE_TIMEOUT`."""
    deadline = time.monotonic() + PREPARE_TIMEOUT
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS sandboxes (id TEXT PRIMARY KEY, tier TEXT NOT NULL, "
                "run_dir TEXT NOT NULL, owner_pid INTEGER NOT NULL, owner_start INTEGER NOT NULL, "
                "created REAL NOT NULL, record TEXT NOT NULL DEFAULT '{}')"
            )
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


#: held while this process makes the database file and while its connections open: a descriptor
#: of the file closed while another thread's connection holds SQLite's POSIX locks drops them
#: (the locks are the process's), and writers then corrupt the database
_opening = threading.Lock()


def _reset_opening() -> None:
    global _opening
    _opening = threading.Lock()  # a child forked while another thread held it starts free


os.register_at_fork(after_in_child=_reset_opening)


def _made_private(path: Path) -> None:
    """The database root's alone, before any row is in it (SQLite gives its -wal and -shm files
    the same mode): it names every sandbox's run directory, host uid and owner, and the metadata
    users gave them. Made with O_EXCL, so only a file no connection can have open yet is opened
    and closed here; an existing one is only chmod'ed (0644 from an earlier Corral)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600))
        return
    except FileExistsError:
        pass
    if stat.S_IMODE(os.stat(path).st_mode) != 0o600:
        os.chmod(path, 0o600)


class Registry:
    """Rows of live sandboxes. One instance per state dir (:meth:`at`), one connection per thread."""

    _instances: dict[Path, Registry] = {}
    _instances_lock = threading.Lock()

    def __init__(self, root: Path) -> None:
        self.root = root
        self._local = threading.local()

    @classmethod
    def at(cls, root: Path) -> Registry:
        """The shared registry of a state dir (a Registry per call would open a connection per call)."""
        with cls._instances_lock:
            registry = cls._instances.get(root)
            if registry is None:
                registry = cls._instances[root] = cls(root)
            return registry

    def _db(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None or getattr(self._local, "pid", None) != os.getpid():
            path = self.root / "registry.db"
            with _opening:
                _made_private(path)
                db = sqlite3.connect(path, timeout=30, isolation_level=None)
                _prepare(db)
            self._local.db = db
            self._local.pid = os.getpid()
        return db

    def add(self, sandbox_id: str, tier: str, run_dir: Path) -> None:
        pid, start = self_identity()
        self._db().execute(
            "INSERT INTO sandboxes VALUES (?, ?, ?, ?, ?, ?, ?)",
            (sandbox_id, tier, str(run_dir), pid, start, time.time(), json.dumps(_OWNERS_HOST_SIDE)),
        )

    def set_record(self, sandbox_id: str, record: dict[str, Any]) -> None:
        record = {**record, **_OWNERS_HOST_SIDE}
        self._db().execute("UPDATE sandboxes SET record = ? WHERE id = ?", (json.dumps(record), sandbox_id))

    def remove(self, sandbox_id: str) -> None:
        self._db().execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    def rows(self) -> list[Row]:
        cur = self._db().execute("SELECT id, tier, run_dir, owner_pid, owner_start, created, record FROM sandboxes")
        return [Row(r[0], r[1], Path(r[2]), r[3], r[4], r[5], json.loads(r[6])) for r in cur.fetchall()]


#: an owner ends its sandbox when its lifetime is over; past this much later, the janitor does
#: (an owner that is stopped, hung or swapped out must not keep a sandbox beyond its lifetime)
LIFETIME_GRACE = 5.0


def _lifetime_over(row: Row, now: float) -> bool:
    end_at = (row.record.get("corral") or {}).get("end_at")
    return isinstance(end_at, (int, float)) and now > end_at + LIFETIME_GRACE


def gc(root: Path) -> list[str]:
    """Reap every sandbox whose owner is dead or whose lifetime ended more than
    :data:`LIFETIME_GRACE` seconds ago (those paused to disk too: their record and saved state),
    and stray directories. Returns reaped ids."""
    from .snapshots import reap_expired_parked
    from .tiers import get_tier

    registry = Registry.at(root)
    reaped: list[str] = []
    live_ids: set[str] = set()
    now = time.time()
    for row in registry.rows():
        if row.owner_alive() and not _lifetime_over(row, now):
            live_ids.add(row.id)
            continue
        try:
            get_tier(row.tier, root).reap(row.id, row.run_dir, row.record)
        except Exception:
            shutil.rmtree(row.run_dir, ignore_errors=True)
        registry.remove(row.id)
        reaped.append(row.id)
    # paused to disk: no row, no owner process; the lifetime holds all the same (parked.py)
    reaped += reap_expired_parked(root, now, LIFETIME_GRACE)
    # directories with no row: a crash between mkdir and the INSERT cannot
    # happen (the row comes first), but a hand-deleted database can
    sandboxes = root / "sandboxes"
    if sandboxes.is_dir():
        for run_dir in sandboxes.iterdir():
            if run_dir.name not in live_ids and time.time() - run_dir.stat().st_mtime > 60:
                from .host import mounts

                mounts.unmount_all(run_dir)
                shutil.rmtree(run_dir, ignore_errors=True)
    for entry in _of_dead_processes(root / "owners"):  # owner-link sockets (corral.owner_link)
        entry.unlink(missing_ok=True)
    # one killed as it bound its socket: an owner link's, or the daemon's (beside daemon.sock);
    # a port forward's is in its sandbox's run directory, which goes with it
    for staging in (*staging_of_dead_processes(root / "owners"), *staging_of_dead_processes(root)):
        shutil.rmtree(staging, ignore_errors=True)
    if any(_of_dead_processes(root / "wasm-spares")):
        # a killed owner's pre-started wasm guests (tmpfs, uid); the wasm tier's import costs
        # ~40 ms, so only when there is one: this runs on every process's first create
        from .tiers.wasm.standby import reap_stale as reap_stale_standby_guests

        reap_stale_standby_guests(root)
    from .snapshots import reap_leftovers

    reap_leftovers(root)  # half-written snapshots of dead writers
    _release_orphan_ranges(root, registry)
    release_ranges_of_dead_processes(root)  # a probe's, a template boot's: their process is gone
    grace.reap_left_open()  # a cgroup-move window a killed process left open
    known = {row.id for row in registry.rows()}
    _remove_orphan_helper_groups(known)
    _remove_abandoned_groups(known)
    return reaped


def _remove_orphan_helper_groups(known: set[str]) -> list[str]:
    """Kill and remove the groups of helpers whose sandbox is gone: a microVM snapshot's
    converter (``<id>-snapshot``, a QEMU holding a copy of the guest's RAM, running as the
    sandbox's uids) that its owner lost kept its group and memory after the sandbox was destroyed,
    past the owner's exit, reparented to init.  A sandbox ends its helpers before its own group
    goes, so a helper's group with no row here and no sandbox group of its id in any hierarchy
    (another state directory's live sandbox has one) has no owner; returns their names."""
    from .host import cgroups

    try:
        groups = cgroups.list_sandbox_groups()
    except (HostNotSupported, OSError):
        return []
    removed = []
    for name in groups - known:
        sandbox_id, _, helper = name.rpartition("-")
        if not (sandbox_id.startswith("sb-") and sandbox_id.count("-") == 1 and helper):
            continue  # not ``sb-<hex>-<helper>``
        if sandbox_id in known or sandbox_id in groups:
            continue
        cgroups.reap(name)  # (its processes killed in every hierarchy)
        removed.append(name)
    return removed


#: a sandbox cgroup no row knows, with no process, unchanged this long, is garbage
ABANDONED_AFTER = 600.0


def _remove_abandoned_groups(known: set[str], idle_for: float = ABANDONED_AFTER) -> list[str]:
    """Remove sandbox cgroups that nothing owns any more: a state directory deleted with its
    registry (a test's temporary one, by hand) leaves groups no janitor's row names.  Only a group
    no row of this state directory knows, holding no process in any hierarchy (every live sandbox
    of any owner has at least its agent or VMM there), unchanged for ``idle_for`` seconds (one
    being made by another owner right now is younger); returns their names."""
    from .host import cgroup_tree, cgroups

    try:
        layout = cgroups.detect()
    except (HostNotSupported, OSError):
        return []
    roots = {*layout.controllers.values(), layout.kill_root}
    now = time.time()
    removed = []
    for name in cgroups.list_sandbox_groups() - known:
        if not name.startswith("sb-"):
            continue
        groups = [root / cgroups.PARENT / name for root in roots]
        try:
            # the age first (one stat a hierarchy): only an old group's tree is walked for processes,
            # and this runs in every process's first create
            if any(now - group.stat().st_mtime < idle_for for group in groups if group.is_dir()):
                continue
            held = any(cgroup_tree.read_pids(Path(top)) for group in groups if group.is_dir()
                       for top, _, _ in os.walk(group))
        except OSError:
            continue
        if not held:
            cgroups.reap(name)
            removed.append(name)
    return removed


def _release_orphan_ranges(root: Path, registry: Registry) -> None:
    """Release uid ranges reserved for a sandbox that has no row (a crash between the two).

    The ranges are read *before* the rows: a sandbox's row is added before its range is
    reserved, so a range seen here whose owner has no row afterwards is an orphan.  Read the
    other way round, a sandbox created in between (row, then range) had its range released
    while it ran, and the next create could be handed the same host uids."""
    uids = root / "uids"
    if not uids.is_dir():
        return
    reserved: dict[Path, str] = {}
    for entry in uids.iterdir():
        try:
            owner = entry.read_text().strip()
        except OSError:
            continue
        # only sandbox reservations: the others name a process (the wasm tier's standby guests,
        # probes, template boots) and are released once it is gone
        if owner.startswith("sb-") and entry.name.isdigit():
            reserved[entry] = owner
    if not reserved:
        return
    known = {r.id for r in registry.rows()}
    for entry, owner in reserved.items():
        if owner in known:
            continue
        try:
            if entry.read_text().strip() != owner:
                continue  # released and reserved again meanwhile, by a sandbox with a row
        except OSError:
            continue
        release_uid(root, int(entry.name), owner=owner)  # the record and its host-wide claim, if still its


def _of_dead_processes(directory: Path) -> list[Path]:
    """Entries of ``directory`` named for a process (``PID.sock``, ``PID-...``, ``PID.START-...``)
    that is gone."""
    if not directory.is_dir():
        return []
    return [entry for entry in directory.iterdir()
            if named_process_lives(entry.name.removesuffix(".sock").split("-", 1)[0]) is False]
