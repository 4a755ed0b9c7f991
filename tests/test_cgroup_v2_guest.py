"""The process tier on a pure cgroup v2 host: inside a microVM guest.

This machine is cgroup v1 hybrid, so the rest of the suite only ever runs the
process tier's v1 path.  A microVM guest has a pure v2 hierarchy with every
controller, bubblewrap and python3, and commands run there as root (``user="root"``): enough to
run Corral's process tier.  One VM gets (as one tarball through its workspace,
unpacked in the guest) Corral's ``src/corral`` with the static agent, pyseccomp,
pytest with its pure-Python dependencies, and ``tests/``; pytest then runs in
the guest, as root, a subset of the process tier's limit, isolation and
teardown tests (:data:`GUEST_TESTS`), chosen for coverage per second of TCG
time, and ``test_session_containment_v2.py``.  The host reads back the guest's
junit XML: every selected test must have run and passed (a test skipped in the
guest fails here), and one of them checks that Corral detected cgroup v2 there.

Skipped, with the tier's reason, only where the microVM tier cannot run.
"""

from __future__ import annotations

import importlib
import io
import shlex
import tarfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox

from .tier_probe import skip_unless_tier

REPO = Path(__file__).resolve().parent.parent
#: where the payload is unpacked in the guest (on the guest's overlay upper, in guest RAM)
GUEST_DIR = "/opt/corral-v2"
GUEST_STATE = "/tmp/corral-v2-state"
GUEST_PARENT = "corral-v2-guest"
GUEST_JUNIT = "/tmp/corral-v2-junit.xml"
#: The VM's memory: the default (a 640 MiB guest), whose template the conformance suite's
#: microVM tests build anyway (a new size costs a template boot, 15-40 s, on a fresh
#: machine).  The guest's tests make their sandboxes in cgroups beside the guest's
#: "sandbox" group, so this limit bounds pytest itself; the guest's RAM bounds the rest
#: (their largest sandbox: 64 MiB).
VM_MEMORY = "512M"
#: the guest's pytest as a whole (~60-110 s: a Python start costs ~0.5-1 s under TCG)
GUEST_TIMEOUT = 420.0
#: each test in the guest
GUEST_TEST_TIMEOUT = 120

#: pure-Python packages pytest needs in the guest's /usr/bin/python3 (Debian's 3.11),
#: copied from this interpreter's environment; Corral itself needs only pyseccomp
SITE_MODULES = ["pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "pytest_timeout",
                "pyseccomp", "py",
                # tests/test_session_containment.py imports server_fixtures, which imports httpx
                "httpx", "click", "rich", "idna", "certifi", "markdown_it", "mdurl"]

#: the process tier's limit, isolation and teardown tests the guest runs
GUEST_TESTS = [
    # limits (the conformance suite's OOM and timeout tests add nothing to these but ~10 s)
    "tests/test_isolation.py::test_memory_bomb_is_a_typed_oom",
    "tests/test_isolation.py::test_fork_bomb_is_held_while_the_host_keeps_spawning",
    "tests/test_isolation.py::test_cpu_quota_limits_cpu_time",
    "tests/test_isolation.py::test_disk_limit_bounds_tmp_and_workspace",
    "tests/test_isolation.py::test_timeout_kills_daemonized_children_too",
    # isolation
    "tests/test_isolation.py::test_runs_as_unprivileged_user_with_no_capabilities",
    "tests/test_isolation.py::test_host_processes_are_invisible_and_unkillable",
    "tests/test_isolation.py::test_host_secrets_are_not_visible",
    "tests/conformance/test_conformance.py::test_no_host_files_visible[process-embedded]",
    # teardown
    "tests/test_lifecycle.py::test_closed_sandbox_refuses_work",
    "tests/conformance/test_conformance.py::test_teardown_leaves_nothing[process-embedded]",
    # (a janitor in another cgroup parent than the owner's: the [same] case's path and more)
    "tests/test_lifecycle.py::test_kill_9_of_the_owner_then_gc_leaves_nothing[other]",
    # placement on v2: failing closed, repairing a spare moved out, the spare's fresh leaf
    "tests/test_session_containment.py::test_a_process_that_cannot_be_contained_raises_a_typed_error",
    "tests/test_session_containment.py::test_a_command_whose_leaf_cannot_be_made_is_not_run",
    "tests/test_session_containment.py::test_a_spare_moved_out_of_the_limits_is_put_back_before_it_runs",
    "tests/test_spares.py::test_a_command_after_a_pause_runs_in_the_spare_in_a_fresh_leaf",
    "tests/test_spares.py::test_a_spare_command_that_times_out_loses_its_whole_tree",
    # the session guarantee of issue 11, and that the guest really ran the v2 path
    "tests/test_session_containment_v2.py::test_the_cgroup_layout_is_the_one_expected",
    "tests/test_session_containment_v2.py::test_every_process_stays_in_the_sandbox_cgroups_across_a_session",
]

PYTEST_INI = f"""\
[pytest]
addopts = -ra
timeout = {GUEST_TEST_TIMEOUT}
"""


