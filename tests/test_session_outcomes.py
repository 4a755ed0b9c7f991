"""What a command's timeout and its OOM verdict mean in a long session, where earlier commands
left processes behind and other threads run commands of their own (process tier).

* A command started and never waited for (``commands.start``, ``run(background=True)``) ends at
  its timeout: before, only a caller's ``wait()`` killed it, so a session that started commands
  with a timeout and forgot them filled the sandbox's pids with them, and their kill-tree leaves
  stayed.
* ``oom_killed`` is the command's own: the sandbox's OOM count rises for any of its processes, and
  a command that ran while a process left by an earlier one was OOM-killed came back
  ``oom_killed=True`` (``check=True`` raised ``OutOfMemory`` for ``echo ok``), with its own
  background children killed for it.
"""

from __future__ import annotations

import threading
import time

import pytest

from corral import OutOfMemory, Sandbox
from corral.tiers.process import ProcessSandbox

from .sandbox_wait import wait_until

#: grows by 8 MiB every 50 ms until the kernel kills it (in a 96M sandbox: within ~1 s)
GROWER = "import time\na = []\nwhile True:\n    a.append(bytearray(8 << 20)); time.sleep(0.05)"


def kill_tree_leaves(sb: Sandbox) -> int:
    inner = sb._backend.inner  # type: ignore[attr-defined]
    assert isinstance(inner, ProcessSandbox) and inner.cgroup is not None
    return sum(1 for entry in inner.cgroup.kill_group.iterdir() if entry.is_dir())


def sleeps_inside(sb: Sandbox) -> int:
    return int(sb.commands.run("pgrep -c -x sleep || true").stdout.strip() or 0)


def test_a_command_nobody_waits_for_still_ends_at_its_timeout() -> None:
    threads_before = set(threading.enumerate())
    with Sandbox.create(pids=64) as sb:
        leaves_before = kill_tree_leaves(sb)
        started = time.monotonic()
        handle = sb.commands.start("sleep 1000", timeout=1)
        background = sb.commands.run("sleep 1001", background=True, timeout=1)
        assert wait_until(lambda: handle.done and background.done, 5), "killed only once someone waits"
        assert time.monotonic() - started < 4
        assert sleeps_inside(sb) == 0 and sb.commands.list() == []
        # a caller who comes back later reads the timeout, as a waiting one would have
        late = handle.wait()
        assert (late.exit_code, late.timed_out) == (124, True)
        assert background.wait().timed_out
        # a session of forgotten commands: each ends, and its leaf goes (before: 40 sleeps held
        # 40 of the 64 pids, and 40 leaves stayed)
        forgotten = [sb.commands.start("sleep 1000", timeout=0.5) for _ in range(40)]
        assert wait_until(lambda: all(h.done for h in forgotten), 10)
        assert sleeps_inside(sb) == 0
        assert wait_until(lambda: kill_tree_leaves(sb) <= leaves_before + 1, 5), kill_tree_leaves(sb)  # (+1: the next spare's)
        assert sb.commands.run("echo alive").stdout == "alive\n"
        # and the thread that waited for each is gone with it
        assert wait_until(lambda: not [t for t in threading.enumerate()
                                       if t.name == "corral-command-end" and t not in threads_before], 5)


def test_a_command_that_ends_before_its_timeout_keeps_its_result_for_a_late_wait() -> None:
    with Sandbox.create() as sb:
        handle = sb.commands.start("echo done; exit 3", timeout=30)
        assert wait_until(lambda: handle.done, 5)
        time.sleep(0.2)
        result = handle.wait()
        assert (result.exit_code, result.stdout, result.timed_out) == (3, "done\n", False)


def test_an_oom_kill_of_a_process_another_command_left_is_not_the_running_commands() -> None:
    with Sandbox.create(memory="96M", pids=64) as sb:
        grower = f"setsid python3 -c '{GROWER}' >/dev/null 2>&1 &"
        assert sb.commands.run(f"{grower} echo left").stdout == "left\n"
        # runs while the kernel kills the grower: exits 0, and its own background child lives
        innocent = sb.commands.run("setsid sleep 100 & sleep 3; echo innocent", timeout=30)
        assert (innocent.exit_code, innocent.stdout, innocent.oom_killed) == (0, "innocent\n", False)
        assert sleeps_inside(sb) == 1
        assert sb.commands.run("pgrep -c -f 'bytearra[y]' || true").stdout.strip() == "0"  # it was killed
        sb.commands.run(grower)
        assert sb.commands.run("sleep 3; echo ok", timeout=30, check=True).stdout == "ok\n"
        # the command the kernel kills is OOM-killed, typed, as ever
        with pytest.raises(OutOfMemory) as hog:
            sb.commands.run(["python3", "-c", "b = bytearray(400 << 20)"], timeout=30, check=True)
        assert hog.value.result is not None and hog.value.result.oom_killed


def test_a_command_of_another_thread_is_not_oom_killed_by_a_hogs_kill() -> None:
    with Sandbox.create(memory="96M", pids=64) as sb:
        results: dict[str, object] = {}

        def innocent() -> None:
            results["innocent"] = sb.commands.run("setsid sleep 100 & sleep 3; echo innocent", timeout=30)

        thread = threading.Thread(target=innocent)
        thread.start()
        time.sleep(0.5)
        hog = sb.commands.run(["python3", "-c", GROWER], timeout=30)
        thread.join(30)
        assert hog.oom_killed and hog.exit_code == 137
        result = results["innocent"]
        assert (result.exit_code, result.oom_killed) == (0, False)  # type: ignore[attr-defined]
        assert sleeps_inside(sb) == 1


def test_a_run_its_caller_leaves_early_still_ends_at_its_timeout() -> None:
    """A run() that raises before its wait (its stdin refused, the caller interrupted: here the
    ``started`` hook raising) leaves a command nobody waits for: it still ends at its timeout."""
    from corral.commands import check_call

    class Interrupted(Exception):
        pass

    def interrupted(_: object) -> None:
        raise Interrupted

    with Sandbox.create() as sb:
        with pytest.raises(Interrupted):
            sb._backend.run(check_call("sleep 1000", 1, None, None), None, None, interrupted)  # type: ignore[attr-defined]
        assert wait_until(lambda: [c.argv for c in sb.commands.list()] == [["/bin/sh", "-c", "sleep 1000"]], 5)
        assert wait_until(lambda: not sb.commands.list(), 5), "it ran on past its timeout"
        assert sleeps_inside(sb) == 0
