"""Pausing and resuming a live sandbox (issue 18, its first part).

A paused sandbox's processes are frozen in its cgroup: a counter loop inside
does not advance, a running command's timeout does not fire, memory stays
held; after ``resume()`` everything continues from where it stopped.  Calls
that need the frozen agent are refused with a typed error instead of hanging,
and bad state transitions are typed errors (409 over REST).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral import InvalidState, Sandbox, SandboxPaused
from corral.host import cgroups

from .leaks import assert_gone_soon, kill_9, run_gc, start_owner
from .server_fixtures import KEYS, ServerProcess
from .tier_probe import skip_unless_tier

#: appends a line per 20 ms tick to /tmp/ticks, forever
COUNTER = "while :; do echo x >> /tmp/ticks; sleep 0.02; done"


def ticks(sb: Sandbox) -> int:
    if not sb.files.exists("/tmp/ticks"):
        return 0
    return len(sb.files.read("/tmp/ticks").splitlines())


def wait_for_ticks(sb: Sandbox, at_least: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while ticks(sb) < at_least:
        assert time.monotonic() < deadline, "the counter never ticked"
        time.sleep(0.02)


def pause_and_check_frozen(sb: Sandbox, frozen_for: float) -> None:
    sb.pause()
    assert sb.paused
    with pytest.raises(SandboxPaused):
        sb.files.read("/tmp/ticks")
    # frozen: every process of the sandbox is stopped, as the kernel reports it
    cgroup = sb._tier_sandbox().cgroup  # type: ignore[attr-defined]
    if cgroup.layout.kill_mode == "freezer":
        assert (cgroup.kill_group / "freezer.state").read_text().strip() == "FROZEN"
    else:
        assert "frozen 1" in (cgroup.kill_group / "cgroup.events").read_text().splitlines()
    time.sleep(frozen_for)
    sb.resume()
    assert not sb.paused


@pytest.mark.parametrize("tier", ["process", "gvisor", "microvm"])
def test_a_paused_sandbox_does_not_advance_and_its_timeouts_wait(tier: str, state_dir: Path) -> None:
    if tier != "process":
        skip_unless_tier(tier, state_dir)
    with Sandbox.create(tier=tier, memory="256M") as sb:
        counter = sb.commands.start(COUNTER, timeout=600)
        wait_for_ticks(sb, 3)
        # a command with 2 s left when the sandbox is paused for 2.5 s still finishes
        slow = sb.commands.start("sleep 0.8; echo finished", timeout=2)
        before_pause = ticks(sb)
        read_at = time.monotonic()
        sb.pause()
        frozen_within = time.monotonic() - read_at
        time.sleep(2.5)
        resumed_at = time.monotonic()
        sb.resume()
        after_resume = ticks(sb)
        # at most the ticks of the moments it was not frozen: from the read to the freeze (~0 to
        # 50 ms under load), from the resume to the read after it, plus two: the one whose write
        # lands between the agent's read of the file and the read's answer here (not timed), and
        # the one at the thaw (the loop's `sleep 0.02` ran out while frozen, so it ticks at once);
        # not frozen, the 2.5 s would add ~125
        running = frozen_within + (time.monotonic() - resumed_at)
        assert after_resume - before_pause <= 2 + running / 0.02, (before_pause, after_resume, running)
        result = slow.wait()
        assert result.exit_code == 0 and not result.timed_out and result.stdout == "finished\n", result
        wait_for_ticks(sb, after_resume + 3)  # and it runs on
        counter.kill()
        counter.wait()


@pytest.mark.parametrize("tier", ["process", "gvisor", "microvm"])
def test_a_command_killed_while_paused_ends_alone_at_the_resume(tier: str, state_dir: Path) -> None:
    """Killing one command of a paused sandbox returns at once and, once resumed, that command
    ends with SIGKILL and nothing else does. Before: on gVisor the kill returned after 2 s and
    its backstop ended the whole sandbox (the frozen agent could not obey); on the microVM it
    raised SandboxPaused although the kill was done at the resume."""
    if tier != "process":
        skip_unless_tier(tier, state_dir)
    with Sandbox.create(tier=tier, memory="256M") as sb:
        other = sb.commands.run("sleep 300", background=True, timeout=600)
        doomed = sb.commands.run("sleep 300", background=True, timeout=600)
        sb.commands.run("true")
        sb.pause()
        asked = time.monotonic()
        doomed.kill()
        assert time.monotonic() - asked < 1.0
        time.sleep(2.5)  # past the gVisor backstop's grace, had it counted frozen time
        sb.resume()
        result = doomed.wait()
        assert result.signal == signal.SIGKILL or result.exit_code == 137, result
        assert not other.done and sb.is_running()
        assert sb.commands.run("echo alive").stdout == "alive\n"
        other.kill()


def sandbox_groups(sandbox_id: str) -> list[Path]:
    """Every cgroup of the sandbox ``sandbox_id`` (kill tree, limit groups) and every group below them."""
    from corral.host.cgroup_tree import all_groups

    layout = cgroups.detect()
    return [group for root in {*layout.controllers.values(), layout.kill_root}
            for group in all_groups(root / cgroups.PARENT / sandbox_id)]


def processes_in(groups: list[Path]) -> set[int]:
    from corral.host.cgroup_tree import read_pids

    return {pid for group in groups for pid in read_pids(group)}


def memory_charged(sandbox_id: str) -> int:
    layout = cgroups.detect()
    group = layout.controllers["memory"] / cgroups.PARENT / sandbox_id
    try:
        return int((group / ("memory.current" if layout.version == 2 else "memory.usage_in_bytes")).read_text())
    except FileNotFoundError:
        return 0


#: what the owner runs to freeze its sandbox: a pause, or a snapshot held at its copy (the sandbox
#: stays frozen until the copy is done: here never)
FREEZES = {
    "pause": "sb.pause()\n",
    "snapshot": ("import threading, corral.tiers.linux.fs_snapshot as copier\n"
                 "copier.capture = lambda *args, **kwargs: time.sleep(300)\n"
                 "threading.Thread(target=sb.snapshot, daemon=True).start()\n"
                 "while not sb._tier_sandbox().paused: time.sleep(0.01)\n"),
}


@pytest.mark.parametrize("tier", ["process", "gvisor"])
@pytest.mark.parametrize("freeze", ["pause", "snapshot"])
def test_a_frozen_sandbox_dies_with_its_owner_without_gc(tier: str, freeze: str, state_dir: Path) -> None:
    """An owner killed -9 while its sandbox is frozen (paused, or mid-snapshot): within 5 s no process
    is left in the sandbox's cgroups and (process tier) its memory is released, with no gc run.
    Before: they stayed frozen until the next gc (process tier: 3 processes, 210 MB; gVisor: 13
    processes) -- a running sandbox's agent reads its owner's end, a frozen one's cannot."""
    if tier != "process":
        skip_unless_tier(tier, state_dir)
    owner, ids = start_owner(
        f"sb = Sandbox.create(tier={tier!r}, memory='256M')\n"
        "sb.commands.run('head -c 64M /dev/urandom > /tmp/big; (sleep 100000 &)', timeout=120)\n"
        f"{FREEZES[freeze]}print(sb.id, flush=True)")
    try:
        assert len(ids) == 1, ids
        (sandbox_id,) = ids
        groups = sandbox_groups(sandbox_id)
        assert processes_in(groups) and memory_charged(sandbox_id) > 64 << 20
    finally:
        kill_9(owner)
    try:
        deadline = time.monotonic() + 5
        while processes_in(groups) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_in(groups) == set(), "a frozen sandbox outlived its owner"
        if tier == "process":
            # its disk's tmpfs lived in its own mount namespace: gone with its last process.  (gVisor's
            # is mounted in the host's, as when its owner dies while it runs: released by gc)
            while memory_charged(sandbox_id) > 16 << 20 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert memory_charged(sandbox_id) <= 16 << 20
    finally:
        run_gc(sandbox_id)
        assert_gone_soon(sandbox_id, state_dir)


