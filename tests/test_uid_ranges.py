"""Host uid ranges: every sandbox gets 65,536 host uids and gids of its own, from a range
reserved for Corral, never a host user's, a subordinate range's or another live sandbox's."""

from __future__ import annotations

import os
import signal
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


def _draw_first(monkeypatch: pytest.MonkeyPatch, base: int) -> None:
    """The next draw of a slot lands on the one at ``base`` (1 in 16,382 otherwise); later ones are random."""
    real = uids.random.SystemRandom.randrange
    forced = [(base - uids.UID_BASE) // uids.RANGE_SIZE]
    monkeypatch.setattr(uids.random.SystemRandom, "randrange",
                        lambda self, n: forced.pop() if forced else real(self, n))


def _held(state_dir: Path, base: int, owner: str) -> bool:
    """Whether the range at ``base`` is reserved for ``owner``: its record names it, its claim the record."""
    record = state_dir / "uids" / str(base)
    try:
        return (record.read_text() == owner
                and (uids.CLAIMS / str(base)).read_text() == str(record.resolve()))
    except FileNotFoundError:
        return False


def test_a_release_by_an_owner_that_no_longer_holds_the_range_leaves_its_new_holder(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A range is released only for the owner that holds it: a second release for its earlier
    owner (a stopped owner's late close, a janitor's reap of a row whose range went on) found
    nothing of its own and used to remove the new holder's record and claim."""
    _own_claims(monkeypatch, tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    first = uids.allocate_range(state, "sb-a")
    assert uids.release_range(state, first.user, owner="sb-b") is False  # not sb-b's: left alone
    assert _held(state, first.base, "sb-a")
    assert uids.release_range(state, first.user, owner="sb-a") is True
    assert not (state / "uids" / str(first.base)).exists() and not (uids.CLAIMS / str(first.base)).exists()
    _draw_first(monkeypatch, first.base)
    again = uids.allocate_range(state, "sb-b")  # the same range, now sb-b's
    assert again == first
    # sb-a's late release, from another process (a stopped owner resumed, a janitor)
    code = ("import sys\nfrom pathlib import Path\nfrom corral.host import uids\n"
            "uids.CLAIMS = Path(sys.argv[3])\n"
            "print(uids.release_range(Path(sys.argv[1]), int(sys.argv[2]), owner='sb-a'))\n")
    out = subprocess.run([sys.executable, "-c", code, str(state), str(first.base), str(uids.CLAIMS)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    assert _held(state, first.base, "sb-b")
    _draw_first(monkeypatch, first.base)
    assert uids.allocate_range(state, "sb-c") != first  # still sb-b's: not handed out again
    for sb in ("sb-b", "sb-c"):
        for base in ranges_of(sb, state):
            assert uids.release_range(state, base, owner=sb)
    assert not any((state / "uids").iterdir())


def test_a_stopped_owner_resumed_after_the_janitor_reaped_its_sandbox_leaves_the_next_holders_range(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner stopped past its sandbox's lifetime: the janitor reaps the sandbox and frees its
    range, the next sandbox is given that range; when the owner runs again its lifetime timer
    closes the sandbox -- which released the range a second time, the live sandbox's record and
    claim, and the next create was handed the same host uids while it ran."""
    from corral import registry
    from corral.local_backend import LIVE

    owner = subprocess.Popen([sys.executable, "-c", (
        "import time\nfrom corral import Sandbox\nfrom corral.local_backend import LIVE\n"
        "sb = Sandbox.create(lifetime=2)\ninner = LIVE[sb.id].inner\n"
        "cls = type(inner)\nclose = cls.close\n"
        "def closed(self):\n    close(self)\n    print('closed', flush=True)\n"
        "cls.close = closed\n"
        "print(sb.id, inner.uid_range.base, flush=True)\ntime.sleep(120)\n")],
        stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    b = None
    try:
        assert owner.stdout is not None
        first_id, base_text = owner.stdout.readline().split()
        base = int(base_text)
        owner.send_signal(signal.SIGSTOP)  # a debugger, ^Z, swapped out: past its lifetime
        time.sleep(2.5)
        monkeypatch.setattr(registry, "LIFETIME_GRACE", 0.0)  # (5 s otherwise)
        assert first_id in registry.gc(state_dir)
        assert not (state_dir / "uids" / str(base)).exists()
        _draw_first(monkeypatch, base)
        b = Sandbox.create()
        assert LIVE[b.id].inner.uid_range.base == base
        assert _held(state_dir, base, b.id)
        owner.send_signal(signal.SIGCONT)  # its lifetime timer closes its (reaped) sandbox
        assert owner.stdout.readline().strip() == "closed"
        assert _held(state_dir, base, b.id), "the resumed owner released the range of a live sandbox"
        _draw_first(monkeypatch, base)
        assert uids.allocate_range(state_dir, "sb-next").base != base  # not handed out twice
        for got in ranges_of("sb-next", state_dir):
            uids.release_range(state_dir, got, owner="sb-next")
        assert b.commands.run("id -u").stdout.strip() == "1000"
    finally:
        owner.send_signal(signal.SIGCONT)
        kill_9(owner)
        if b is not None:
            b.kill()
    assert ranges_of(b.id, state_dir) == [] and not (uids.CLAIMS / str(base)).exists()


def test_gc_reaping_a_dead_row_whose_range_went_to_a_live_sandbox_leaves_it(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner killed mid-destroy, after its sandbox's range was released and before its row was
    removed, leaves a row whose reap record names the range; the range goes to the next sandbox.
    The janitor's reap of the dead row then released the live sandbox's range."""
    import corral.local_transport as lt
    from corral.local_backend import LIVE
    from corral.registry import gc

    owner = subprocess.Popen([sys.executable, "-c", (
        "import time\nfrom corral import Sandbox, registry\nfrom corral.local_backend import LIVE\n"
        "sb = Sandbox.create()\nprint(sb.id, LIVE[sb.id].inner.uid_range.base, flush=True)\n"
        "def remove(self, sandbox_id):\n    print('in-window', flush=True)\n    time.sleep(120)\n"
        "registry.Registry.remove = remove\nsb.kill()\n")],
        stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert owner.stdout is not None
        dead_id, base_text = owner.stdout.readline().split()
        base = int(base_text)
        assert owner.stdout.readline().strip() == "in-window"
    finally:
        kill_9(owner)
    assert not (state_dir / "uids" / str(base)).exists()  # released by the destroy; the row is left
    monkeypatch.setattr(lt, "_startup_gc", lambda root: None)  # no sweep of this create's own first
    _draw_first(monkeypatch, base)
    b = Sandbox.create()
    try:
        assert LIVE[b.id].inner.uid_range.base == base
        assert dead_id in gc(state_dir)
        assert _held(state_dir, base, b.id), "gc's reap of a dead row released a live sandbox's range"
        assert b.commands.run("echo yes").stdout.strip() == "yes"
    finally:
        b.kill()
    assert ranges_of(b.id, state_dir) == [] and not (uids.CLAIMS / str(base)).exists()


def test_two_instances_taking_over_one_stale_claim_never_both_hold_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim whose state directory is gone is taken over under the lock, the claim read again
    there: an instance that had found it stale while another took it over no longer removes the
    other's fresh claim."""
    _own_claims(monkeypatch, tmp_path)
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    base = uids.UID_BASE + sorted(set(range(uids.SLOTS)) - uids.host_slots())[0] * uids.RANGE_SIZE
    uids.CLAIMS.mkdir(parents=True)
    (uids.CLAIMS / str(base)).write_text(str(tmp_path / "gone" / "uids" / str(base)))  # stale
    records = uids._records(second)
    (records / str(base)).write_text("sb-second")
    got: list[bool] = []
    with uids._locked():  # the first instance is taking it over
        thread = threading.Thread(target=lambda: got.append(uids._claim(base, records / str(base))))
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive() and not got  # waits for the lock
        mine = uids._records(first) / str(base)
        mine.write_text("sb-first")
        (uids.CLAIMS / str(base)).write_text(str(mine))  # the first instance's fresh claim
    thread.join(10)
    assert got == [False]
    assert (uids.CLAIMS / str(base)).read_text() == str(mine)
    assert uids.release_range(first, base, owner="sb-first")
    assert not (uids.CLAIMS / str(base)).exists()