@pytest.fixture(scope="module", autouse=True)
def _microvm_available(state_dir: Path) -> None:
    skip_unless_tier("microvm", state_dir)


def _module_path(name: str) -> Path:
    """The file (a module) or directory (a package) ``name`` is imported from here."""
    module = importlib.import_module(name)
    file = Path(module.__file__ or "")
    return file.parent if file.name == "__init__.py" else file


def _add(tar: tarfile.TarFile, path: Path, arcname: str) -> None:
    # byte code included: the guest's 3.11.2 shares this 3.11's magic number, so it skips
    # compiling (seconds under TCG); a .pyc for another interpreter is just ignored
    tar.add(path, arcname)


def build_payload(dest: Path) -> Path:
    """One tarball of everything the guest needs; written once, unpacked by tar in the guest."""
    agent = REPO / "src/corral/agent/corral-agent"
    assert agent.is_file(), f"{agent} is not built: run `make install`"
    payload = dest / "payload.tar"
    with tarfile.open(payload, "w") as tar:
        _add(tar, REPO / "src/corral", "src/corral")
        for name in SITE_MODULES:
            path = _module_path(name)
            _add(tar, path, f"site/{path.name}")
        _add(tar, REPO / "tests", "tests")
        data = PYTEST_INI.encode()
        info = tarfile.TarInfo("pytest.ini")
        info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
        tar.addfile(info, io.BytesIO(data))
    return payload


def guest_command() -> str:
    env = {
        "PYTHONPATH": f"{GUEST_DIR}/src:{GUEST_DIR}/site",
        "CORRAL_STATE_DIR": GUEST_STATE,
        "CORRAL_CGROUP_PARENT": GUEST_PARENT,
        "CORRAL_EXPECT_CGROUP_VERSION": "2",
    }
    pytest_argv = [
        "python3", "-m", "pytest", "-p", "no:cacheprovider", "-p", "pytest_timeout", "-q", "--color=no", "--durations=8",
        f"--junitxml={GUEST_JUNIT}", *GUEST_TESTS,
    ]
    return " && ".join([
        f"mkdir -p {GUEST_DIR}",
        f"tar -xf /workspace/payload.tar -C {GUEST_DIR}",
        f"mkdir -p {GUEST_STATE}",
        f"cd {GUEST_DIR}",
        "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(pytest_argv),
    ])


def outcomes(junit_xml: str) -> dict[str, str]:
    """node id -> passed / failed / error / skipped, from pytest's junit XML."""
    found: dict[str, str] = {}
    for case in ET.fromstring(junit_xml).iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        node = f"{module}.py::{case.get('name')}"
        kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
        found[node] = kinds.pop() if kinds else "passed"
    return found


def leftovers_command() -> str:
    """Prints whatever the guest's test run left behind: its cgroup parent, mounts under its
    state dir, run dirs, reserved uids, processes of a process-tier sandbox."""
    return "; ".join([
        f"test ! -e /sys/fs/cgroup/{GUEST_PARENT} || echo cgroup parent left: $(ls /sys/fs/cgroup/{GUEST_PARENT})",
        f"grep -F {GUEST_STATE} /proc/self/mountinfo",
        f"ls -A {GUEST_STATE}/sandboxes {GUEST_STATE}/uids 2>/dev/null | grep -v -e '^$' -e ':$'",
        # by name: the guest's own agent is a corral-agent too; an inner one would hold its cgroup
        "pgrep -a -x 'bwrap|corral-spare'",
        "true",
    ])


@pytest.fixture(scope="module")
def guest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    workspace = tmp_path_factory.mktemp("v2-guest")
    build_payload(workspace)
    sandbox = Sandbox.create(tier="microvm", memory=VM_MEMORY, workspace=f"{workspace}:ro", user="root")
    try:
        yield sandbox
    finally:
        sandbox.kill()


@pytest.mark.timeout(GUEST_TIMEOUT + 120)
def test_process_tier_limit_isolation_and_teardown_tests_pass_on_cgroup_v2(guest: Sandbox) -> None:
    layout = guest.commands.run("stat -f -c %T /sys/fs/cgroup; cat /sys/fs/cgroup/cgroup.controllers")
    assert layout.stdout.split()[:1] == ["cgroup2fs"], layout
    assert {"memory", "pids", "cpu"} <= set(layout.stdout.split()[1:]), layout

    start = time.monotonic()
    run = guest.commands.run(guest_command(), timeout=GUEST_TIMEOUT)
    took = time.monotonic() - start
    report = f"guest pytest ({took:.0f} s, exit {run.exit_code}):\n{run.stdout[-12000:]}\n{run.stderr[-4000:]}"
    print(report)  # shown with -rP: the guest's durations
    assert not run.timed_out, report
    assert guest.files.exists(GUEST_JUNIT), report
    results = outcomes(guest.files.read(GUEST_JUNIT))
    expected = {node: "passed" for node in GUEST_TESTS}
    assert results == expected, report
    assert run.exit_code == 0, report
    left = guest.commands.run(leftovers_command())
    assert left.stdout == "" and left.exit_code == 0, left
