"""The process tier's spare: a child the agent forks ahead of time, placed in the
next command's cgroup while the sandbox is idle (src/corral/tiers/process/spares.py).

A command run in a spare must keep every promise a freshly forked one does:
its own kill tree, its own stdin's end of file, a fresh environment.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from corral import Sandbox
from corral.tiers.process import ProcessSandbox


def placed(sandbox: Sandbox) -> None:
    """Wait (bounded) until the placer has moved the agent's spare into a fresh leaf."""
    inner = sandbox._inner
    assert isinstance(inner, ProcessSandbox)
    assert inner.spare_placed.wait(10.0), "the spare was not placed within 10 s"


def own_cgroup(sandbox: Sandbox) -> str:
    lines = sandbox.commands.run("cat /proc/self/cgroup").stdout.splitlines()
    return next(line for line in lines if line.startswith("0::"))


def test_a_command_after_a_pause_runs_in_the_spare_in_a_fresh_leaf(sandbox: Sandbox) -> None:
    placed(sandbox)
    first = sandbox.commands.run("echo $$; ps -eo pid=,comm=").stdout.split()
    # the spare was forked right after the agent said ready: pid 2 of the sandbox; taking it
    # forked the next one (a later pid), as the command ran
    assert first[0] == "2"
    spares = [int(pid) for pid, comm in zip(first[1::2], first[2::2], strict=True) if comm == "corral-spare"]
    assert all(pid > 2 for pid in spares)
    placed(sandbox)
    second = own_cgroup(sandbox)
    placed(sandbox)
    third = own_cgroup(sandbox)
    assert second != third and second.rsplit("/", 1)[1].startswith("e")


def test_a_spare_command_that_times_out_loses_its_whole_tree(sandbox: Sandbox) -> None:
    placed(sandbox)
    result = sandbox.commands.run("sleep 300 & sleep 301 & wait", timeout=0.5)
    assert result.timed_out and result.exit_code == 124
    left = sandbox.commands.run("ps -eo args=").stdout
    assert "sleep 30" not in left


def test_the_spare_holds_no_other_commands_stdin(sandbox: Sandbox) -> None:
    # a spare forked while `cat` runs must not keep cat's stdin open
    placed(sandbox)
    cat = sandbox.commands.start("cat", timeout=10)  # takes the spare
    sandbox.commands.run("true")  # its end forks the next spare, with cat still running
    placed(sandbox)
    cat.send_stdin("through\n")
    cat.close_stdin()
    result = cat.wait()
    assert result.exit_code == 0 and result.stdout == "through\n"


def test_a_killed_spare_is_replaced_and_commands_still_run(sandbox: Sandbox) -> None:
    placed(sandbox)
    # the spare runs as the sandbox user too: sandboxed code can kill it
    sandbox.commands.run("pkill -KILL -x corral-spare; true")
    placed(sandbox)
    assert sandbox.commands.run("pkill -KILL -x corral-spare; echo killed").stdout == "killed\n"
    placed(sandbox)  # the host placed a spare that may be dead by now: the agent forks afresh
    assert sandbox.commands.run("echo still").stdout == "still\n"
    assert sandbox.commands.run("echo $$ $PPID").stdout.split()[1] == "1"


def test_a_spare_command_starts_with_the_requested_env_and_cwd(sandbox: Sandbox) -> None:
    placed(sandbox)
    result = sandbox.commands.run("echo $GREETING; pwd", env={"GREETING": "hi"}, cwd="/tmp")
    assert result.stdout == "hi\n/tmp\n"


def _leaf_of(host_pid: int) -> str:
    return next(line for line in Path(f"/proc/{host_pid}/cgroup").read_text().splitlines()
                if line.startswith("0::"))


def test_back_to_back_commands_each_find_a_spare_placed_while_the_previous_one_ran(sandbox: Sandbox) -> None:
    inner = sandbox._inner
    assert isinstance(inner, ProcessSandbox)
    placed(sandbox)
    cat = sandbox.commands.start("cat", timeout=10)  # takes the spare: the next one is forked now
    try:
        # placed while cat still runs, in a leaf of its own (not cat's, not the agent's)
        placed(sandbox)
        assert not cat.done
        assert inner._spare is not None
        spare_inside, spare, leaf = inner._spare
        where = _leaf_of(spare)
        assert where.endswith("/" + leaf.name) and where != _leaf_of(inner._agent_host_pid())
        said = sandbox.commands.run("echo $$; cat /proc/self/cgroup").stdout.split()
        # the next command ran in it, at once, in that leaf (seen from inside: the sandbox's
        # cgroup namespace shows the path from the host's root here, v1 hybrid, or its own)
        assert said[0] == str(spare_inside)
        assert any(line.startswith("0::") and line.endswith("/" + leaf.name) for line in said)
    finally:
        cat.close_stdin()
        assert cat.wait().exit_code == 0
    # and so on: every command of a quick series runs in its own fresh leaf
    leaves = [own_cgroup(sandbox) for _ in range(5)]
    assert len(set(leaves)) == 5


