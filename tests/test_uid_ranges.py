"""Host uid ranges: every sandbox gets 65,536 host uids and gids of its own, from a range
reserved for Corral, never a host user's, a subordinate range's or another live sandbox's."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from corral import Sandbox
from corral.errors import InvalidSpec
from corral.host import uids

from .leaks import kill_9, ranges_of, run_gc, start_owner


def _host_ids(sb: Sandbox) -> set[int]:
    """The host uids and gids of every process of the sandbox (from its cgroup)."""
    from corral.host import cgroup_tree, cgroups

    group = cgroups.detect().kill_root / cgroups.PARENT / sb.id
    found: set[int] = set()
    for pid in {pid for g in [group, *group.rglob("*")] if g.is_dir() for pid in cgroup_tree.read_pids(g)}:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(("Uid:", "Gid:")):
                    found |= {int(v) for v in line.split()[1:]}
        except OSError:
            continue
    return found


def _own_claims(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Host-wide claims in a directory of the test's own: these tests draw given slots, which a live
    sandbox of another run on this host (or a claim an interrupted run left, whose record pytest
    keeps) may hold in the real one; then the draws ran out (StopIteration) and the next runs failed too."""
    monkeypatch.setattr(uids, "CLAIMS", tmp_path / "claims")
    uids._records_made.clear()


