"""The on-disk registry of live sandboxes, and the tier instances, under concurrent first use."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.errors import HostNotSupported
from corral.registry import Registry, state_dir

NOBODY = 65534


def test_a_burst_of_first_creates_on_a_new_state_directory_all_register(tmp_path: Path) -> None:
    """Each thread's first connection turns the new database to WAL; SQLite refused the ones
    that came while another held the lock ("database is locked", without waiting), so a burst of
    first creates on a fresh state directory lost some (~1 % of first connections here)."""
    errors: list[BaseException] = []
    for round_ in range(60):
        root = tmp_path / str(round_)
        root.mkdir()
        registry = Registry(root)
        start = threading.Barrier(8)

        def register(n: int, registry: Registry = registry, root: Path = root,
                     start: threading.Barrier = start) -> None:
            start.wait()
            try:
                registry.add(f"sb-{n}", "process", root / f"sb-{n}")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=register, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert sorted(row.id for row in registry.rows()) == [f"sb-{n}" for n in range(8)]


def test_the_registry_is_roots_alone(tmp_path: Path) -> None:
    """It names every sandbox's run directory, host uid and owner, and the metadata users gave
    them: it was 0644, readable by every user of the host who knows its well-known name."""
    import subprocess

    old = tmp_path / "old"
    old.mkdir()
    (old / "registry.db").touch(mode=0o644)  # as an earlier Corral left it
    for root in (tmp_path / "new", old):
        root.mkdir(exist_ok=True)
        registry = Registry(root)
        registry.add("sb-1", "process", root / "sb-1")
        registry.set_record("sb-1", {"corral": {"metadata": {"user": "alice@example.com"}}})
        made = sorted(p.name for p in root.iterdir() if p.name.startswith("registry.db"))
        assert made == ["registry.db", "registry.db-shm", "registry.db-wal"]
        for name in made:
            assert stat.S_IMODE(os.stat(root / name).st_mode) == 0o600, name
        os.chmod(tmp_path, 0o755)
        os.chmod(root, 0o755)  # even where its directory may be listed
        read = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                               "grep", "-c", "alice", *(str(root / n) for n in made)], capture_output=True, text=True)
        assert "Permission denied" in read.stderr and ":1" not in read.stdout


def test_first_connections_beside_busy_writers_leave_the_database_whole(tmp_path: Path) -> None:
    """A thread's first connection must not open and close the database file while another
    thread's connection holds SQLite's locks (POSIX locks are the process's: a close drops them,
    and another process then writes at the same time): making it 0600 that way corrupted the
    registry ("database disk image is malformed") in a full run. Two other processes write
    while this one's threads connect, each beside a busy writer thread; then an integrity check."""
    import sqlite3
    import subprocess
    import sys

    registry = Registry(tmp_path)
    registry.add("sb-first", "process", tmp_path / "sb-first")
    writer = ("import sys\nfrom pathlib import Path\nfrom corral.registry import Registry\n"
              "r = Registry(Path(sys.argv[1]))\n"
              "for i in range(1500):\n"
              "    r.add(f'sb-{sys.argv[2]}-{i}', 'process', Path('/x'))\n"
              "    r.remove(f'sb-{sys.argv[2]}-{i}')\n")
    others = [subprocess.Popen([sys.executable, "-c", writer, str(tmp_path), f"p{n}"]) for n in range(2)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def busy() -> None:
        try:
            i = 0
            while not stop.is_set():
                registry.add(f"sb-busy-{i}", "process", tmp_path / "x")
                registry.remove(f"sb-busy-{i}")
                i += 1
        except BaseException as exc:
            errors.append(exc)

    def connect_once(n: int) -> None:
        try:
            registry.add(f"sb-c{n}", "process", tmp_path / "y")  # this thread's first connection
        except BaseException as exc:
            errors.append(exc)

    busy_thread = threading.Thread(target=busy)
    busy_thread.start()
    n = 0
    while any(p.poll() is None for p in others) and n < 2000:
        joiner = threading.Thread(target=connect_once, args=(n,))
        joiner.start()
        joiner.join()
        n += 1
    stop.set()
    busy_thread.join()
    assert [p.wait() for p in others] == [0, 0]
    assert errors == []
    check = sqlite3.connect(tmp_path / "registry.db").execute("PRAGMA integrity_check").fetchone()
    assert check == ("ok",)
    assert len([r for r in registry.rows() if r.id.startswith("sb-c")]) == n


def test_threads_asking_for_a_tier_at_once_share_one_instance(tmp_path: Path) -> None:
    """A tier instance holds state of its own (spares, caches); the first creates of a burst each
    made one, and all but the last were dropped with whatever they had started."""
    from corral.tiers import get_tier

    got: list[object] = []
    start = threading.Barrier(16)

    def ask() -> None:
        start.wait()
        got.append(get_tier("process", tmp_path))

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 16 and len({id(tier) for tier in got}) == 1


def test_gc_removes_sandbox_cgroups_nothing_owns_and_only_those(tmp_path: Path) -> None:
    """A state directory deleted with its registry leaves sandbox cgroups no janitor's row names
    (two such were found on this host, empty for hours).  gc removes one only if no row of its
    own knows it, no process is in it in any hierarchy, and it has not changed for
    ABANDONED_AFTER seconds; a held one, a known one and a young one stay."""
    import secrets
    import subprocess

    from corral.host import cgroups
    from corral.registry import _remove_abandoned_groups

    layout = cgroups.detect()
    roots = {*layout.controllers.values(), layout.kill_root}
    names = {kind: f"sb-{secrets.token_hex(8)}" for kind in ("abandoned", "held", "known")}
    for name in names.values():
        for root in roots:
            (root / cgroups.PARENT / name / "e1").mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        for root in roots:
            (root / cgroups.PARENT / names["held"] / "e1" / "cgroup.procs").write_text(str(sleeper.pid))
        assert _remove_abandoned_groups({names["known"]}) == []  # all of them young
        removed = _remove_abandoned_groups({names["known"]}, idle_for=0)
        assert names["abandoned"] in removed and not {names["held"], names["known"]} & set(removed)
        left = cgroups.list_sandbox_groups()
        assert names["abandoned"] not in left and {names["held"], names["known"]} <= left
        assert all(not (root / cgroups.PARENT / names["abandoned"]).exists() for root in roots)
    finally:
        sleeper.kill()
        sleeper.wait()
        for name in names.values():
            cgroups.reap(name)


@pytest.fixture
def in_tmp() -> Iterator[Path]:
    """A directory in /tmp (sticky, writable by everyone), as another user's files would be."""
    where = Path(tempfile.mkdtemp(prefix="corral-test-statedir-"))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_a_state_directory_another_user_could_change_is_refused_and_left_alone(in_tmp: Path) -> None:
    """Corral trusts what its state directory holds and, as root, chmods and writes there: a
    directory another user made in advance, a link of theirs (here to a directory standing for
    ``/etc``), or one below a directory anybody may write, was once taken (chmod 0711 on the
    link's target, ``sandboxes/`` made in it)."""
    theirs = in_tmp / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    etc = in_tmp / "etc"
    etc.mkdir(mode=0o755)
    link = in_tmp / "link"
    link.symlink_to(etc)
    os.lchown(link, NOBODY, NOBODY)
    open_to_all = in_tmp / "open"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)  # not sticky: anybody may rename what is in it
    for path, says in [(theirs, "belongs to uid 65534"), (link, "a link made by uid 65534"),
                       (open_to_all / "state", "may be changed by another user")]:
        with pytest.raises(HostNotSupported, match=says):
            state_dir(path)
    assert stat.S_IMODE(etc.stat().st_mode) == 0o755 and not (etc / "sandboxes").exists()
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o755 and not (theirs / "sandboxes").exists()


