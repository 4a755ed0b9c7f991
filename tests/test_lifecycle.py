"""Create/exec/destroy, the registry and the janitor."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from corral import AsyncSandbox, Sandbox, SandboxClosed, run

from .leaks import all_leftovers, assert_gone_soon, kill_9, remove_cgroup_parent, sandbox_leftovers, start_owner


def test_state_is_kept_between_execs(sandbox: Sandbox) -> None:
    sandbox.commands.run("echo one > /tmp/state; mkdir -p /workspace/proj")
    sandbox.cwd = "/workspace/proj"
    assert sandbox.commands.run("cat /tmp/state; pwd").stdout == "one\n/workspace/proj\n"


def test_run_is_create_exec_destroy(state_dir: Path) -> None:
    before = set((state_dir / "sandboxes").iterdir())
    result = run("echo $((6 * 7))")
    assert result.stdout == "42\n" and result.exit_code == 0 and result.duration_ms > 0
    assert set((state_dir / "sandboxes").iterdir()) == before


def test_closed_sandbox_refuses_work() -> None:
    sb = Sandbox.create()
    sb.kill()
    sb.kill()  # idempotent
    with pytest.raises(SandboxClosed):
        sb.commands.run("true")
    assert not sb.is_running()


def test_two_hundred_cycles_leave_nothing(state_dir: Path) -> None:
    for _ in range(200):
        with Sandbox.create() as sb:
            assert sb.commands.run(["true"]).exit_code == 0
    assert all_leftovers(state_dir) == []


@pytest.mark.parametrize("janitors_parent", ["same", "other"])
def test_kill_9_of_the_owner_then_gc_leaves_nothing(state_dir: Path, janitors_parent: str) -> None:
    # the janitor may run in another environment than the owner did (an operator's `corral gc`
    # without the server's CORRAL_CGROUP_PARENT): the owner's parent is in the sandbox's row
    from corral.host import cgroups

    owner, ids = start_owner("a = Sandbox.create(); b = Sandbox.create()\n"
                             "a.commands.run('nohup sleep 300 >/dev/null 2>&1 &')\n"
                             "print(a.id, b.id, flush=True)")
    kill_9(owner)
    assert len(ids) == 2
    env = dict(os.environ)
    elsewhere = f"{cgroups.PARENT}-janitor"
    if janitors_parent == "other":
        env["CORRAL_CGROUP_PARENT"] = elsewhere
    try:
        out = subprocess.run([sys.executable, "-m", "corral.cli", "gc"], capture_output=True, text=True,
                             timeout=60, env=env)
    finally:
        remove_cgroup_parent(elsewhere)
    assert out.returncode == 0, out.stderr
    for sandbox_id in ids:
        assert sandbox_id in out.stdout
        assert_gone_soon(sandbox_id, state_dir)


def test_a_process_that_goes_on_creating_reaps_what_a_killed_owner_left_meanwhile(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-lived owner (a server, an agent's process) ran the janitor at its first create only:
    what another owner killed later left stayed until `corral gc` or another process's first
    create.  Past JANITOR_EVERY, a create sweeps again, beside it."""
    from corral import local_transport

    monkeypatch.setattr(local_transport, "JANITOR_EVERY", 3600.0, raising=False)
    with Sandbox.create():  # this process's first sweep is behind it
        pass
    owner, ids = start_owner("a = Sandbox.create()\nprint(a.id, flush=True)")
    kill_9(owner)
    (orphan,) = ids
    assert sandbox_leftovers(orphan, state_dir), "the killed owner left nothing to reap"
    with Sandbox.create() as sb:  # within JANITOR_EVERY of the last sweep: none
        time.sleep(0.5)
        assert sandbox_leftovers(orphan, state_dir), "swept within JANITOR_EVERY"
        monkeypatch.setattr(local_transport, "JANITOR_EVERY", 0.0, raising=False)
        with Sandbox.create() as other:  # past it: a sweep beside the create, which is not held up
            assert other.commands.run("echo ok").stdout == "ok\n"
        assert_gone_soon(orphan, state_dir)
        assert sb.commands.run("echo alive").stdout == "alive\n"  # live sandboxes are left alone


