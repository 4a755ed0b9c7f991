"""The on-disk registry of live sandboxes, and the tier instances, under concurrent first use."""

from __future__ import annotations

import threading
from pathlib import Path

from corral.registry import Registry


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