def test_a_spares_host_pid_taken_by_a_host_process_is_never_moved_into_the_sandbox(sandbox: Sandbox) -> None:
    """A spare that died leaves its host pid free, and a sandbox can churn pids until a host
    process gets it: that process must not be moved into the sandbox's tree (whose destroy kills
    everything in it).  The host process here stands for the reused pid."""
    import subprocess

    placed(sandbox)
    inner = sandbox._inner
    assert isinstance(inner, ProcessSandbox)
    host = subprocess.Popen(["sleep", "60"])
    try:
        cgroup_before = Path(f"/proc/{host.pid}/cgroup").read_text()
        with inner._lock:
            assert inner._spare is not None
            nspid, _, leaf = inner._spare
            inner._spare = (nspid, host.pid, leaf)  # the spare's number, now a host process's
        result = sandbox.commands.run("echo ran")
        assert result.exit_code == 0 and result.stdout == "ran\n"
        assert Path(f"/proc/{host.pid}/cgroup").read_text() == cgroup_before
        assert host.poll() is None
    finally:
        host.kill()
        host.wait()
    assert sandbox.commands.run("echo still").stdout == "still\n"


def _placer_stopped(inner: ProcessSandbox) -> threading.Event:
    """The placer thread places no spare of ``inner`` any more (its job only removes finished
    leaves), and the returned event is set once the agent has announced its next spare."""
    announced = threading.Event()
    inner._place_spare = lambda nspid: None  # type: ignore[method-assign]
    channel = inner._channel
    assert channel is not None and channel.on_spare is not None
    forked = channel.on_spare

    def on_spare(nspid: int) -> None:
        forked(nspid)
        announced.set()

    channel.on_spare = on_spare
    return announced


def test_a_command_that_comes_before_its_spare_is_placed_places_it_and_runs_in_it(sandbox: Sandbox) -> None:
    inner = sandbox._inner
    assert isinstance(inner, ProcessSandbox)
    placed(sandbox)
    announced = _placer_stopped(inner)
    cat = sandbox.commands.start("cat", timeout=10)  # takes the placed spare; the next one is forked
    try:
        assert announced.wait(10.0), "the agent announced no new spare"
        nspid = inner._announced
        assert nspid is not None and inner._spare is None and not inner.spare_placed.is_set()
        said = sandbox.commands.run("echo $$; cat /proc/self/cgroup").stdout.split()
        # it ran in that spare, moved into a fresh leaf of its own before it ran (not cat's, not
        # the agent's), by the command's own start: the placer thread placed nothing
        assert said[0] == str(nspid)
        own = next(line for line in said if line.startswith("0::"))
        assert own.rsplit("/", 1)[1].startswith("e")
        assert own != _leaf_of(inner._agent_host_pid())
        assert cat.pid is not None and own not in sandbox.commands.run(f"cat /proc/{cat.pid}/cgroup").stdout
    finally:
        cat.close_stdin()
        assert cat.wait().exit_code == 0


def test_a_spare_that_cannot_be_placed_when_its_command_comes_fails_it_closed(sandbox: Sandbox) -> None:
    from corral.errors import ContainmentFailed

    inner = sandbox._inner
    assert isinstance(inner, ProcessSandbox) and inner.cgroup is not None
    limit = inner.cgroup.kill_group / "cgroup.max.descendants"
    if not limit.exists():
        pytest.skip("the kill tree is a v1 freezer: no cgroup.max.descendants to refuse a leaf")
    placed(sandbox)
    announced = _placer_stopped(inner)
    sandbox.commands.run("true")  # takes the placed spare; the next one is announced, not placed
    assert announced.wait(10.0), "the agent announced no new spare"
    assert inner._announced is not None
    limit.write_text(str(sum(1 for p in inner.cgroup.kill_group.iterdir() if p.is_dir())))
    try:
        with pytest.raises(ContainmentFailed):
            sandbox.commands.run("touch /tmp/ran")
    finally:
        limit.write_text("max")
    assert not sandbox.files.exists("/tmp/ran"), "the refused command ran"
    assert sandbox.commands.run("echo fine").stdout == "fine\n"