@pytest.mark.parametrize("tier", ["process", "gvisor"])
def test_the_owners_watch_over_a_paused_sandbox_lets_it_resume_and_ends_with_it(tier: str, state_dir: Path) -> None:
    """The other direction: with its owner alive, a paused sandbox resumes and runs as before, again
    and again (one watch process for them all, started at the first pause), and its watch ends
    when the sandbox is closed."""
    if tier != "process":
        skip_unless_tier(tier, state_dir)
    with Sandbox.create(tier=tier, memory="256M") as sb:
        counter = sb.commands.start(COUNTER, timeout=600)
        wait_for_ticks(sb, 3)
        watches = set()
        for _ in range(3):
            sb.pause()
            watch = sb._tier_sandbox()._owner_watch  # type: ignore[attr-defined]
            assert watch is not None and Path(f"/proc/{watch._pid}").exists()
            watches.add(watch._pid)
            sb.resume()
            wait_for_ticks(sb, ticks(sb) + 2)
        assert len(watches) == 1
        assert sb.commands.run("echo alive").stdout == "alive\n"
        counter.kill()
        counter.wait()
    (pid,) = watches
    assert not Path(f"/proc/{pid}").exists(), "the watch outlived its sandbox"


def test_a_paused_sandbox_does_not_time_out_a_code_cell() -> None:
    # run_code's timeout counts only time the sandbox could run, as a command's does
    with Sandbox.create() as sb:
        sb.run_code("import time")
        started = threading.Event()
        outcome: list[Any] = []

        def cell() -> None:
            outcome.append(sb.run_code("print('begun', flush=True)\ntime.sleep(1.0)\nprint('woke')", timeout=2,
                                       on_stdout=lambda text: started.set()))

        runner = threading.Thread(target=cell)
        runner.start()
        assert started.wait(30), "the cell never began"
        sb.pause()
        time.sleep(2.5)  # longer than the cell's whole timeout
        sb.resume()
        runner.join(30)
        execution = outcome[0]
        assert not execution.timed_out and execution.error is None, execution
        assert "".join(execution.logs.stdout) == "begun\nwoke\n"


