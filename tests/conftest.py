"""Test setup: every test run gets its own state directory and cgroup parent,
so parallel runs (and helpers' runs) never collide, and leak checks can look
at everything under them."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_RUN_TAG = f"corral-test-{os.getpid()}"
os.environ.setdefault("CORRAL_CGROUP_PARENT", _RUN_TAG)
_STATE = Path(tempfile.mkdtemp(prefix=f"{_RUN_TAG}-state-"))
os.environ.setdefault("CORRAL_STATE_DIR", str(_STATE))


@pytest.fixture(scope="session")
def state_dir() -> Path:
    return Path(os.environ["CORRAL_STATE_DIR"])


@pytest.fixture
def sandbox() -> Iterator[object]:
    from corral import Sandbox

    sb = Sandbox.create()
    try:
        yield sb
    finally:
        sb.kill()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from corral.host import cgroups, mounts

    mounts.unmount_all(_STATE)
    shutil.rmtree(_STATE, ignore_errors=True)
    layout = cgroups.detect()
    for root in {*layout.controllers.values(), layout.kill_root}:
        parent = root / cgroups.PARENT
        if parent.is_dir():
            cgroups.remove_tree(parent)
