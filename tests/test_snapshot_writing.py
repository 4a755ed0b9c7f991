"""A snapshot named before it is whole (issue 18: a microVM's memory image is written in the
background after ``snapshot()`` returns).

The store's side is tested on the process tier with a stand-in for the rest still to write
(``HeldWrite``, released by the test): a create from it, or its removal, waits until it is
whole; a failed write removes it; a writer killed mid-write leaves a snapshot no create accepts
(``SnapshotCorrupt``) and ``gc`` removes, while a live writer's is left alone.  The microVM's own
background write is exercised by tests/test_microvm_snapshot.py (every fork and create there
reads a snapshot right after it was returned).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from corral import Sandbox, SnapshotCorrupt, SnapshotNotFound
from corral.registry import gc
from corral.snapshots import DIRECTORY, SnapshotStore, reap_leftovers
from corral.tiers.base import PendingWrite


class HeldWrite(PendingWrite):
    """The rest of a snapshot, written once ``release`` is set (or failing then)."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.fail = fail
        self.bytes_at_most = 1 << 20
        self.abandoned = threading.Event()

    def finish(self, dest: Path) -> int:
        assert self.release.wait(60)
        if self.fail:
            raise OSError(28, "No space left on device")
        return 100

    def abandon(self) -> None:
        self.abandoned.set()


def held_snapshot(sb: Sandbox, rest: HeldWrite) -> Any:
    inner = sb._inner
    assert inner is not None
    inner.snapshot_begin = lambda dest, shared=None: (inner.snapshot(dest, shared), rest)  # type: ignore[method-assign]
    return sb.snapshot()


def meta(state_dir: Path, snapshot_id: str) -> dict[str, Any]:
    return dict(json.loads((state_dir / DIRECTORY / snapshot_id / "meta.json").read_text()))


def test_a_snapshot_being_written_is_listed_and_read_only_once_whole(state_dir: Path) -> None:
    with Sandbox.create() as sb:
        sb.files.write("/home/user/kept.txt", "kept")
        rest = HeldWrite()
        snap = held_snapshot(sb, rest)
        assert meta(state_dir, snap.id)["writing"] is True
        assert snap.id in [s.id for s in Sandbox.list_snapshots()]  # listed, its size an upper bound
        made: list[Sandbox] = []
        creating = threading.Thread(target=lambda: made.append(Sandbox.create(snapshot=snap.id)))
        creating.start()
        creating.join(0.3)
        assert creating.is_alive() and not made  # waits for the writer
        rest.release.set()
        creating.join(60)
        [child] = made
        with child:
            assert child.files.read("/home/user/kept.txt") == "kept"
        assert rest.abandoned.is_set()
        whole = SnapshotStore(state_dir).whole(snap.id)
        assert "writing" not in meta(state_dir, snap.id)
        assert whole.written == snap.written - rest.bytes_at_most + 100  # its real figures now
        assert Sandbox.delete_snapshot(snap.id)


def test_a_failed_background_write_removes_the_snapshot(state_dir: Path) -> None:
    with Sandbox.create() as sb:
        rest = HeldWrite(fail=True)
        snap = held_snapshot(sb, rest)
        rest.release.set()
        with pytest.raises(SnapshotNotFound):
            Sandbox.create(snapshot=snap.id)
        assert not (state_dir / DIRECTORY / snap.id).exists()
        assert not Sandbox.delete_snapshot(snap.id)


WRITER = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from corral import Sandbox
from test_snapshot_writing import HeldWrite, held_snapshot
sb = Sandbox.create()
snap = held_snapshot(sb, HeldWrite())  # never released: killed while writing
print(snap.id, flush=True)
threading.Event().wait()
"""


def test_a_writer_killed_mid_write_leaves_nothing_usable_and_gc_reaps_it(state_dir: Path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(Path(__file__).parent)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "CORRAL_STATE_DIR": str(state_dir)})
    try:
        assert writer.stdout is not None
        snapshot_id = writer.stdout.readline().strip()
        assert snapshot_id.startswith("snap-"), snapshot_id
        assert snapshot_id not in reap_leftovers(state_dir)  # its writer still works on it
        assert meta(state_dir, snapshot_id)["writing"] is True
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    with pytest.raises(SnapshotCorrupt, match="died before it was whole"):
        Sandbox.create(snapshot=snapshot_id)
    gc(state_dir)  # the writer's sandbox and its half-written snapshot
    assert not (state_dir / DIRECTORY / snapshot_id).exists()
    with pytest.raises(SnapshotNotFound):
        Sandbox.create(snapshot=snapshot_id)
