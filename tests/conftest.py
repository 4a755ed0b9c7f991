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

from .memory_groups import owner_group  # noqa: F401 - the fixture of the tests that read an owner's memory

_RUN_TAG = f"corral-test-{os.getpid()}"


def _reap_dead_runs() -> None:
    """Test runs that were killed (timeout, kill -9) never reach pytest_sessionfinish:
    reap their sandboxes, mounts, state dirs and cgroup parents on the next run."""
    import re

    from corral.host import cgroup_tree, cgroups, mounts
    from corral.registry import gc

    def dead(pid: int) -> bool:
        return not Path(f"/proc/{pid}").exists()

    for path in Path(tempfile.gettempdir()).glob("corral-test-*-state-*"):
        match = re.match(r"corral-test-(\d+)-state-", path.name)
        if match and dead(int(match.group(1))):
            try:
                gc(path)
            except Exception:
                pass
            mounts.unmount_all(path)
            shutil.rmtree(path, ignore_errors=True)
    from .egress_net import reap_dead_target_nets

    reap_dead_target_nets()
    try:
        layout = cgroups.detect()
    except Exception:
        return
    for root in {*layout.controllers.values(), layout.kill_root}:
        for parent in root.glob("corral-test-*"):
            match = re.match(r"corral-test-(\d+)$", parent.name)
            if match and dead(int(match.group(1))):
                for group in [p for p in parent.iterdir() if p.is_dir()]:
                    if root == layout.kill_root:
                        cgroup_tree.kill_group(group, layout.kill_mode)
                    for pid in cgroup_tree.read_pids(group):
                        try:
                            os.kill(pid, 9)
                        except ProcessLookupError:
                            pass
                cgroup_tree.remove_tree(parent)

if "PYTEST_XDIST_WORKER" in os.environ:  # a worker of `pytest -n`: not its controller's (inherited) ones
    os.environ["CORRAL_CGROUP_PARENT"] = _RUN_TAG
    os.environ.pop("CORRAL_STATE_DIR", None)
os.environ.setdefault("CORRAL_CGROUP_PARENT", _RUN_TAG)
_STATE = Path(tempfile.mkdtemp(prefix=f"{_RUN_TAG}-state-"))
os.environ.setdefault("CORRAL_STATE_DIR", str(_STATE))
# after the environment is set: importing corral reads CORRAL_CGROUP_PARENT
_reap_dead_runs()


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
    from corral.host import cgroup_tree, cgroups, mounts
    from corral.registry import gc

    try:  # sandboxes of owners the tests killed: their host-wide uid claims go with them
        gc(_STATE)
    except Exception:
        pass
    mounts.unmount_all(_STATE)
    shutil.rmtree(_STATE, ignore_errors=True)
    layout = cgroups.detect()
    for root in {*layout.controllers.values(), layout.kill_root}:
        parent = root / cgroups.PARENT
        if parent.is_dir():
            cgroup_tree.remove_tree(parent)


@pytest.fixture
def forwarding_on() -> Iterator[None]:
    """IPv4 forwarding on while the test runs (network="open" refuses to start without it), as it was after."""
    from .egress_net import ip_forwarding

    with ip_forwarding() as sysctl:
        sysctl.write_text("1")
        yield
