"""One long-lived process-tier sandbox: after every command, every process in it is in its cgroups.

Issue 11's session guarantee, written to run on either cgroup layout (this file
also runs inside a microVM guest, whose hierarchy is pure v2: see
``test_cgroup_v2_guest.py``).  One sandbox runs a seeded random mix of 30
commands -- timeouts, OOM kills, failing commands, background commands killed
while running, background commands left running, PTY commands and plain ones --
and after each (and while each background command runs) the host lists every
process in the sandbox's pid namespace and reads its ``/proc/PID/cgroup``:

- v2: the one line ``0::/<parent>/<sandbox id>/<leaf>`` -- inside the sandbox's
  group, in a leaf of it (limits and kill tree are one hierarchy);
- v1: the memory, pids and cpu lines name ``/<parent>/<sandbox id>`` (or a group
  below it), and the kill tree's line (the hybrid's ``0::`` or ``freezer``) a
  leaf below it.

The expected paths are worked out here from the sandbox id and the environment's
cgroup parent, not asked of Corral's placement code.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

from corral import Sandbox
from corral.host import cgroups

# one reading of /proc/PID/cgroup for both files: the expected paths come from the sandbox id
from .test_session_containment import misplaced, process_tier_pids

COMMANDS = 30
SEED = int(os.environ.get("CORRAL_CONTAINMENT_SEED", "11"))
MEMORY = "64M"
PIDS = 64
#: touches every page of 400 MiB at once (under TCG 1.5 s; a shell pipeline that grows a
#: buffer took 6-10 s there)
HOG = ["python3", "-c", "b = bytearray(400 << 20); print(len(b))"]
#: the whole loop, however slow the machine (a TCG guest runs it in ~20 s)
DEADLINE = 180.0


def expected_version() -> int:
    """The layout the caller says this host has (the microVM guest job sets it), else the one
    coreutils' statfs reports for /sys/fs/cgroup (not Corral's own detection)."""
    value = os.environ.get("CORRAL_EXPECT_CGROUP_VERSION")
    if value:
        return int(value)
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(cgroups.CGROUP_ROOT)], capture_output=True, text=True)
    kinds = {"cgroup2fs": 2, "tmpfs": 1}
    assert fs.stdout.strip() in kinds, fs
    return kinds[fs.stdout.strip()]


def test_the_cgroup_layout_is_the_one_expected() -> None:
    """Corral detects the layout the host has: otherwise the v2 guest job could silently
    run the v1 path."""
    wanted = expected_version()
    layout = cgroups.detect()
    assert layout.version == wanted, layout.describe()
    if wanted == 2:
        assert layout.kill_root == cgroups.CGROUP_ROOT and layout.kill_mode == "cgroup.kill", layout.describe()
        assert set(layout.controllers.values()) == {cgroups.CGROUP_ROOT}, layout.describe()


def check_contained(sb: Sandbox, after: str) -> int:
    listed = process_tier_pids(sb)
    problems = [p for p in (misplaced(pid, sb.id) for pid in listed) if p]
    assert not problems, f"after {after}: {problems}"
    return len(listed)


def wait_for_process(sb: Sandbox, cmdline: bytes, deadline: float = 30.0) -> int:
    """Host pid of the sandbox's process whose command line is ``cmdline`` (NUL-separated)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        for pid in process_tier_pids(sb):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0") == cmdline:
                    return pid
            except OSError:
                continue
        time.sleep(0.01)
    raise AssertionError(f"{cmdline!r} never appeared in the sandbox")


# -- the command kinds ------------------------------------------------------------------

def plain(sb: Sandbox, i: int) -> None:
    assert sb.commands.run(f"echo ok{i}").stdout == f"ok{i}\n"


def failing(sb: Sandbox, i: int) -> None:
    r = sb.commands.run("echo no >&2; exit 3")
    assert r.exit_code == 3 and r.stderr == "no\n", r


def timeout(sb: Sandbox, i: int) -> None:
    r = sb.commands.run("sleep 30 & setsid sleep 31 & sleep 32", timeout=0.5)
    assert r.timed_out and r.exit_code == 124, r


def oom(sb: Sandbox, i: int) -> None:
    r = sb.commands.run(HOG, timeout=60)
    assert r.oom_killed and r.exit_code == 137 and r.stdout == "", r


def background_killed(sb: Sandbox, i: int) -> None:
    secs = f"7.{i:02d}"
    handle = sb.commands.start(f"exec sleep {secs}", timeout=60)
    try:
        wait_for_process(sb, b"sleep\0" + secs.encode())
        check_contained(sb, f"command {i} (background, running)")
    finally:
        handle.kill()
    assert handle.wait().exit_code != 0


def background_left(sb: Sandbox, i: int) -> None:
    # a daemon that outlives its command: it must stay in the sandbox's groups
    assert sb.commands.run(f"nohup sleep 300.{i:02d} >/dev/null 2>&1 &").exit_code == 0


def pty(sb: Sandbox, i: int) -> None:
    r = sb.commands.start("tty >/dev/null && echo on-a-tty", pty=(24, 80), timeout=30).wait()
    assert "on-a-tty" in r.stdout, r


KINDS = [plain, failing, timeout, oom, background_killed, background_left, pty]


def test_every_process_stays_in_the_sandbox_cgroups_across_a_session() -> None:
    rng = random.Random(SEED)
    # every kind at least once, then a seeded random mix
    order = [*KINDS, *(rng.choice(KINDS) for _ in range(COMMANDS - len(KINDS)))]
    rng.shuffle(order)
    start = time.monotonic()
    done: list[str] = []
    with Sandbox.create(memory=MEMORY, pids=PIDS) as sb:
        check_contained(sb, "create")
        for i, kind in enumerate(order):
            assert time.monotonic() - start < DEADLINE, f"too slow: {len(done)} commands in {DEADLINE} s"
            kind(sb, i)
            done.append(kind.__name__)
            check_contained(sb, f"command {i} ({kind.__name__}; before it: {done[-6:-1]})")
        # the daemons left behind are still there, and still inside
        left = sb.commands.run("ps -eo args | grep -c '^sleep 300' || true").stdout.strip()
        assert left == str(done.count("background_left")), left
        # after all of it, the limits still hold: a typed OOM
        oom(sb, COMMANDS)
        assert check_contained(sb, "the last OOM") >= 1