@pytest.mark.parametrize("tier", ["process", "gvisor"])
def test_a_sandbox_outlives_the_thread_that_created_it(tier: str, state_dir: Path) -> None:
    # bwrap dies with the thread that forked it (--die-with-parent): the tier forks it from a
    # thread of its own, so callers (pools, servers, worker threads) need no launcher of theirs
    from .tier_probe import skip_unless_tier

    skip_unless_tier(tier, state_dir)
    made: list[Sandbox] = []
    thread = threading.Thread(target=lambda: made.append(Sandbox.create(tier=tier)))
    thread.start()
    thread.join()
    with made[0] as sb:
        time.sleep(0.2)  # PDEATHSIG would have been delivered by now
        assert sb.is_running()
        assert sb.commands.run(["echo", "alive"]).stdout == "alive\n"


def test_gc_leaves_live_owners_alone(sandbox: Sandbox, state_dir: Path) -> None:
    from corral.registry import gc

    assert sandbox.id not in gc(state_dir)
    assert sandbox.commands.run("echo alive").stdout == "alive\n"


def test_async_sandbox_has_the_same_surface() -> None:
    async def main() -> tuple[str, str]:
        async with await AsyncSandbox.create(memory="128M") as sb:
            result = await sb.commands.run("echo async")
            await sb.files.write("f.txt", "via asyncio")
            return result.stdout, await sb.files.read("f.txt")

    assert asyncio.run(main()) == ("async\n", "via asyncio")


def test_streaming_callbacks_see_output_before_the_end(sandbox: Sandbox) -> None:
    chunks: list[tuple[float, str]] = []
    start = time.monotonic()
    result = sandbox.commands.run("echo first; sleep 1; echo second",
                                  on_stdout=lambda s: chunks.append((time.monotonic() - start, s)))
    assert "".join(c for _, c in chunks) == result.stdout == "first\nsecond\n"
    assert chunks[0][0] < 0.8


def test_files_api_round_trip_and_errors(sandbox: Sandbox, tmp_path: Path) -> None:
    from corral import FileNotFoundInSandbox, InvalidSpec

    sandbox.files.write("/tmp/x/y/z.bin", b"\x00\x01" * 5)
    assert sandbox.files.read("/tmp/x/y/z.bin", format="bytes") == b"\x00\x01" * 5
    assert [e.name for e in sandbox.files.list("/tmp/x/y")] == ["z.bin"]
    assert sandbox.files.stat("/tmp/x/y/z.bin").size == 10
    with pytest.raises(FileNotFoundInSandbox):
        sandbox.files.read("/nope")
    with pytest.raises(InvalidSpec):
        sandbox.files.read("bad\0path")
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "a.txt").write_text("A")
    (tmp_path / "up" / "sub").mkdir()
    (tmp_path / "up" / "sub" / "b.txt").write_text("B")
    assert sandbox.files.upload_dir(tmp_path / "up", "/tmp/up") == 2
    assert sandbox.files.download_dir("/tmp/up", tmp_path / "down") == 2
    assert (tmp_path / "down" / "sub" / "b.txt").read_text() == "B"
    sandbox.files.remove("/tmp/up", recursive=True)
    assert not sandbox.files.exists("/tmp/up")
    # how deep a tree is, the sandbox decides: 1,100 levels (past Python's recursion limit) come whole
    made = sandbox.commands.run("mkdir -p /tmp/deep && cd /tmp/deep && for i in $(seq 1100); do mkdir d && cd d; done"
                                " && echo bottom > f")
    assert made.exit_code == 0, made
    try:
        assert sandbox.files.download_dir("/tmp/deep", tmp_path / "deep") == 1
        assert (tmp_path / "deep").joinpath(*["d"] * 1100, "f").read_text() == "bottom\n"
    finally:  # pytest's own cleanup of tmp_path recurses, and would fail at the session's end
        subprocess.run(["rm", "-rf", str(tmp_path / "deep")], check=True)


