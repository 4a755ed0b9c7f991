"""Cgroup moves expedite their RCU grace period only while they run (host/grace.py), and leave
the host's switch as they found it: cleared after Corral's own moves, untouched when the
administrator set it or when Corral is told not to (``CORRAL_EXPEDITE_CGROUP_MOVES=0``).
How much it saves is a figure of ``bench/cold_trace.py --gap 0.5``, not a timed test."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from corral import Sandbox
from corral.host import grace
from corral.host.procs import process_start_time
from corral.registry import gc


@pytest.fixture
def switch() -> Path:
    path = Path(grace.SWITCH)
    try:
        grace.reap_left_open()  # one a process killed by an earlier test left open
        deadline = time.monotonic() + 3  # another process's window is short: wait it out
        while path.read_text().strip() != "0" and time.monotonic() < deadline:
            time.sleep(0.01)
        if path.read_text().strip() != "0":
            pytest.skip(f"{path} is set on this host: the administrator's, left alone")
    except OSError as exc:
        pytest.skip(f"{path} cannot be written here ({exc}): moves just wait")
    return path


@pytest.fixture
def private_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A switch and records of this test's own, for the window bookkeeping: under ``-n 2`` the
    other worker's creates open and close windows on the host's switch at any moment (a CI run
    saw this test's first move find that window open, so it joined it, and the window closed under
    it: the documented wait, not this test's subject)."""
    path = tmp_path / "rcu_expedited"
    path.write_text("0\n")
    monkeypatch.setattr(grace, "SWITCH", str(path))
    monkeypatch.setattr(grace, "RECORDS", tmp_path / "records")
    return path


def test_creates_and_commands_expedite_their_moves_and_clear_the_switch_after(switch: Path) -> None:
    before = grace._EXPEDITER.windows
    time.sleep(0.05)  # past grace.WARM: the create's first move is the first in a while
    with Sandbox.create() as sb:
        for _ in range(3):
            time.sleep(0.1)  # each command's spare is placed after a pause
            assert sb.commands.run("true").exit_code == 0
    assert grace._EXPEDITER.windows - before >= 2, "no move was expedited"
    # cleared once the last move is over (the spare placer's may still be running: bounded wait)
    deadline = time.monotonic() + 5
    while switch.read_text().strip() != "0" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert switch.read_text().strip() == "0"


def test_the_switch_is_set_while_any_move_runs_and_cleared_by_the_last(private_switch: Path) -> None:
    switch = private_switch
    expediter = grace._Expediter()
    first_in, second_done, seen = threading.Event(), threading.Event(), []

    def first() -> None:
        with expediter.around_move():
            first_in.set()
            second_done.wait(10)
            seen.append(switch.read_text().strip())  # the second left: still set for this one

    thread = threading.Thread(target=first)
    thread.start()
    assert first_in.wait(10)
    with expediter.around_move():
        seen.append(switch.read_text().strip())
    second_done.set()
    thread.join(10)
    assert seen == ["1", "1"]
    assert switch.read_text().strip() == "0" and expediter.windows == 1


def test_a_switch_already_set_or_a_process_told_not_to_is_left_alone(
        private_switch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    switch = private_switch
    expediter = grace._Expediter()
    try:
        with expediter.around_move():
            pass  # a first window, opened and closed: the switch was clear
        time.sleep(2 * grace.WARM)
        switch.write_text("1")  # then the administrator's choice (or another process's window)
        with expediter.around_move():
            pass
        assert switch.read_text().strip() == "1" and expediter.windows == 1
    finally:
        switch.write_text("0")
    monkeypatch.setenv("CORRAL_EXPEDITE_CGROUP_MOVES", "0")
    expediter = grace._Expediter()
    with expediter.around_move():
        assert switch.read_text().strip() == "0"
    assert expediter.windows == 0


def _with_private_switch(switch: Path, code: str) -> list[str]:
    """A Python command running ``code`` with this test's own switch and records."""
    return [sys.executable, "-c", "from pathlib import Path\nfrom corral.host import grace\n"
            f"grace.SWITCH = {str(switch)!r}\ngrace.RECORDS = Path({str(grace.RECORDS)!r})\n" + code]


def test_a_window_a_killed_process_left_open_is_closed_by_the_next_one_or_gc(
        private_switch: Path, state_dir: Path) -> None:
    # the host's switch is another worker's too: a CI run's child found that worker's window open,
    # so (rightly) opened none and wrote no record
    switch = private_switch
    for janitor in ("gc", "next process"):
        inside = subprocess.Popen(
            _with_private_switch(switch, "import time\n"
                                 "with grace.expedited_move():\n    print('in', flush=True)\n    time.sleep(60)\n"),
            stdout=subprocess.PIPE, text=True)
        try:
            assert inside.stdout is not None and inside.stdout.readline() == "in\n"
            record = grace.RECORDS / f"{grace.RECORD_KIND}@{inside.pid}.{process_start_time(inside.pid)}"
            assert record.read_text().strip() == "open" and switch.read_text().strip() == "1"
        finally:
            inside.kill()
            inside.wait()
        assert switch.read_text().strip() == "1"  # left set by the killed process...
        if janitor == "gc":
            gc(state_dir)
        else:
            subprocess.run(_with_private_switch(switch, "with grace.expedited_move():\n    pass\n"),
                           check=True, timeout=60)
        assert switch.read_text().strip() == "0", janitor  # ...and cleared by the janitor
        assert not record.exists()


def test_a_switch_set_with_no_window_left_open_is_the_administrators(private_switch: Path, state_dir: Path) -> None:
    switch = private_switch  # (another worker's window on the host's would clear it under the test)
    try:
        switch.write_text("1")
        gc(state_dir)
        assert not grace.reap_left_open()
        assert switch.read_text().strip() == "1"
    finally:
        switch.write_text("0")
