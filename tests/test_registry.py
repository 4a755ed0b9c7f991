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