def test_a_state_directory_only_its_user_can_change_is_taken(in_tmp: Path, tmp_path: Path) -> None:
    # the allowed direction: a new one in /tmp (sticky), one in a private directory, a link of
    # root's to one of its directories (/var/lib/corral -> /srv/corral)
    target = tmp_path / "target"
    target.mkdir()
    link = in_tmp / "link"
    link.symlink_to(target)
    for path in (in_tmp / "new", tmp_path / "private", link):
        assert state_dir(path) == path
        assert (path / "sandboxes").is_dir() and stat.S_IMODE(path.stat().st_mode) == 0o711


def test_a_rows_cgroup_parent_is_used_only_when_it_names_a_group_below_the_roots() -> None:
    # the janitor reaps below the parent the owner's row recorded; anything that would leave the
    # hierarchies (absolute, `..`) is ignored and the janitor's own parent used instead
    from corral.host.cgroups import _is_parent_name

    assert all(_is_parent_name(name) for name in ("corral", "c17-ab12", "tenants/a"))
    assert not any(_is_parent_name(name) for name in ("", "/", "/sys", "..", "a/../..", "a//b", "./a", "a\0b"))


def test_gc_ends_sandboxes_paused_to_disk_past_their_lifetime_and_ls_lists_the_others(tmp_path: Path) -> None:
    """A sandbox paused to disk has no row and no owner process: gc never looked at it, so one
    whose lifetime had passed kept its record and saved state for good, and ``corral ls`` listed
    none.  Now gc ends each whose lifetime (embedded, or a server's deadline) ended more than
    LIFETIME_GRACE ago, with its state; connect() refuses one whose lifetime just ended; ls lists
    the others as paused.  (tests/test_microvm_snapshot.py does it with a real VM.)"""
    import json
    import subprocess
    import sys
    import time

    from corral import Sandbox, SandboxNotFound, parked
    from corral.registry import LIFETIME_GRACE, gc

    root = state_dir(tmp_path / "state")
    now = time.time()
    past = now - LIFETIME_GRACE - 10
    records = {  # sandbox id -> (its embedded end, its server facts)
        "sb-00000000000000a1": (past, {}),  # lifetime long over
        "sb-00000000000000a2": (None, {"tenant": "t", "created": past, "expires_at": past, "idle_timeout": 60.0}),
        "sb-00000000000000a3": (now - 1, {}),  # just over: within the grace
        "sb-00000000000000a4": (now + 600, {}),
        "sb-00000000000000a5": (None, {}),  # no lifetime
    }
    for n, (sandbox_id, (end_at, server)) in enumerate(records.items()):
        snapshot_id = f"snap-00000000000000a{n + 1}"
        (root / "snapshots" / snapshot_id / "files" / "blobs").mkdir(parents=True)
        (root / "snapshots" / snapshot_id / "files" / "manifest.json").write_text("{}")
        (root / "snapshots" / snapshot_id / "meta.json").write_text(json.dumps({
            "id": snapshot_id, "kind": "live", "size": 2, "created": now, "tier": "microvm", "image": "x",
            "digest": "", "parked_by": sandbox_id}))
        parked.save(root, parked.Parked(sandbox_id, snapshot_id, {"tier": "microvm"}, {}, now - 60, end_at, server))
    reaped = gc(root)
    assert {"sb-00000000000000a1", "sb-00000000000000a2"} <= set(reaped)
    assert sorted(r.sandbox_id for r in parked.every(root)) == ["sb-00000000000000a3", "sb-00000000000000a4",
                                                                "sb-00000000000000a5"]
    assert sorted(p.name for p in (root / "snapshots").iterdir() if p.name.startswith("snap-")) == [
        "snap-00000000000000a3", "snap-00000000000000a4", "snap-00000000000000a5"]
    with pytest.raises(SandboxNotFound, match="lifetime"):
        Sandbox.connect("sb-00000000000000a3", state=root)
    assert parked.load(root, "sb-00000000000000a3") is None
    assert not (root / "snapshots" / "snap-00000000000000a3").exists()
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_URL"}
    out = subprocess.run([sys.executable, "-m", "corral.cli", "--state-dir", str(root), "ls", "--json"],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert sorted((row["id"], row["state"]) for row in json.loads(out)) == [
        ("sb-00000000000000a4", "paused"), ("sb-00000000000000a5", "paused")]