def test_a_download_takes_no_more_names_or_bytes_than_the_sandboxs_disk_holds(tmp_path: Path) -> None:
    """A sandbox moving a directory one level down after each listing had the host list the same
    files at every level: `corral cp` wrote 30,000 host files from a sandbox holding 1,000, and
    listing 20,000 names at 60 levels took the host process from 25 to 465 MiB (the byte budget
    counted no empty file, nor any name).  A download now stops before writing anything at more
    names than the sandbox's disk holds (a name per 4 KiB of it), and reads no file past what is
    left of its bytes; within both it is whole."""
    from corral.errors import ResourceLimit

    with Sandbox.create(disk="16M", memory="128M") as sb:
        # the image's /usr/lib is not on the sandbox's disk: more names than 16 MiB holds (4,096)
        with pytest.raises(ResourceLimit, match="names"):
            sb.files.download_dir("/usr/lib", tmp_path / "lib")
        assert not (tmp_path / "lib").exists()
        made = sb.commands.run("mkdir -p /tmp/t/sub && cd /tmp/t && for i in $(seq 300); do : > f$i; done"
                               " && head -c 3000000 /dev/zero > sub/big && ln sub/big sub/big2 && ln sub/big sub/big3"
                               " && ln sub/big sub/big4 && ln sub/big sub/big5 && ln sub/big sub/big6")
        assert made.exit_code == 0, made
        with pytest.raises(ResourceLimit, match="disk limit"):  # 6 names of 3 MB: 18 MB
            sb.files.download_dir("/tmp/t", tmp_path / "links")
        sb.commands.run("rm /tmp/t/sub/big[3-6]")
        assert sb.files.download_dir("/tmp/t", tmp_path / "t") == 302
        assert (tmp_path / "t" / "sub" / "big2").stat().st_size == 3000000
    # the bound is what the disk holds (within memory), not `disk`: a sparse file of 1 GiB was
    # written whole from a disk holding 371 MiB
    with Sandbox.create(memory="128M") as sb:
        assert sb.commands.run("mkdir /tmp/s && truncate -s 500M /tmp/s/sparse").exit_code == 0
        with pytest.raises(ResourceLimit, match="disk limit"):
            sb.files.download_dir("/tmp/s", tmp_path / "sparse")
        assert not (tmp_path / "sparse" / "sparse").exists()


def test_a_download_of_a_tree_that_grows_as_it_is_walked_stops_at_the_disks_names() -> None:
    """The walk itself, over a tree that shows one more level below each listing (as a sandbox
    moving its directory down does): it stops at the names the disk holds, having held no more."""
    from corral.errors import ResourceLimit
    from corral.surface import NAME_COST, download_dir
    from corral.tiers.base import FileEntry

    class EndlessTree:
        listed = 0

        def list(self, path: str = ".") -> list[FileEntry]:
            self.listed += 1
            names = [FileEntry(f"f{i}", f"{path}/f{i}", "file", 0, 0o644, 0.0) for i in range(1000)]
            return [*names, FileEntry("A", f"{path}/A", "dir", 0, 0o755, 0.0)]

        def read(self, path: str, format: str = "bytes", max_bytes: int = 0) -> bytes:
            raise AssertionError("nothing is read before the walk is done")

        def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None: ...

        def make_dir(self, path: str, mode: int = 0o755) -> None: ...

    tree = EndlessTree()
    with pytest.raises(ResourceLimit, match="32,768 names"):
        download_dir(tree, "/tmp/w", "/nonexistent-never-made", 32768 * NAME_COST)  # type: ignore[arg-type]
    assert tree.listed == 33
    assert not Path("/nonexistent-never-made").exists()