def test_host_users_and_subordinate_ranges_are_never_handed_out(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    slot = lambda n: uids.UID_BASE + n * uids.RANGE_SIZE  # noqa: E731
    passwd, group, subuid, subgid = (tmp_path / n for n in ("passwd", "group", "subuid", "subgid"))
    passwd.write_text(f"root:x:0:0::/root:/bin/sh\nbig:x:{slot(3) + 5}:100::/:/bin/sh\nbad:x:notanumber\n")
    group.write_text(f"grp:x:{slot(4)}:\n")
    subuid.write_text(f"alice:{slot(6) - 10}:{uids.RANGE_SIZE + 20}\n")  # the end of slot 5 to the start of 7
    subgid.write_text(f"bob:{slot(9)}:1\n")
    taken = uids.host_slots((passwd, group, subuid, subgid))
    assert {3, 4, 5, 6, 7, 9} <= taken and not {0, 1, 2, 8, 10} & taken
    # the single uids of earlier Corral versions (which may still run on this host) are left alone too
    assert set(range((uids.LEGACY[0] - uids.UID_BASE) // uids.RANGE_SIZE,
                     (uids.LEGACY[1] - uids.UID_BASE) // uids.RANGE_SIZE + 1)) <= taken

    # allocation reads the host's files (again when they change) and skips what they use
    monkeypatch.setattr(uids, "ID_FILES", (passwd, group, subuid, subgid))
    _own_claims(monkeypatch, tmp_path)
    draws = iter([3, 5, 9, 8])
    monkeypatch.setattr(uids.random.SystemRandom, "randrange", lambda self, n: next(draws))
    state = tmp_path / "state"
    state.mkdir()
    got = uids.allocate_range(state, "sb-x")
    try:
        assert got.base == slot(8) and got.user == slot(8) + 1000 and got.host(0) == slot(8)
        assert got.user in got and slot(9) not in got
    finally:
        uids.release_range(state, got.user, owner="sb-x")
    assert not list((state / "uids").iterdir()) and not (uids.CLAIMS / str(got.base)).exists()
    passwd.write_text(f"now:x:{slot(8) + 77}:1::/:/bin/sh\n")
    os.utime(passwd, ns=(1, 1))  # a different mtime: the cache must notice
    draws = iter([8, 10])
    got = uids.allocate_range(state, "sb-y")
    uids.release_range(state, got.base, owner="sb-y")
    assert got.base == slot(10)


def test_the_real_host_ids_are_outside_every_range() -> None:
    ids = []
    for path in (Path("/etc/passwd"), Path("/etc/group")):
        ids += [int(line.split(":")[2]) for line in path.read_text().splitlines() if line.count(":") >= 2]
    taken = uids.host_slots()
    for i in ids:
        if uids.UID_BASE <= i < uids.UID_TOP:
            assert (i - uids.UID_BASE) // uids.RANGE_SIZE in taken


def test_live_sandboxes_have_disjoint_ranges_and_run_inside_their_own(state_dir: Path) -> None:
    with Sandbox.create() as a, Sandbox.create() as b:
        handles = [sb.commands.start("exec sleep 30") for sb in (a, b)]
        try:
            (ra,), (rb,) = ranges_of(a.id, state_dir), ranges_of(b.id, state_dir)
            assert ra != rb and abs(ra - rb) >= uids.RANGE_SIZE
            for sb, base in ((a, ra), (b, rb)):
                ids = _host_ids(sb)
                assert ids and all(base <= i < base + uids.RANGE_SIZE for i in ids), (base, ids)
                assert (uids.CLAIMS / str(base)).read_text() == str((state_dir / "uids" / str(base)).resolve())
        finally:
            for handle in handles:
                handle.kill()
                handle.wait()
    assert ranges_of(a.id, state_dir) == [] and not (uids.CLAIMS / str(ra)).exists()


def test_gc_frees_the_range_of_a_killed_owner(state_dir: Path) -> None:
    owner, (sandbox_id,) = start_owner("sb = Sandbox.create()\nprint(sb.id, flush=True)")
    try:
        (base,) = ranges_of(sandbox_id, state_dir)
        assert (uids.CLAIMS / str(base)).exists()
    finally:
        kill_9(owner)
    run_gc(sandbox_id, timeout=60)
    assert ranges_of(sandbox_id, state_dir) == [] and not (uids.CLAIMS / str(base)).exists()


def test_gc_releases_a_dead_processs_probe_range_and_only_that(state_dir: Path) -> None:
    # a range a process holds for itself (the microVM tier's idmap probe, a template boot) has no
    # sandbox row: before, one whose process was killed mid-probe stayed reserved for ever
    from corral.registry import gc

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom corral.host import uids\n"
         "r = uids.allocate_range(Path(sys.argv[1]), uids.process_owner('microvm-probe'))\n"
         "print(r.base, flush=True)\ntime.sleep(300)\n", str(state_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        dead = int(holder.stdout.readline())
    finally:
        holder.kill()
        holder.wait()
    mine = uids.allocate_range(state_dir, uids.process_owner("microvm-probe"))  # alive: kept
    # a pid reused since: the same pid, another process (its start time differs)
    reused = uids.allocate_range(state_dir, f"microvm-probe@{os.getpid()}.1")
    try:
        for base in (dead, mine.base, reused.base):
            assert (state_dir / "uids" / str(base)).exists() and (uids.CLAIMS / str(base)).exists()
        gc(state_dir)
        for base in (dead, reused.base):
            assert not (state_dir / "uids" / str(base)).exists() and not (uids.CLAIMS / str(base)).exists()
        assert (state_dir / "uids" / str(mine.base)).read_text().startswith(f"microvm-probe@{os.getpid()}.")
        assert (uids.CLAIMS / str(mine.base)).exists()
    finally:
        uids.release_range(state_dir, mine.base, owner=uids.process_owner("microvm-probe"))
        uids.release_range(state_dir, reused.base, owner=f"microvm-probe@{os.getpid()}.1")


def test_gc_releases_a_dead_standby_guests_and_builds_range_without_their_directories(state_dir: Path) -> None:
    """The wasm tier's standby guests (and image builds) reserve a range before their directory
    (record) exists: an owner killed in between left the range reserved for ever, because gc
    looked for it only through a standby directory. Their ranges now carry process names; an
    older version's ``wasm-spare:PID`` record of a dead process goes too."""
    from corral.registry import gc
    from corral.tiers.wasm.standby import OWNER_KIND

    code = ("import sys, time\nfrom pathlib import Path\nfrom corral.host import uids\n"
            "for kind in sys.argv[2:]:\n"
            "    print(uids.allocate_range(Path(sys.argv[1]), uids.process_owner(kind)).base, flush=True)\n"
            "time.sleep(300)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(state_dir), OWNER_KIND, "image-build"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        dead = [int(holder.stdout.readline()) for _ in range(2)]
    finally:
        holder.kill()
        holder.wait()
    legacy = uids.allocate_range(state_dir, f"wasm-spare:{holder.pid}")  # that pid: gone
    mine = uids.allocate_range(state_dir, f"wasm-spare:{os.getpid()}")  # alive: kept
    try:
        gc(state_dir)
        for base in (*dead, legacy.base):
            assert not (state_dir / "uids" / str(base)).exists() and not (uids.CLAIMS / str(base)).exists()
        assert (state_dir / "uids" / str(mine.base)).exists() and (uids.CLAIMS / str(mine.base)).exists()
    finally:
        uids.release_range(state_dir, mine.base, owner=f"wasm-spare:{os.getpid()}")
        uids.release_range(state_dir, legacy.base, owner=f"wasm-spare:{holder.pid}")


def _proc(tmp_path: Path, name: str, ppid: int) -> Path:
    """A /proc whose pid 2 is ``name`` with parent ``ppid`` (kthreadd, 0: the host's pid namespace)."""
    proc = tmp_path / f"proc-{name}-{ppid}"
    (proc / "2").mkdir(parents=True)
    (proc / "2" / "status").write_text(f"Name:\t{name}\nUmask:\t0022\nPPid:\t{ppid}\n")
    return proc


def test_the_pool_takes_systemds_container_range_only_where_systemd_is_not_init(tmp_path: Path) -> None:
    marker, host = tmp_path / "run-systemd-system", _proc(tmp_path, "kthreadd", 0)
    assert uids.detect_pool(marker, host, override="") == uids.WIDE_BASE == 0x4000_0000
    marker.mkdir()  # systemd is init: nspawn --private-users=pick may draw up to 0x6FFFFFFF
    assert uids.detect_pool(marker, host, override="") == uids.NARROW_BASE == 0x7000_0000
    marker.rmdir()
    # not the host's pid namespace (a container sharing the host's ids): the host's init is unknown
    assert uids.detect_pool(marker, _proc(tmp_path, "sh", 1), override="") == uids.NARROW_BASE
    assert uids.detect_pool(marker, tmp_path / "no-proc", override="") == uids.NARROW_BASE
    # the override wins either way, and nothing else is accepted
    assert uids.detect_pool(marker, host, override="narrow") == uids.NARROW_BASE
    marker.mkdir()
    assert uids.detect_pool(marker, host, override="wide") == uids.WIDE_BASE
    with pytest.raises(InvalidSpec, match="narrow' or 'wide'"):
        uids.detect_pool(marker, host, override="huge")
    # the pool in use is the one the real /run and /proc give (this VM: no systemd, so the wide one)
    expected = uids.detect_pool(Path("/run/systemd/system"), Path("/proc"), override="")
    if not os.environ.get("CORRAL_UID_POOL"):
        assert (expected, (uids.UID_TOP - expected) // uids.RANGE_SIZE) == (uids.UID_BASE, uids.SLOTS)
    assert (uids.UID_TOP - uids.WIDE_BASE) // uids.RANGE_SIZE == 16382
    assert (uids.UID_TOP - uids.NARROW_BASE) // uids.RANGE_SIZE == 4094


def test_a_bad_pool_setting_is_a_typed_error_at_the_first_create_not_a_failed_import(tmp_path: Path) -> None:
    env = {**os.environ, "CORRAL_UID_POOL": "huge", "CORRAL_STATE_DIR": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-m", "corral.cli", "run", "--", "true"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "CORRAL_UID_POOL must be 'narrow' or 'wide', not 'huge'" in r.stderr
    assert not any((tmp_path / "state").glob("uids/*"))  # nothing reserved


def test_the_wide_pool_skips_host_users_and_subordinate_ranges_in_its_extended_part(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wide, narrow = uids.WIDE_BASE, uids.NARROW_BASE
    slot = lambda n: wide + n * uids.RANGE_SIZE  # noqa: E731
    passwd, group, subuid, subgid = (tmp_path / n for n in ("passwd", "group", "subuid", "subgid"))
    passwd.write_text(f"lxd:x:{slot(1) + 7}:100::/:/bin/sh\n")
    group.write_text(f"g:x:{slot(2)}:\n")
    subuid.write_text(f"root:{slot(5) - 1}:{3 * uids.RANGE_SIZE}\n")  # slots 4 to 7
    subgid.write_text(f"root:{narrow}:{uids.RANGE_SIZE}\n")  # the narrow pool's first slot
    files = (passwd, group, subuid, subgid)
    first_narrow = (narrow - wide) // uids.RANGE_SIZE
    taken = uids.host_slots(files, base=wide)
    assert {1, 2, 4, 5, 6, 7, first_narrow} <= taken and not {0, 3, 8, first_narrow + 1} & taken
    assert 0 in uids.host_slots(files, base=narrow) and 1 not in uids.host_slots(files, base=narrow)
    # allocation from the wide pool draws over it and skips them; a narrow-pool slot is one of its slots
    monkeypatch.setattr(uids, "ID_FILES", files)
    _own_claims(monkeypatch, tmp_path)
    draws = iter([1, 2, 4, 7, first_narrow, 3, first_narrow + 1])
    monkeypatch.setattr(uids.random.SystemRandom, "randrange", lambda self, n: next(draws))
    state = tmp_path / "state"
    state.mkdir()
    got = [uids.allocate_range(state, "sb-w", pool=wide) for _ in range(2)]
    try:
        assert [g.base for g in got] == [slot(3), narrow + uids.RANGE_SIZE]
        assert uids.range_of(got[0].user) == got[0] and uids.range_of(got[1].base + 65535) == got[1]
        assert all((uids.CLAIMS / str(g.base)).exists() for g in got)
    finally:
        for g in got:
            uids.release_range(state, g.user, owner="sb-w")
    assert not list((state / "uids").iterdir()) and not any((uids.CLAIMS / str(g.base)).exists() for g in got)


def test_a_nearly_full_pool_still_hands_out_its_last_free_slot(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # every slot of the narrow pool but its last is a host user's: random draws miss, the pass finds it
    narrow_slots = (uids.UID_TOP - uids.NARROW_BASE) // uids.RANGE_SIZE
    lines = [f"u{n}:x:{uids.NARROW_BASE + n * uids.RANGE_SIZE}:1::/:/bin/sh" for n in range(narrow_slots)]
    passwd = tmp_path / "passwd"
    passwd.write_text("\n".join(lines[:narrow_slots - 1]) + "\n")
    monkeypatch.setattr(uids, "ID_FILES", (passwd,))
    _own_claims(monkeypatch, tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    got = uids.allocate_range(state, "sb-last", pool=uids.NARROW_BASE)
    uids.release_range(state, got.user, owner="sb-last")
    assert got.base == uids.UID_TOP - uids.RANGE_SIZE
    passwd.write_text("\n".join(lines[:narrow_slots]) + "\n")
    with pytest.raises(uids.ResourceLimit):
        uids.allocate_range(state, "sb-none", pool=uids.NARROW_BASE)


def test_a_janitor_running_beside_creates_never_frees_a_live_sandboxs_range(tmp_path: Path) -> None:
    """A sandbox's row comes before its range; a janitor that read the rows and then the ranges
    took a range reserved in between for an orphan's and released it while its sandbox ran."""
    from corral.registry import Registry, gc, state_dir

    root = state_dir(tmp_path / "state")
    registry = Registry.at(root)
    for n in range(40):  # orphans: a range with no row, which the janitor must release
        uids.allocate_range(root, f"sb-orphan-{n}")
    stop = threading.Event()
    janitor_rounds = 0

    def janitor() -> None:
        nonlocal janitor_rounds
        while not stop.is_set():
            gc(root)
            janitor_rounds += 1

    thread = threading.Thread(target=janitor)
    thread.start()
    live: list[tuple[str, uids.UidRange]] = []
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and len(live) < 3000:
            sandbox_id = f"sb-live-{len(live)}"
            registry.add(sandbox_id, "process", root / "sandboxes" / sandbox_id)  # as start_inner does
            live.append((sandbox_id, uids.allocate_range(root, sandbox_id)))
    finally:
        stop.set()
        thread.join()
    try:
        assert janitor_rounds > 2
        freed = [sandbox_id for sandbox_id, got in live
                 if not (root / "uids" / str(got.base)).exists() or not (uids.CLAIMS / str(got.base)).exists()]
        assert freed == [], f"the janitor released the ranges of {len(freed)} of {len(live)} live sandboxes"
        assert sorted(e.read_text() for e in (root / "uids").iterdir()) == sorted(i for i, _ in live)
    finally:
        for sandbox_id, got in live:
            uids.release_range(root, got.base, owner=sandbox_id)
            registry.remove(sandbox_id)
