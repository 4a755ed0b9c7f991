"""First-use work is announced, and `corral prepare` does it ahead of time (issue 16, target 7)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral import progress

CORRAL = str(Path(sys.executable).with_name("corral"))


def test_a_step_over_a_second_says_what_and_why_and_a_quick_one_says_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORRAL_QUIET", raising=False)
    lines: list[str] = []
    progress.set_reporter(lines.append)
    try:
        with progress.step("building the quick thing", "first use"):
            time.sleep(0.05)
        assert lines == []
        with progress.step("building the slow thing", "first use"):
            time.sleep(progress.REPORT_AFTER + 0.3)
        assert lines[0] == "corral: building the slow thing (first use) ..."
        assert lines[1].startswith("corral: building the slow thing: done in 1.")
        lines.clear()
        monkeypatch.setenv("CORRAL_QUIET", "1")
        with progress.step("building quietly"):
            time.sleep(progress.REPORT_AFTER + 0.2)
        assert lines == []
    finally:
        progress.set_reporter(None)


def test_a_failing_step_still_says_how_long_it_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORRAL_QUIET", raising=False)
    lines: list[str] = []
    progress.set_reporter(lines.append)
    try:
        with pytest.raises(RuntimeError), progress.step("a build that fails"):
            time.sleep(progress.REPORT_AFTER + 0.2)
            raise RuntimeError("boom")
        assert [line.split(":")[1].strip() for line in lines] == ["a build that fails ...", "a build that fails"]
    finally:
        progress.set_reporter(None)


def test_prepare_readies_the_tiers_it_is_asked_for() -> None:
    out = subprocess.run([CORRAL, "prepare", "--tier", "process", "--tier", "wasm"], capture_output=True,
                         text=True, env=os.environ.copy(), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [line.split(":")[0] for line in out.stdout.splitlines()] == ["process", "wasm"]
    assert all(": ready in " in line for line in out.stdout.splitlines()), out.stdout


def test_prepare_fails_for_a_tier_named_that_cannot_run(tmp_path: Path) -> None:
    out = subprocess.run([CORRAL, "prepare", "--tier", "no-such-tier"], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=60)
    assert out.returncode == 1 and "no-such-tier" in out.stdout, out.stdout + out.stderr