def test_pause_states_are_typed_errors_and_a_paused_sandbox_is_destroyed_whole() -> None:
    sb = Sandbox.create()
    try:
        with pytest.raises(InvalidState):
            sb.resume()  # not paused
        sb.commands.start(COUNTER, timeout=600)
        wait_for_ticks(sb, 2)
        pause_and_check_frozen(sb, 0.2)
        sb.pause()
        with pytest.raises(SandboxPaused):
            sb.pause()
        with pytest.raises(SandboxPaused):
            sb.commands.run("true")
        assert "paused" in repr(sb)
        group = sb.id
    finally:
        sb.kill()  # while paused: nothing of it may survive
    assert group not in cgroups.list_sandbox_groups()
    with pytest.raises(Exception) as closed:
        sb.resume()
    assert not isinstance(closed.value, InvalidState)


def test_a_tier_that_cannot_pause_says_so(state_dir: Path) -> None:
    skip_unless_tier("wasm", state_dir)
    with Sandbox.create(tier="wasm") as sb:
        with pytest.raises(InvalidState, match="cannot pause"):
            sb.pause()
        assert sb.commands.run(["python", "-c", "print(1)"]).stdout == "1\n"


@pytest.mark.parametrize("tier", ["process", "microvm"])
def test_many_pause_resume_cycles_lose_no_output(tier: str, state_dir: Path) -> None:
    # the 300th command after pauses behaves as the first: output complete, exit codes right;
    # each pause lands as its command starts
    if tier != "process":
        skip_unless_tier(tier, state_dir)
    with Sandbox.create(tier=tier) as sb:
        for round_ in range(30 if tier == "process" else 12):
            handle = sb.commands.start(f"for i in 1 2 3; do echo {round_}-$i; sleep 0.01; done; exit {round_ % 5}",
                                       timeout=30)
            sb.pause()
            sb.resume()
            result = handle.wait()
            assert result.exit_code == round_ % 5, result
            assert result.stdout.split() == [f"{round_}-{i}" for i in (1, 2, 3)], result


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-pause", keys=KEYS, config={"idle_timeout": 2}) as srv:
        yield srv


def test_pause_and_resume_over_rest_for_the_owner_only(server: ServerProcess) -> None:
    with server.client("alice") as alice, server.client("bob") as bob:
        response = alice.post("/v1/sandboxes", json={"limits": {"memory": "128M"}, "idle_timeout": 2})
        assert response.status_code == 201, response.text
        sid = response.json()["id"]
        try:
            assert alice.post(f"/v1/sandboxes/{sid}/resume").status_code == 409
            assert bob.post(f"/v1/sandboxes/{sid}/pause").status_code == 404
            paused = alice.post(f"/v1/sandboxes/{sid}/pause")
            assert paused.status_code == 200 and paused.json()["state"] == "paused", paused.text
            refused = alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
            assert refused.status_code == 409 and refused.json()["error"] == "sandbox_paused", refused.text
            # paused past its idle timeout: a paused sandbox waits for resume, only its lifetime ends it
            time.sleep(3.5)
            resumed = alice.post(f"/v1/sandboxes/{sid}/resume")
            assert resumed.status_code == 200 and resumed.json()["state"] == "running", resumed.text
            ran = alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo ok"})
            assert ran.status_code == 200 and ran.json()["stdout"] == "ok\n", ran.text
        finally:
            alice.delete(f"/v1/sandboxes/{sid}")


def test_the_remote_sdk_pauses_and_resumes(server: ServerProcess) -> None:
    from corral.client import RemoteSandbox

    with RemoteSandbox.create(url=server.url, api_key=KEYS["alice"], memory="128M") as sb:
        sb.pause()
        assert sb.paused and sb.is_running()
        with pytest.raises(SandboxPaused):
            sb.commands.run("true")
        with pytest.raises(InvalidState):
            sb.pause()
        sb.resume()
        assert sb.commands.run("echo back").stdout == "back\n"
        with httpx.Client(base_url=server.url) as anonymous:
            assert anonymous.post(f"/v1/sandboxes/{sb.id}/pause").status_code == 401


@pytest.mark.parametrize("tier", ["process", "microvm"])
def test_a_pause_landing_as_a_command_starts_does_not_refuse_it(tier: str, state_dir: Path) -> None:
    """pause() starts its clock, then freezes: a command whose "started" arrives in between is
    placed and runs.  The microVM placed it through a call that refused a paused sandbox, and
    killed it as not contained (seen once in bench/snapshot.py at load 9.5).  The window is
    held open here by taking pause()'s first step alone."""
    if tier != "process":
        skip_unless_tier(tier, state_dir)
    with Sandbox.create(tier=tier) as sb:
        channel = sb._tier_sandbox()._channel  # type: ignore[attr-defined]
        handle = sb.commands.start("echo placed", timeout=30)
        channel.pause_clock.pause()
        try:
            deadline = time.monotonic() + 20
            while handle.pid is None and time.monotonic() < deadline:
                time.sleep(0.005)
        finally:
            channel.pause_clock.resume()
        result = handle.wait()
        assert result.exit_code == 0 and result.stdout == "placed\n", result