def test_cli_run_exit_codes_and_json(tmp_path: Path) -> None:
    def corral(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral.cli", *args], capture_output=True, text=True, timeout=60)

    assert corral("run", "--", "sh", "-c", "echo hi; exit 3").returncode == 3
    r = corral("run", "--timeout", "1", "--", "sleep", "10")
    assert r.returncode == 124 and "timed out" in r.stderr
    r = corral("run", "--memory", "32M", "--", "/usr/bin/python3", "-c", "x = bytearray(100 << 20)")
    assert r.returncode == 137 and "out of memory" in r.stderr
    r = corral("run", "--memory", "12XB", "--", "true")
    assert r.returncode == 125 and "memory" in r.stderr
    r = corral("run", "--workspace", str(tmp_path / "missing"), "--", "true")
    assert r.returncode == 125 and "does not exist" in r.stderr
    r = corral("run", "--json", "--env", "A=b", "--", "sh", "-c", "echo $A; exit 5")
    assert r.returncode == 0
    payload = json.loads(r.stdout)
    assert payload["exit_code"] == 5 and payload["stdout"] == "b\n" and payload["sandbox_id"].startswith("sb-")
    assert set(payload) >= {"sandbox_id", "exit_code", "stdout", "stderr", "timed_out", "oom_killed", "duration_ms"}


def test_cli_doctor_reports_capabilities() -> None:
    r = subprocess.run([sys.executable, "-m", "corral.cli", "doctor", "--json"], capture_output=True, text=True, timeout=60)
    report = json.loads(r.stdout)
    names = {c["name"]: c for c in report["host"]}
    assert names["cgroups"]["ok"] and names["bubblewrap"]["ok"] and names["user namespaces"]["ok"]
    assert names["network allow"]["ok"], names["network allow"]
    # says whether a command after a pause pays for an RCU grace period, and the host option against it
    assert "favordynmods" in names["cgroup moves"]["detail"]
    assert any(t["tier"] == "process" and t["available"] for t in report["tiers"])


def test_missing_bubblewrap_is_a_clear_host_error() -> None:
    env = {**os.environ, "PATH": "/nonexistent"}
    r = subprocess.run([sys.executable, "-m", "corral.cli", "run", "--", "true"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 125
    assert "bubblewrap is not installed" in r.stderr and "apt-get install bubblewrap" in r.stderr


def test_close_stdin_on_a_terminal_is_its_end_of_file(sandbox: Sandbox) -> None:
    """A terminal's input cannot be closed (its master is also the output): close_stdin() on a PTY
    command did nothing, and `cat` ran to its timeout (124). It is now the terminal's EOF
    character, after what was sent before it; a command nobody closes keeps running."""
    cat = sandbox.commands.start("cat", pty=(24, 80), timeout=20)
    cat.send_stdin("hello\n")
    time.sleep(1)
    assert not cat.done
    cat.close_stdin()
    result = cat.wait()
    assert result.exit_code == 0 and not result.timed_out and "hello" in result.stdout, result


def test_commands_can_run_on_a_terminal_and_be_resized(sandbox: Sandbox) -> None:
    out: list[bytes] = []
    handle = sandbox.commands.start("tty; stty size; read line; stty size", pty=(40, 100),
                                    on_output=lambda _s, c: out.append(c))
    time.sleep(0.5)
    handle.resize(30, 90)
    handle.send_stdin("go\n")
    result = handle.wait()
    text = b"".join(out).decode()
    assert result.exit_code == 0
    assert "/dev/pts/" in text and "40 100" in text and "30 90" in text


def test_corral_shell_runs_an_interactive_session() -> None:
    import pty as host_pty

    pid, fd = host_pty.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-m", "corral.cli", "shell"])
    output = b""
    sent = False
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
            if not sent and b"$ " in output:  # the sandbox shell's prompt
                os.write(fd, b"echo marker-$((20 + 22)); exit 7\n")
                sent = True
    finally:
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert b"marker-42" in output
    assert os.waitstatus_to_exitcode(status) == 7


def test_agent_is_installed_where_unprivileged_launchers_can_read_it(state_dir: Path) -> None:
    # the checkout may live under a 0700 home; bwrap runs as the sandbox uid
    from corral.registry import state_dir as prepare_state_dir
    from corral.tiers import get_tier

    prepare_state_dir(state_dir)
    agent = get_tier("process", state_dir)._agent  # type: ignore[attr-defined]
    assert agent.parent == state_dir / "bin"
    for path in (agent, *agent.parents):
        assert path.stat().st_mode & 0o001, f"{path} is not traversable/readable by others"
        if path == state_dir:
            break


def test_sandboxes_do_not_leak_file_descriptors() -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with Sandbox.create() as sb:
        sb.commands.run(["true"])
    before = open_fds()
    for _ in range(10):
        with Sandbox.create() as sb:
            sb.commands.run(["true"])
            sb.files.write("/tmp/f", "x")
    assert open_fds() <= before


@pytest.mark.parametrize("tier", ["process", "gvisor"])
@pytest.mark.parametrize("network", ["none", "allow"])
def test_a_create_that_fails_half_way_leaves_nothing(tier: str, network: str, state_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # the tier's launch fails after the base made uid(s), cgroup, network and root: its close
    # (the one owner of each) releases them all, without the registry's reap as a backstop
    from corral.host.mounts import mounted_anywhere
    from corral.registry import state_dir as prepare_state_dir
    from corral.spec import SandboxSpec
    from corral.tiers import get_tier
    from corral.tiers.gvisor import GVisorSandbox
    from corral.tiers.linux.sandbox import LinuxSandbox
    from corral.tiers.process import ProcessSandbox

    from .tier_probe import skip_unless_tier

    skip_unless_tier(tier, state_dir)
    made: list[LinuxSandbox] = []

    def launch_fails(self: LinuxSandbox, *args: object) -> None:
        made.append(self)
        # its root is mounted (the process tier's in a mount namespace of its own)
        assert self.cgroup is not None and self.network is not None and mounted_anywhere(self._run_dir)
        raise RuntimeError("launch failed")

    monkeypatch.setattr(ProcessSandbox if tier == "process" else GVisorSandbox, "_launch", launch_fails)
    root = prepare_state_dir(state_dir)
    uids_before = set(os.listdir(root / "uids")) if (root / "uids").is_dir() else set()
    sandbox_id = f"halfway-{tier}-{network}"
    run_dir = root / "sandboxes" / sandbox_id
    run_dir.mkdir(mode=0o700, parents=True)
    with pytest.raises(RuntimeError, match="launch failed"):
        get_tier(tier, root).create(SandboxSpec(tier=tier, network=network), sandbox_id, run_dir)
    assert made and made[0]._closed
    assert sandbox_leftovers(sandbox_id, root) == []
    assert set(os.listdir(root / "uids")) == uids_before


def test_a_host_failure_is_a_typed_error_naming_the_sandbox(tmp_path: Path) -> None:
    # a system call failing on the host reaches the caller as a HostError, never a bare OSError
    import errno

    from corral.errors import HostError, InvalidSpec, ResourceLimit, host_errors

    state = tmp_path / "state"
    state.mkdir()
    (state / "sandboxes").write_text("not a directory")  # every sandbox's run dir goes below it
    with pytest.raises(HostError) as failed:
        Sandbox.create(state=state)
    assert failed.value.sandbox_id is not None and failed.value.errno != 0
    assert "create the sandbox" in str(failed.value) and not isinstance(failed.value, ResourceLimit)
    # the host running out of something is a ResourceLimit; typed errors pass through untouched
    with pytest.raises(ResourceLimit, match="out of capacity"), host_errors("write", "sb-x"):
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(InvalidSpec), host_errors("write", "sb-x"):
        raise InvalidSpec("bad")


def test_errors_about_a_sandbox_name_it(sandbox: Sandbox) -> None:
    # (a command's ContainmentFailed: test_session_containment's leaf refusal checks its id)
    from corral.errors import FileNotFoundInSandbox

    with pytest.raises(FileNotFoundInSandbox) as missing:  # raised by the agent channel, below the lifecycle
        sandbox.files.read("/no/such/file")
    assert missing.value.sandbox_id == sandbox.id


def test_an_owner_under_a_low_open_files_limit_still_holds_many_sandboxes() -> None:
    # a distribution's default soft RLIMIT_NOFILE (1024) would stop an owner at a few hundred
    # sandboxes; Corral raises its soft limit to the hard one before the first create
    script = """
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 4096))
from corral import Sandbox
live = [Sandbox.create() for _ in range(30)]
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], sum(sb.commands.run("true").exit_code == 0 for sb in live))
for sb in live:
    sb.kill()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                         env=os.environ.copy())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["4096", "30"]


def test_two_state_directories_never_hand_out_the_same_host_uid(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # range records live in each state directory; without the host-wide claim two Corral instances
    # (two servers, parallel test runs) could give two live sandboxes the same host users
    import random

    from corral.host import uids

    free = sorted(set(range(uids.SLOTS)) - uids.host_slots())[:2]
    draws = iter([free[0], free[0], free[1]])
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, n: next(draws))
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    first_dir.mkdir()
    second_dir.mkdir()
    first = uids.allocate_range(first_dir, "sb-first")
    second = uids.allocate_range(second_dir, "sb-second")
    try:
        assert first.base == uids.UID_BASE + free[0] * uids.RANGE_SIZE
        assert second.base == uids.UID_BASE + free[1] * uids.RANGE_SIZE
        assert not (second_dir / "uids" / str(first.base)).exists()
        # a claim whose state directory is gone (removed without gc) is stale and taken over
        shutil.rmtree(first_dir)
        draws = iter([free[0]])
        assert uids.allocate_range(second_dir, "sb-third") == first
        uids.release_range(second_dir, first.user, owner="sb-third")  # any uid of the range releases it
    finally:
        uids.release_range(second_dir, second.base, owner="sb-second")
        uids.release_range(first_dir, first.base, owner="sb-first")
    assert not (uids.CLAIMS / str(first.base)).exists() and not (uids.CLAIMS / str(second.base)).exists()
