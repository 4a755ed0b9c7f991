"""The process tier's walls, each checked in both directions on the real kernel."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from corral import Sandbox
from corral.host import cgroups
from corral.host import uids as host_uids

PY = "/usr/bin/python3"


def syscall_errno(sb: Sandbox, expr: str) -> str:
    """Run a ctypes syscall expression inside the sandbox; print 'ok' or the errno name."""
    code = (
        "import ctypes, errno, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"r = {expr}\n"
        "print('ok' if r >= 0 else errno.errorcode[ctypes.get_errno()])\n"
    )
    result = sb.commands.run([PY, "-c", code])
    assert result.exit_code == 0, result
    return result.stdout.strip()


def test_runs_as_unprivileged_user_with_no_capabilities(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("id -u; grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status")
    lines = r.stdout.split()
    assert lines[0] == "1000"
    status = dict(zip(lines[1::2], lines[2::2], strict=True))
    assert status["CapEff:"] == status["CapPrm:"] == status["CapBnd:"] == "0000000000000000"
    assert status["NoNewPrivs:"] == "1"
    assert status["Seccomp:"] == "2"


def test_host_uid_outside_is_unprivileged(sandbox: Sandbox) -> None:
    marker = "sleep\x0031.4159"
    handle = sandbox.commands.start("exec sleep 31.4159")
    try:
        deadline = time.monotonic() + 5
        uids: list[int] = []
        while not uids and time.monotonic() < deadline:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(marker.encode()):
                        uids.append(os.stat(f"/proc/{pid}").st_uid)
                except OSError:
                    continue
            time.sleep(0.05)
        assert uids and all(host_uids.UID_BASE <= uid < host_uids.UID_TOP for uid in uids), uids
    finally:
        handle.kill()
        handle.wait()


def test_denied_syscalls_fail_and_ordinary_ones_work(sandbox: Sandbox) -> None:
    # allowed: ordinary process and file work
    assert syscall_errno(sandbox, "libc.getpid()") == "ok"
    assert syscall_errno(sandbox, "os.fork() if False else 0") == "ok"
    assert sandbox.commands.run("sh -c 'echo child' && (sleep 0.1 &) && echo parent").exit_code == 0
    # denied by seccomp (EPERM), whatever the namespaces would allow
    assert syscall_errno(sandbox, "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)") == "EPERM"
    assert syscall_errno(sandbox, "libc.unshare(0x10000000)") == "EPERM"  # CLONE_NEWUSER
    assert syscall_errno(sandbox, "libc.setns(0, 0)") == "EPERM"
    assert syscall_errno(sandbox, "libc.ptrace(16, 1, 0, 0)") == "EPERM"  # PTRACE_ATTACH
    assert syscall_errno(sandbox, "libc.syscall(321, 0, 0, 0)") == "EPERM"  # bpf
    assert syscall_errno(sandbox, "libc.syscall(250, 0, 0, 0)") == "EPERM"  # keyctl
    assert syscall_errno(sandbox, "libc.syscall(323, 0)") == "EPERM"  # userfaultfd
    assert syscall_errno(sandbox, "libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)") == "EPERM"  # clone(NEWUSER)
    assert syscall_errno(sandbox, "libc.syscall(435, 0, 0)") == "ENOSYS"  # clone3: libc falls back
    # memfd_secret: its pages leave the kernel's direct map; as on a kernel built without it
    assert syscall_errno(sandbox, "libc.syscall(447, 0)") == "ENOSYS"
    assert sandbox.commands.run("unshare -U true").exit_code != 0
    assert sandbox.commands.run("mount -t tmpfs none /tmp").exit_code != 0


def test_each_sandbox_has_a_boot_id_of_its_own(sandbox: Sandbox) -> None:
    # the host's boot id in every sandbox would tell tenants they share a host, across sessions
    host = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with Sandbox.create() as other:
        ids = [sb.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip() for sb in (sandbox, other)]
        assert other.commands.run("echo x > /proc/sys/kernel/random/boot_id").exit_code != 0
    assert all(len(i) == 36 for i in ids), ids
    assert len({host, *ids}) == 3, (host, ids)
    assert sandbox.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip() == ids[0]  # stable


def test_only_ordinary_socket_families_open_and_vsock_never(sandbox: Sandbox) -> None:
    def socket_errno(family: int, kind: int = 1) -> str:  # SOCK_STREAM; the family as a full register
        return syscall_errno(sandbox, f"libc.syscall(41, ctypes.c_long({family}), {kind}, 0)")

    # allowed: what programs use (glibc's getaddrinfo works without netlink, below)
    assert socket_errno(1) == socket_errno(2) == socket_errno(10) == "ok"  # AF_UNIX, AF_INET, AF_INET6
    r = sandbox.commands.run([PY, "-c", "import socket; print(socket.getaddrinfo('localhost', 80)[0][4][1])"])
    assert r.stdout.strip() == "80", r.stderr
    # refused as if this kernel had none: AF_VSOCK (not network-namespaced: it reaches the
    # hypervisor of a VM host whatever the sandbox's network), AF_PACKET, AF_ALG, AF_TIPC, AF_UNSPEC...
    for family in (40, 17, 38, 30, 0, 3):
        assert socket_errno(family) == "EAFNOSUPPORT", family
    # the kernel reads the family from the low 32 bits: high bits set refuse it, never pass it
    assert socket_errno((1 << 32) | 40) == socket_errno((1 << 32) | 1) == "EAFNOSUPPORT"
    assert socket_errno(-(1 << 32) + 40) == "EAFNOSUPPORT"
    # socketpair(2) reaches a family's create code as socket(2) does: pairs are AF_UNIX's only
    pair = "libc.socketpair({family}, 1, 0, (ctypes.c_int * 2)())"
    assert syscall_errno(sandbox, pair.format(family=1)) == "ok"
    for family in (16, 40, 30, 17, (1 << 32) | 1):
        assert syscall_errno(sandbox, f"libc.syscall(53, ctypes.c_long({family}), 1, 0, (ctypes.c_int * 2)())") == "EAFNOSUPPORT", family


NETLINK_FILL = """
import errno, socket, struct
# RTM_GETLINK of ifindex 1, an answer asked for each: replies the sandbox never reads
request = struct.pack("=LHHLL", 32, 18, 1 | 4, 0, 0) + struct.pack("=BxHiII", 0, 0, 1, 0, 0)
held, queued = [], 0
for protocol in (0, 4, 15):  # NETLINK_ROUTE, NETLINK_SOCK_DIAG, NETLINK_KOBJECT_UEVENT
    try:
        held.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol))
    except OSError as e:
        print(protocol, errno.errorcode[e.errno])
for _ in range(8 if held else 0):  # where netlink opens: 8 sockets' queues, filled
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.bind((0, 0))
    for _ in range(400):
        s.send(request)
    held.append(s)
for line in open("/proc/net/netlink").readlines()[1:]:
    queued += int(line.split()[4])
print("queued", queued)
"""


def test_a_sandbox_cannot_queue_kernel_memory_no_group_is_charged_for(sandbox: Sandbox) -> None:
    """A netlink socket's receive queue is memory no memory cgroup is charged for (v1 or v2):
    before, one 64 MiB sandbox's 250 sockets queued 940 MB of unread replies (host slab +900 MiB,
    its group +5 MiB), and an ``allow`` sandbox heard the host's device events. Now no netlink
    socket opens, and what programs use netlink for has its fallback (getaddrinfo, above)."""
    result = sandbox.commands.run([PY, "-c", NETLINK_FILL], timeout=60)
    assert result.stdout.split("\n")[:3] == ["0 EAFNOSUPPORT", "4 EAFNOSUPPORT", "15 EAFNOSUPPORT"], result
    assert "queued 0" in result.stdout, result


def test_tiocsti_is_refused_but_other_ioctls_reach_the_kernel(sandbox: Sandbox) -> None:
    code = (
        "import fcntl, os, termios, errno\n"
        "r, w = os.pipe()\n"
        "for req in (termios.TIOCSTI, termios.TIOCGWINSZ):\n"
        "    try:\n"
        "        fcntl.ioctl(r, req, b'x' * 8)\n"
        "    except OSError as e:\n"
        "        print(errno.errorcode[e.errno])\n"
    )
    assert sandbox.commands.run([PY, "-c", code]).stdout.split() == ["EPERM", "ENOTTY"]


def test_host_processes_are_invisible_and_unkillable(sandbox: Sandbox) -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        r = sandbox.commands.run(f"ls /proc | grep -E '^[0-9]+$'; kill -9 {victim.pid}; echo rc=$?")
        pids = [int(x) for x in r.stdout.split() if x.isdigit()]
        assert max(pids) < 100, "only the sandbox's own processes are visible"
        assert "rc=1" in r.stdout or "No such process" in r.stderr
        assert victim.poll() is None, "the host process survived"
    finally:
        victim.kill()
        victim.wait()


def test_host_secrets_are_not_visible(sandbox: Sandbox) -> None:
    home_canary = Path("/root/.corral-canary")
    home_canary.write_text("TOPSECRET-HOME")
    os.environ["CORRAL_HOST_ONLY_SECRET"] = "TOPSECRET-ENV"
    try:
        r = sandbox.commands.run("cat /root/.corral-canary; env; ls -a /root /home; cat /etc/shadow; echo done")
        assert "TOPSECRET" not in r.stdout + r.stderr
        assert "done" in r.stdout
        # not merely unreadable: absent (the sandbox's /root is its own, empty, and readable)
        assert sandbox.commands.run("ls -A /root").stdout == ""
        assert sandbox.commands.run("test -e /root/.corral-canary").exit_code == 1
        # the allowed direction: the sandbox's own home is usable
        assert sandbox.commands.run("echo mine > ~/own && cat ~/own").stdout == "mine\n"
    finally:
        home_canary.unlink()
        del os.environ["CORRAL_HOST_ONLY_SECRET"]


def test_fork_bomb_is_held_while_the_host_keeps_spawning() -> None:
    with Sandbox.create(pids=64) as sb:
        bomb = sb.commands.start("bomb() { bomb | bomb & }; bomb; sleep 5", timeout=4)
        time.sleep(1.0)
        # the host still forks and execs freely while the bomb runs
        for _ in range(20):
            assert subprocess.run(["true"], timeout=5).returncode == 0
        current = sb._tier_sandbox().cgroup.pids()  # type: ignore[attr-defined]
        assert len(current) <= 64
        result = bomb.wait()
        # the bomb either runs into the timeout or dies out on its own once forks fail
        assert result.timed_out or "fork" in result.stderr.lower(), result
        assert sb.commands.run("echo recovered").stdout == "recovered\n"


def test_memory_bomb_is_a_typed_oom(capfd: pytest.CaptureFixture[str]) -> None:
    from corral import OutOfMemory

    with Sandbox.create(memory="64M") as sb:
        result = sb.commands.run([PY, "-c", "b = []\nwhile True: b.append(bytearray(1 << 20))"])
        assert result.oom_killed and result.exit_code == 137 and result.signal == 9
        with pytest.raises(OutOfMemory):
            sb.commands.run([PY, "-c", "x = bytearray(200 << 20)"], check=True)
        assert sb.commands.run("echo fine").stdout == "fine\n"


def test_timeout_kills_daemonized_children_too(sandbox: Sandbox) -> None:
    r = sandbox.commands.run(
        "setsid sh -c 'sleep 1000' & nohup sleep 1001 >/dev/null 2>&1 & (sleep 1002 &) ; sleep 1003",
        timeout=1,
    )
    assert r.timed_out and r.exit_code == 124
    left = sandbox.commands.run("ps -eo args | grep -c '^sleep 100' || true").stdout.strip()
    assert left == "0"


def test_background_processes_survive_between_commands(sandbox: Sandbox) -> None:
    sandbox.commands.run("nohup sleep 30 >/dev/null 2>&1 &")
    assert "sleep 30" in sandbox.commands.run("ps -eo args").stdout


def test_disk_limit_bounds_tmp_and_workspace(tmp_path: Path) -> None:
    with Sandbox.create(disk="32M", workspace=str(tmp_path)) as sb:
        r = sb.commands.run("dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1; ls -l /tmp/fill")
        assert "No space left" in r.stdout
        size = int(sb.commands.run("stat -c %s /tmp/fill").stdout)
        assert size <= 32 << 20
        sb.commands.run("rm /tmp/fill")
        r = sb.commands.run("dd if=/dev/zero of=/workspace/fill bs=1M count=64 2>&1")
        assert "No space left" in r.stdout
        # the allowed direction: writes within the limit work and reach the host
        assert sb.commands.run("rm /workspace/fill; head -c 1000000 /dev/zero > /workspace/ok").exit_code == 0
    assert (tmp_path / "ok").stat().st_size == 1_000_000
    assert not (tmp_path / "fill").exists()


def test_root_cannot_fill_dev_and_its_devices_and_mounts_still_work() -> None:
    """bwrap's /dev is a tmpfs with no size limit outside the disk: root wrote 15 x 16 MiB there in
    a 256 MiB sandbox, the OOM killer took the agent and every later call was SandboxClosed.  It is
    read-only now; its devices, terminals and /dev/shm (the disk's) are as before."""
    with Sandbox.create(memory="256M") as sb:
        r = sb.commands.run("head -c 1M /dev/zero > /dev/f1", user="root")
        assert r.exit_code != 0 and "Read-only file system" in r.stderr, r
        r = sb.commands.run("echo x > /dev/null && head -c 4 /dev/urandom | wc -c && echo hi > /dev/shm/x && "
                            "cat /dev/shm/x && ls /dev/pts", user="root")
        assert (r.exit_code, r.stdout) == (0, "4\nhi\nptmx\n"), r
        r = sb.commands.run(f"{PY} -c 'import os, pty; print(os.ttyname(pty.openpty()[1]))'")
        assert r.stdout.startswith("/dev/pts/"), r
        assert sb.commands.run("echo alive").stdout == "alive\n"


OPEN_FDS = (f"{PY} -c 'import os\nfds = []\nfor fd in range(3, 1024):\n    try:\n        os.fstat(fd)\n"
            "    except OSError:\n        continue\n    fds.append((fd, os.readlink(f\"/proc/self/fd/{fd}\")))\n"
            "print(fds)'")


@pytest.mark.parametrize("tier", ["process", "gvisor"])
def test_a_command_starts_with_its_stdio_and_no_other_descriptor(tier: str, state_dir: Path) -> None:
    """A command run by the agent's spare had the spare's sync pipe as fd 3 (dup2 drops
    close-on-exec), and a first command run before a spare had the sandbox's user namespace as
    fd 4 (from bwrap, by way of the agent)."""
    from .tier_probe import skip_unless_tier

    skip_unless_tier(tier, state_dir)
    for _ in range(2):
        with Sandbox.create(tier=tier) as sb:
            seen = [sb.commands.run(OPEN_FDS).stdout for _ in range(3)]
            seen.append(sb.commands.run(OPEN_FDS, background=True).wait().stdout)
            seen.append(sb.commands.run(OPEN_FDS, user="root").stdout)
            assert seen == ["[]\n"] * 5, seen


FILL_FILES = f"""{PY} -c '
import os
n = 0
try:
    while n < 200000:
        with open(f"/tmp/f{{n}}", "wb") as f:
            f.write(bytes(4096))
        n += 1
except OSError as e:
    print(n, os.strerror(e.errno))
'"""


def test_files_that_would_fill_the_sandboxs_memory_fail_with_enospc_and_the_sandbox_goes_on(tmp_path: Path) -> None:
    """The disk tmpfs is charged to the sandbox's memory: with ``disk`` (1 GiB) over ``memory``
    (64 MiB), files once filled the memory, the OOM killer then took the agent and every later
    command, and the sandbox was gone.  Now the disk stops short of the memory (ENOSPC), a
    command that allocates past it is the one killed, and the sandbox goes on, every time."""
    with Sandbox.create(memory="64M", disk="1G", workspace=str(tmp_path)) as sb:
        size_kib = int(sb.commands.run("df -k --output=size /tmp | tail -1").stdout)
        assert 16 << 10 < size_kib < 64 << 10
        for _ in range(3):
            r = sb.commands.run("head -c 200M /dev/zero > /workspace/big")
            assert r.exit_code == 1 and "No space left" in r.stderr and not r.oom_killed
            r = sb.commands.run(FILL_FILES)  # ~1 KiB of kernel memory per file besides its page
            assert r.exit_code == 0 and "No space left" in r.stdout, r
            r = sb.commands.run(f"{PY} -c 'x = bytearray(100 << 20); print(len(x))'")
            assert r.exit_code == 137 and r.oom_killed
            assert sb.commands.run("echo alive").stdout == "alive\n"
            # the allowed direction: what fits is written and reaches the host
            r = sb.commands.run("rm -rf /workspace/big /tmp/f*; head -c 1000000 /dev/zero > /workspace/ok")
            assert r.exit_code == 0, r
            assert (tmp_path / "ok").stat().st_size == 1_000_000 and not (tmp_path / "big").exists()


def test_concurrent_sandboxes_cannot_see_each_other() -> None:
    with Sandbox.create() as a, Sandbox.create() as b:
        a.files.write("/tmp/a-only", "secret of a")
        a.commands.run(f"nohup {PY} -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 &")
        a.commands.run(f"{PY} -c \"import socket,time\nfor _ in range(50):\n try: socket.create_connection(('127.0.0.1',8765),0.2); break\n except OSError: time.sleep(0.1)\"")
        assert a.commands.run(f"{PY} -c \"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:8765/').status)\"").stdout.strip() == "200"
        assert not b.files.exists("/tmp/a-only")
        assert "http.server" not in b.commands.run("ps -eo args").stdout
        r = b.commands.run(f"{PY} -c \"import socket; socket.create_connection(('127.0.0.1', 8765), 1)\"")
        assert r.exit_code != 0 and "ConnectionRefused" in r.stderr


def test_symlinks_planted_by_the_sandbox_never_reach_host_files(tmp_path: Path) -> None:
    host_secret = tmp_path / "outside-secret"
    host_secret.write_text("HOST-ONLY")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    with Sandbox.create(workspace=str(workspace)) as sb:
        sb.commands.run(f"ln -s {host_secret} /workspace/link; ln -s /etc/passwd /workspace/abs; ln -s ../x /workspace/up;"
                        " mkdir -p /workspace/d && ln -s /root /workspace/d/r && ln -s sibling /workspace/rel")
        with pytest.raises(Exception) as info:
            sb.files.read("link")
        assert "HOST-ONLY" not in str(info.value)
        # a write through a planted link lands inside the sandbox, if anywhere
        sb.commands.run("rm /workspace/link; ln -s /tmp/target /workspace/link")
        sb.files.write("link", "through the link")
        assert sb.commands.run("cat /tmp/target").stdout == "through the link"
    assert host_secret.read_text() == "HOST-ONLY"
    # only links that stay inside the workspace are written back
    assert (workspace / "rel").is_symlink()
    for escaping in ("abs", "up", "d/r", "link"):
        assert not (workspace / escaping).is_symlink(), escaping


def test_cow_workspace_keeps_changes_inside(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("original")
    with Sandbox.create(workspace=f"{tmp_path}:cow") as sb:
        sb.commands.run("echo changed > /workspace/keep.txt; echo new > /workspace/new.txt")
        assert sb.files.read("keep.txt") == "changed\n"
    assert (tmp_path / "keep.txt").read_text() == "original"
    assert not (tmp_path / "new.txt").exists()


def test_ro_workspace_is_read_only(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("data")
    with Sandbox.create(workspace=f"{tmp_path}:ro") as sb:
        assert sb.commands.run("cat /workspace/f.txt").stdout == "data"
        r = sb.commands.run("echo x > /workspace/f.txt")
        assert r.exit_code != 0 and "Read-only" in r.stderr
    assert (tmp_path / "f.txt").read_text() == "data"


def test_workspace_deletions_and_new_dirs_are_written_back(tmp_path: Path) -> None:
    (tmp_path / "gone.txt").write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "old.txt").write_text("x")
    with Sandbox.create(workspace=str(tmp_path)) as sb:
        sb.commands.run("rm /workspace/gone.txt; rm -r /workspace/sub; mkdir -p /workspace/a/b; echo hi > /workspace/a/b/c")
    assert not (tmp_path / "gone.txt").exists()
    assert not (tmp_path / "sub").exists()
    assert (tmp_path / "a" / "b" / "c").read_text() == "hi\n"
    assert (tmp_path / "a" / "b" / "c").stat().st_uid == tmp_path.stat().st_uid


def test_output_over_the_cap_is_cut_and_flagged() -> None:
    with Sandbox.create(max_output="64K") as sb:
        r = sb.commands.run("head -c 1000000 /dev/zero | tr '\\0' x")
        assert r.truncated and len(r.stdout) == 64 * 1024 and r.exit_code == 0


def test_stdin_reaches_the_command(sandbox: Sandbox) -> None:
    assert sandbox.commands.run("wc -c", stdin=b"x" * 300_000).stdout.strip() == "300000"


def test_a_command_run_without_input_sees_end_of_file_at_once(sandbox: Sandbox) -> None:
    # the end of file travels with the command (one frame after it, one write); a started
    # command keeps its stdin open until closed, and a second close is harmless
    for _ in range(3):  # in a spare, and in the next one (placed while the previous command ran)
        r = sandbox.commands.run("cat; echo end", timeout=10)
        assert (r.stdout, r.exit_code, r.timed_out) == ("end\n", 0, False)
    handle = sandbox.commands.start("cat", timeout=10)
    handle.send_stdin("kept\n")
    handle.close_stdin()
    handle.close_stdin()
    assert handle.wait().stdout == "kept\n"


def test_missing_program_and_bad_cwd(sandbox: Sandbox) -> None:
    r = sandbox.commands.run(["no-such-program"])
    assert r.exit_code == 127 and "cannot execute" in r.stderr
    r = sandbox.commands.run("pwd", cwd="/nonexistent")
    assert r.exit_code == 126 and "working directory" in r.stderr
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_cpu_quota_limits_cpu_time() -> None:
    # only the spinning counts: the interpreter's start-up CPU is not (0.5-0.9 s under
    # the microVM guest's TCG, where test_cgroup_v2_guest.py runs this test too)
    burn = (
        "import os, threading, time\n"
        "t0 = os.times(); t0 = t0.user + t0.system\n"
        "def spin():\n"
        "    end = time.monotonic() + 1.5\n"
        "    while time.monotonic() < end: pass\n"
        "ts = [threading.Thread(target=spin) for _ in range(2)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "t = os.times(); print(t.user + t.system - t0)\n"
    )
    with Sandbox.create(cpus=0.2) as sb:
        used = float(sb.commands.run([PY, "-c", burn]).stdout)
    # two spinning threads for 1.5 s would use ~3 s of CPU unthrottled (or ~1.5 s on one
    # free core or the guest's one vCPU); a 0.2-core quota allows ~0.3 s
    assert used < 0.8, used


def test_launcher_drops_to_the_sandbox_uid_and_refuses_root(state_dir: Path) -> None:
    from corral.registry import state_dir as prepare_state_dir
    from corral.tiers.linux.agent_build import agent_binary

    agent = str(agent_binary(prepare_state_dir(state_dir)))
    ok = subprocess.run([agent, "--launch", "2100000123", "-", "--", "/usr/bin/id"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.split() == ["uid=2100000123", "gid=2100000123", "groups=2100000123"]
    for bad in (["0", "-", "--", "/usr/bin/id"], ["12x", "-", "--", "/usr/bin/id"], ["5", "-", "--", "id"],
                ["5", "/nonexistent-netns", "--", "/usr/bin/id"]):
        r = subprocess.run([agent, "--launch", *bad], capture_output=True, text=True)
        assert r.returncode == 125, bad


def test_a_sandbox_cannot_make_the_hosts_git_run_its_program_and_its_commits_come_back(tmp_path: Path) -> None:
    repo, marker = tmp_path / "repo", tmp_path / "ran-on-the-host"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.txt").write_text("one\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    with Sandbox.create(workspace=str(repo)) as sb:
        r = sb.commands.run(
            f"cd /workspace && git config core.fsmonitor 'touch {marker}; false' && git config alias.st '!touch {marker}'"
            f" && printf '#!/bin/sh\\ntouch {marker}\\n' > .git/hooks/post-checkout && chmod +x .git/hooks/post-checkout"
            " && echo two >> a.txt && git -c user.name=agent -c user.email=a@a commit -qam second && git log --format=%s")
        assert r.exit_code == 0 and r.stdout == "second\nfirst\n", r
    # the host's git, as its user would run it after the task
    log = subprocess.run([*git, "log", "--format=%s"], capture_output=True, text=True, check=True).stdout
    assert log == "second\nfirst\n"  # the sandbox's commit is there
    subprocess.run([*git, "status", "--short"], capture_output=True, check=True)
    subprocess.run([*git, "checkout", "-qb", "review"], capture_output=True, check=True)
    assert not marker.exists(), "the sandbox's git configuration or hook ran on the host"
    assert "fsmonitor" not in (repo / ".git" / "config").read_text()


@pytest.mark.parametrize("layout", [".git", "separate git directory"])
def test_a_sandbox_cannot_leave_the_host_a_rebase_whose_todo_it_wrote(tmp_path: Path, layout: str) -> None:
    """A rebase left in progress (``.git/rebase-merge/``, neither configuration nor a hook) was
    written back with its to-do list: the host's ``git status`` said "interactive rebase in
    progress", and the owner's ``git rebase --continue`` ran the sandbox's ``exec`` line as root;
    so did one in a git directory not named ``.git`` (``git init --separate-git-dir``, a ``.git``
    file saying ``gitdir: ../gitdata``).  A git directory's operations in progress and its
    ``objects/info/alternates`` stay as the host has them (a submodule's too, and wherever a
    ``HEAD`` is beside them); the sandbox's commits and branches come back."""
    workspace, marker = tmp_path / "ws", tmp_path / "ran-on-the-host"
    repo = workspace / "repo" if layout != ".git" else workspace
    repo.mkdir(parents=True)
    gitdir = workspace / "gitdata" if layout != ".git" else repo / ".git"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    if layout == ".git":
        subprocess.run([*git, "init", "-q"], check=True)
    else:
        subprocess.run([*git, "init", "-q", f"--separate-git-dir={gitdir}"], check=True)
        (repo / ".git").write_text("gitdir: ../gitdata\n")
    for i in range(3):
        (repo / f"f{i}").write_text(f"{i}\n")
        subprocess.run([*git, "add", "."], check=True)
        subprocess.run([*git, "commit", "-qm", f"c{i}"], check=True)
    inside = "/workspace" if layout == ".git" else "/workspace/repo"
    inner_git = ".git" if layout == ".git" else "../gitdata"
    with Sandbox.create(workspace=str(workspace)) as sb:
        sb.files.write("/tmp/editor", f"#!/bin/sh\nprintf 'break\\nexec touch {marker}\\n' >> \"$1\"\n")
        r = sb.commands.run(
            f"cd {inside} && export GIT_AUTHOR_NAME=a GIT_AUTHOR_EMAIL=a@a GIT_COMMITTER_NAME=a GIT_COMMITTER_EMAIL=a@a"
            f" && git branch agent-work && chmod +x /tmp/editor && g={inner_git}"
            " && mkdir -p $g/modules/sub/rebase-apply $g/sequencer && echo x > $g/modules/sub/rebase-apply/next"
            " && echo /etc > $g/sequencer/todo && echo /root/other/.git/objects > $g/objects/info/alternates"
            " && GIT_SEQUENCE_EDITOR=/tmp/editor git rebase -i HEAD~1 && ls $g/rebase-merge")
        assert r.exit_code == 0 and "git-rebase-todo" in r.stdout, r
    assert not (gitdir / "rebase-merge").exists()
    # (a submodule's, in .git/modules/: a separate git directory's modules/sub has no HEAD here)
    for kept in ("sequencer", "objects/info/alternates", *(["modules/sub/rebase-apply"] if layout == ".git" else [])):
        assert not (gitdir / kept).exists(), kept
    status = subprocess.run([*git, "status"], capture_output=True, text=True, check=True).stdout
    assert "rebase" not in status, status
    subprocess.run([*git, "rebase", "--continue"], capture_output=True)
    assert not marker.exists(), "the sandbox's rebase exec line ran on the host"
    branches = subprocess.run([*git, "branch", "--format=%(refname:short)"], capture_output=True, text=True).stdout
    assert "agent-work" in branches.split(), branches


def test_a_sandbox_cannot_give_the_host_a_git_directory_of_its_own_making(tmp_path: Path) -> None:
    """Write-back held back only `.git`'s configuration and hooks, so a sandbox laid out a bare
    repository (HEAD, objects/, refs/, config with core.fsmonitor) anywhere else: the host's git
    took `sub/` for a repository, and the workspace itself before the enclosing repository's
    `.git`, and ran the sandbox's program at `git status` (as the workspace's owner: here root).
    Each way of laying one out, at once or a piece per command in either order, is held; a HEAD,
    a config file or a hooks/ directory alone, and the sandbox's commits and branches, come back."""
    outer, marker = tmp_path / "outer", tmp_path / "ran-on-the-host"
    workspace = outer / "pkg"
    workspace.mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "-C", str(outer), "init", "-q"], check=True)
    (workspace / "a.txt").write_text("one\n")
    subprocess.run([*git, "-C", str(outer), "add", "pkg/a.txt"], check=True)
    subprocess.run([*git, "-C", str(outer), "commit", "-qm", "first"], check=True)
    fsmonitor = f"git config core.fsmonitor 'touch {marker}; false #'"
    bare = "git init -q --bare {0} && git -C {0} config core.bare false && git -C {0} config core.worktree . && (cd {0} && " + fsmonitor + ")"
    with Sandbox.create(workspace=str(workspace)) as sb:
        def run(command: str) -> None:
            r = sb.commands.run(f"cd /workspace && {command}")
            assert r.exit_code == 0, r

        run(bare.format("sub"))  # the whole layout in one command
        run(bare.format("."))  # the workspace itself, inside the host's repository
        run(f"mkdir cfg_first && printf '[core]\\n\\tfsmonitor = touch {marker}; false #\\n' > cfg_first/config")
        run("mkdir cfg_first/objects cfg_first/refs && echo 'ref: refs/heads/main' > cfg_first/HEAD")
        run("mkdir head_first head_first/objects head_first/refs && echo 'ref: refs/heads/main' > head_first/HEAD")
        run(f"printf '[core]\\n\\tfsmonitor = touch {marker}; false #\\n' > head_first/config"
            f" && mkdir head_first/hooks && printf '#!/bin/sh\\ntouch {marker}\\n' > head_first/hooks/post-checkout")
        # alternates (another repository's objects, copied in by the host's next gc) either way round
        run("mkdir -p alt_first/objects/info alt_first/refs && echo /root/o/.git/objects > alt_first/objects/info/alternates")
        run("echo 'ref: refs/heads/main' > alt_first/HEAD")
        run("mkdir -p alt_head/objects/info alt_head/refs && echo 'ref: refs/heads/main' > alt_head/HEAD")
        run("echo /root/o/.git/objects > alt_head/objects/info/alternates")
        # what is no git directory comes back: a lone HEAD, a config file, a project's hooks/
        run("mkdir -p notes src/hooks app && echo x > notes/HEAD && echo 'debug = 1' > app/config"
            " && echo 'export {}' > src/hooks/useThing.js")
    for where in (workspace / "sub", workspace, workspace / "cfg_first", workspace / "head_first"):
        subprocess.run(["git", "status", "--short"], cwd=where, capture_output=True)
        subprocess.run(["git", "log", "-1"], cwd=where, capture_output=True)
    assert not marker.exists(), "the host's git ran a program the sandbox wrote"
    for held in ("sub/config", "sub/hooks", "config", "hooks", "cfg_first/HEAD", "head_first/config",
                 "head_first/hooks", "alt_first/HEAD", "alt_head/objects/info/alternates"):
        assert not (workspace / held).exists(), held
    assert (workspace / "sub" / "objects").is_dir() and (workspace / "head_first" / "HEAD").is_file()
    assert (workspace / "cfg_first" / "config").is_file()  # a config without a HEAD beside it is no git's
    assert (workspace / "notes/HEAD").read_text() == "x\n" and (workspace / "app/config").read_text() == "debug = 1\n"
    assert (workspace / "src/hooks/useThing.js").is_file()
    # the enclosing repository is the host's git's own again: the sandbox's file shows as untracked
    status = subprocess.run(["git", "status", "--short", "--untracked-files=all", "."], cwd=workspace,
                            capture_output=True, text=True, check=True).stdout
    assert "notes/HEAD" in status, status


@pytest.mark.parametrize("overlay", [True, False], ids=["overlay", "copy"])
def test_a_sandbox_cannot_delete_the_hosts_git_configuration_or_hooks(
        tmp_path: Path, overlay: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Write-back held back the sandbox's changes to a git directory's configuration and hooks,
    but not their deletion: `rm .git/hooks/pre-commit` took away a protective hook (a secret
    scanner) before the user's next commit, and `rm .git/config` the user's remotes; `rm -rf .git
    && git init` did both.  Now they stay as the host has them; the rest of a deletion comes back."""
    from corral.host import ws_overlay

    monkeypatch.setattr(ws_overlay, "ENABLED", overlay)
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "-C", str(repo), "init", "-q"], check=True)
    subprocess.run(["git", "-C", str(repo), "remote", "add", "origin", "https://example.test/r.git"], check=True)
    hook = repo / ".git" / "hooks" / "pre-commit"
    hook.write_text("#!/bin/sh\nexec scan-for-secrets\n")
    (repo / "gone.txt").write_text("x")
    config = (repo / ".git" / "config").read_text()
    with Sandbox.create(workspace=str(repo)) as sb:
        r = sb.commands.run("cd /workspace && rm .git/hooks/pre-commit .git/config gone.txt")
        assert r.exit_code == 0, r
        assert hook.read_text() == "#!/bin/sh\nexec scan-for-secrets\n" and (repo / ".git/config").read_text() == config
        assert not (repo / "gone.txt").exists()
        r = sb.commands.run("cd /workspace && rm -rf .git && git init -q && echo new > n.txt")
        assert r.exit_code == 0, r
    assert hook.read_text() == "#!/bin/sh\nexec scan-for-secrets\n"
    assert (repo / ".git/config").read_text() == config
    assert (repo / "n.txt").read_text() == "new\n" and (repo / ".git" / "HEAD").is_file()


@pytest.mark.parametrize("overlay", [True, False], ids=["overlay", "copy"])
def test_a_sandbox_cannot_write_what_the_hosts_git_configuration_names_in_the_worktree(
        tmp_path: Path, overlay: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repository's configuration may point into its worktree: ``include.path = ../.gitconfig``
    (shared settings) and husky's ``core.hooksPath = .husky/_``.  A sandbox wrote ``.gitconfig``
    with a ``core.fsmonitor`` and the hook: the owner's next ``git status`` and ``git commit`` ran
    both, as root; so did a ``core.fsmonitor`` naming the project's script and a project's own
    repository's hook (helper 94), and a script by its bare name, also after a ``rm .git/HEAD``
    had made the repository vanish from a reading (helpers 96, 97).  What the configuration names
    stays as the host has it (and the directory on the way to it); the rest of the sandbox's work
    comes back, a directory an alias names too."""
    from corral.host import ws_overlay

    monkeypatch.setattr(ws_overlay, "ENABLED", overlay)
    repo = tmp_path / "repo"
    (repo / ".husky" / "_").mkdir(parents=True)
    (repo / "conf").mkdir()
    git = ["git", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "config", "include.path", "../.gitconfig"], check=True)
    subprocess.run([*git, "config", "includeIf.onbranch:main.path", "../conf/branch.inc"], check=True)
    subprocess.run([*git, "config", "core.hooksPath", ".husky/_"], check=True)
    subprocess.run([*git, "config", "core.fsmonitor", "tools/fsmonitor.sh"], check=True)  # a project's script
    subprocess.run([*git, "config", "diff.json.textconv", "python3 conv.py"], check=True)  # one by its bare name
    subprocess.run([*git, "config", "core.pager", "sh pager"], check=True)  # a script the sandbox may make
    subprocess.run([*git, "config", "alias.t", "!pytest tests/"], check=True)  # the project's, run when asked
    (repo / "tests").mkdir()
    (repo / "tests" / "test_app.py").write_text("def test(): pass\n")
    (repo / "conv.py").write_text("print('conv')\n")
    (repo / "tools").mkdir()
    (repo / "tools" / "fsmonitor.sh").write_text("#!/bin/sh\nexit 1\n")
    (repo / "tools" / "fsmonitor.sh").chmod(0o755)
    (repo / "inner" / ".husky").mkdir(parents=True)  # a project of its own in the workspace
    subprocess.run(["git", "-C", str(repo / "inner"), "init", "-q"], check=True)
    subprocess.run(["git", "-C", str(repo / "inner"), "config", "core.hooksPath", ".husky"], check=True)
    (repo / ".husky" / "_" / "pre-commit").write_text('#!/bin/sh\n. "$(dirname "$0")/h"\n')
    (repo / ".husky" / "pre-commit").write_text("npm test\n")
    (repo / "conf" / "branch.inc").write_text("[user]\n\tname = me\n")
    ran = tmp_path / "ran"
    subprocess.run(["chown", "-R", "1000:1000", str(repo)], check=True)  # a login user's (root's git: "dubious")
    with Sandbox.create(workspace=str(repo)) as sb:
        r = sb.commands.run(
            f"cd /workspace && printf '[core]\\n\\tfsmonitor = \"touch {ran}; false\"\\n' > .gitconfig"
            f" && printf '#!/bin/sh\\ntouch {ran}\\n' > .husky/_/pre-commit && echo 'touch {ran}' > .husky/pre-commit"
            " && echo '[core]' > conf/branch.inc && echo kept > conf/notes.txt && echo mine > work.txt"
            f" && printf '#!/bin/sh\\ntouch {ran}\\n' | tee tools/fsmonitor.sh inner/.husky/pre-commit"
            " && echo 'import os' > conv.py && echo 'touch /tmp/x' > pager && echo 'def test(): 1' > tests/test_app.py")
        assert r.exit_code == 0, r
        r = sb.commands.run("cd /workspace && rm -rf conf .husky && ln -s /tmp conf && mkdir .husky")
        assert r.exit_code == 0, r
        # a repository without a HEAD is none to git: a reading then names nothing of it (helper 97)
        assert sb.commands.run("cd /workspace && mv .git/HEAD /tmp/HEAD").exit_code == 0
        r = sb.commands.run(f"cd /workspace && printf '#!/bin/sh\\ntouch {ran}\\n' > tools/fsmonitor.sh"
                            " && mv /tmp/HEAD .git/HEAD")
        assert r.exit_code == 0, r
    assert not (repo / ".gitconfig").exists()
    assert (repo / ".husky" / "_" / "pre-commit").read_text() == '#!/bin/sh\n. "$(dirname "$0")/h"\n'
    assert (repo / ".husky" / "pre-commit").read_text() == "npm test\n"
    assert (repo / "conf").is_dir() and not (repo / "conf").is_symlink()
    assert (repo / "conf" / "branch.inc").read_text() == "[user]\n\tname = me\n"
    assert (repo / "tools" / "fsmonitor.sh").read_text() == "#!/bin/sh\nexit 1\n"
    assert (repo / "conv.py").read_text() == "print('conv')\n" and not (repo / "pager").exists()
    # what is the project's own comes back, though the configuration mentions it (helper 97)
    assert (repo / "tests" / "test_app.py").read_text() == "def test(): 1\n"
    from corral.host import git_reach

    # the owner's home's configuration is read too, not only this process's (helper 96)
    owner = next((user for user in pwd.getpwall() if user.pw_uid == 1000), None)
    if owner is not None:
        assert Path(owner.pw_dir) in git_reach._homes(repo)
    assert Path(os.environ.get("HOME") or "/root") in git_reach._homes(repo)
    assert not (repo / "inner" / ".husky" / "pre-commit").exists()
    assert (repo / "work.txt").read_text() == "mine\n"  # the allowed case: the sandbox's work comes back
    assert not (repo / "conf" / "notes.txt").exists()  # (written, then removed with conf/ by the sandbox)
    status = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(repo), "status", "--short"],
                            capture_output=True, text=True)
    assert status.returncode == 0 and not ran.exists(), status


#: another host user, owner of files in a root-owned workspace
OTHER_USER = 4343


@pytest.mark.parametrize("overlay", [True, False], ids=["overlay", "copy"])
def test_other_users_files_are_readable_as_their_mode_allows_and_never_changed(
        tmp_path: Path, overlay: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copied workspace (microVM, wasm; process and gVisor where the directory cannot be
    idmapped) was the sandbox user's whole: the sandbox read another user's 0600 files, and its
    ``rm`` and ``echo >`` deleted and replaced them on the host (helper rt107).  As in the overlay,
    another user's file is readable as its others' bits allow (not its group's, even the
    directory's group), and write-back leaves it, and what is in its directories, as the host
    has it; the owner's files come back changed."""
    from corral.host import ws_overlay

    monkeypatch.setattr(ws_overlay, "ENABLED", overlay)
    ws = tmp_path / "ws"  # root's, as the project directory of the red team's report
    ws.mkdir()
    dir_gid = ws.stat().st_gid

    def theirs(rel: str, mode: int, text: str | None = None, gid: int = OTHER_USER) -> None:
        path = ws / rel
        path.mkdir() if text is None else path.write_text(text)
        os.chown(path, OTHER_USER, gid)
        os.chmod(path, mode)

    theirs("secret", 0o600, "BOB-PRIVATE\n")
    theirs("public", 0o644, "bob public\n")
    theirs("team", 0o640, "team\n", gid=dir_gid)  # the overlay lets no group read it: not even the directory's
    theirs("closed", 0o700)
    theirs("closed/key", 0o600, "BOB-KEY\n")
    theirs("open", 0o755)
    theirs("open/pub", 0o644, "pub\n")
    theirs("open/priv", 0o600, "priv\n")
    (ws / "mine.txt").write_text("mine\n")
    before = {str(p.relative_to(ws)): (p.lstat(), p.read_text() if p.is_file() else None)
              for p in ws.rglob("*") if p.name != "mine.txt"}
    with Sandbox.create(workspace=str(ws)) as sb:
        for user in ("user", "root"):
            read = sb.commands.run("cd /workspace && cat public open/pub", user=user)
            assert read.exit_code == 0 and read.stdout == "bob public\npub\n", (user, read)
            for private in ("secret", "team", "closed/key", "open/priv"):
                r = sb.commands.run(f"cat /workspace/{private}", user=user)
                assert r.exit_code != 0 and r.stdout == "", (user, private, r)
        for user in ("user", "root"):
            # their files changed, replaced, deleted, and written in their directories: what the
            # overlay refuses, the copy does inside (root overrides its copy), never on the host
            sb.commands.run("cd /workspace; echo EDIT > public; echo EDIT >> team; rm -f secret team;"
                            " mkdir -p open/sub closed; echo x > open/sub/f; echo x > closed/key; echo x > open/new;"
                            " rm -rf open/pub open/priv; chmod 777 open", user=user)
        ok = sb.commands.run("cd /workspace && echo more >> mine.txt && echo new > new.txt")
        assert ok.exit_code == 0, ok
    assert (ws / "mine.txt").read_text() == "mine\nmore\n" and (ws / "new.txt").read_text() == "new\n"
    after = {str(p.relative_to(ws)): (p.lstat(), p.read_text() if p.is_file() else None)
             for p in ws.rglob("*") if p.name not in ("mine.txt", "new.txt")}
    assert after.keys() == before.keys()
    for rel, (st, text) in before.items():
        now, now_text = after[rel]
        assert (now.st_ino, now.st_uid, now.st_gid, now.st_mode, now_text) == (
            st.st_ino, st.st_uid, st.st_gid, st.st_mode, text), rel


#: the workspace's owner and another host user (the red team's A and B)
WORKSPACE_OWNER, ANOTHER_USER = 41170, 41180


def _copied_texts(host: Path, copy: Path) -> dict[str, str]:
    """Copy ``host`` in as a copy-mode create does; its files' texts by path below the copy."""
    from corral.host.ws_copy import WorkspaceCopy

    shutil.rmtree(copy, ignore_errors=True)
    made = WorkspaceCopy.create(host, copy, 1000, 1000, 1 << 30)
    made.close(write_back=False)
    return {str(p.relative_to(copy)): p.read_text() for p in copy.rglob("*") if p.is_file()}


@pytest.mark.parametrize("swapped", ["dir", "file"])
def test_a_name_swapped_while_copying_in_copies_only_what_the_owners_view_shows(tmp_path: Path, swapped: str) -> None:
    """A copied workspace judged another user's entries by their names and then opened the names
    again: the workspace's owner, swapping (``renameat2(RENAME_EXCHANGE)``) their own directory
    with another user's 0700 one holding a 0644 file, or their 0644 file with the other's 0600
    one, got that user's secret copied into the sandbox (red team rt117: 2 of 10 and 2 of 12
    creates; here 136 and 77 of 200 copies).  Now what is opened is judged: B's secret is never
    copied, while the owner's files, and B's that anyone may read, still are."""
    import ctypes
    import threading

    if os.uname().machine != "x86_64":
        pytest.skip("the swap uses x86_64's renameat2 number")
    host, copy = tmp_path / "ws", tmp_path / "copy"
    host.mkdir()
    layout = {  # path: (owner, mode, text or None for a directory)
        "": (WORKSPACE_OWNER, 0o755, None),
        "mine": (WORKSPACE_OWNER, 0o755, None), "mine/f": (WORKSPACE_OWNER, 0o644, "A's\n"),
        "mine/sub": (WORKSPACE_OWNER, 0o755, None), "mine/sub/f": (WORKSPACE_OWNER, 0o644, "A's deeper\n"),
        "own": (WORKSPACE_OWNER, 0o644, "A's\n"), "own-private": (WORKSPACE_OWNER, 0o600, "A's own 0600\n"),
        "theirs": (ANOTHER_USER, 0o700, None), "theirs/f": (ANOTHER_USER, 0o644, "B-SECRET in 0700\n"),
        "theirs/sub": (ANOTHER_USER, 0o755, None), "theirs/sub/f": (ANOTHER_USER, 0o644, "B-SECRET deeper\n"),
        "their-private": (ANOTHER_USER, 0o600, "B-SECRET 0600\n"),
        "their-public": (ANOTHER_USER, 0o644, "B's public\n"),
        "their-open": (ANOTHER_USER, 0o755, None), "their-open/f": (ANOTHER_USER, 0o644, "B's public too\n"),
    }
    for rel, (uid, mode, text) in layout.items():
        path = host / rel
        if rel and text is None:
            path.mkdir()
        elif text is not None:
            path.write_text(text)
        os.chown(path, uid, uid)
        os.chmod(path, mode)
    # the allowed direction, unraced: the owner's files, 0600 too, and B's that anyone may read
    assert _copied_texts(host, copy) == {
        "mine/f": "A's\n", "mine/sub/f": "A's deeper\n", "own": "A's\n", "own-private": "A's own 0600\n",
        "their-public": "B's public\n", "their-open/f": "B's public too\n"}
    pair = (b"mine", b"theirs") if swapped == "dir" else (b"own", b"their-private")
    # where the owner's swapped file is copied to, under whichever name it had then
    owners_swapped = ("mine/f", "theirs/f") if swapped == "dir" else ("own", "their-private")
    libc = ctypes.CDLL(None, use_errno=True)
    stop = threading.Event()

    def swap_names() -> None:  # what the owner of ``host`` may do: it is their directory
        dir_fd = os.open(host, os.O_RDONLY | os.O_DIRECTORY)
        try:
            while not stop.is_set():
                libc.syscall(316, dir_fd, pair[0], dir_fd, pair[1], 2)  # SYS_renameat2, RENAME_EXCHANGE
        finally:
            os.close(dir_fd)

    swapper = threading.Thread(target=swap_names)
    swapper.start()
    leaked, owners_copied = 0, 0
    try:
        for _ in range(200):
            texts = _copied_texts(host, copy)
            leaked += any("B-SECRET" in text for text in texts.values())
            owners_copied += any(texts.get(name) == "A's\n" for name in owners_swapped)
    finally:
        stop.set()
        swapper.join()
    assert leaked == 0, f"B's secret copied in {leaked} of 200 copies"
    # the race does not just leave everything out: the owner's swapped file is copied (85 to 193 of 200 measured)
    assert owners_copied > 20, owners_copied


def test_a_workspace_inside_a_repository_keeps_what_the_repositorys_configuration_names(tmp_path: Path) -> None:
    """A workspace that is a package of a larger repository: git names the repository's own
    configuration from the top of its worktree, which was read as the workspace's, so the file
    ``include.path`` names was held at the wrong place and the sandbox's ``core.fsmonitor`` in it
    ran at the owner's ``git status`` (helper 94)."""
    repo = tmp_path / "mono"
    (repo / "frontend").mkdir(parents=True)
    subprocess.run(["git", "-C", str(repo), "init", "-q"], check=True)
    subprocess.run(["git", "-C", str(repo), "config", "include.path", "../frontend/.gitconfig"], check=True)
    ran = tmp_path / "ran"
    with Sandbox.create(workspace=str(repo / "frontend")) as sb:
        r = sb.commands.run(f"cd /workspace && printf '[core]\\n\\tfsmonitor = \"touch {ran}; false\"\\n' > .gitconfig"
                            " && echo mine > app.js")
        assert r.exit_code == 0, r
    assert not (repo / "frontend" / ".gitconfig").exists() and (repo / "frontend" / "app.js").read_text() == "mine\n"
    subprocess.run(["git", "-C", str(repo), "status", "--short"], capture_output=True, check=True)
    assert not ran.exists()


def test_a_workspace_is_a_project_not_the_hosts_system_or_corrals_own(
        tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--workspace /` (or /etc, /usr, every home) was taken: the sandbox read the host's files as
    their owner (/etc/shadow) and rw wrote back into them (a file in /etc appeared, owned by root);
    a workspace holding Corral's state or image directory let a sandbox change other sandboxes'
    records and images.  Each is refused before anything is made; a project's directory works."""
    from corral.errors import InvalidSpec

    before = cgroups.list_sandbox_groups()
    (state_dir / "ws-probe").mkdir(exist_ok=True)
    images = tmp_path / "proj" / "images"
    images.mkdir(parents=True)
    monkeypatch.setenv("CORRAL_IMAGE_DIR", str(images))
    for bad, said in (("/", "system"), ("/etc", "system"), ("/usr/local", "system"), ("/home", "system"),
                      ("/root", "system"), ("/var", "system"), ("/proc/self", "system"),
                      ("/var/lib/dpkg", "system"), ("/var/log", "system"), ("/var/spool", "system"),
                      (str(state_dir / "ws-probe"), "Corral's own"), (str(tmp_path / "proj"), "Corral's own")):
        with pytest.raises(InvalidSpec, match=said):
            Sandbox.create(workspace=bad)
    # the host's /etc bound elsewhere is still /etc, and so is /etc in a bind of / (the check by
    # path saw only the mount point: /srv/x/etc showed the sandbox /etc/shadow)
    # and so is a subtree of one bound anywhere (/etc/ssl at /srv/x: rw wrote into /etc/ssl)
    bound, root, ssl, dpkg = (tmp_path / name for name in ("looks-like-a-project", "rootbind", "ssl", "dpkg"))
    binds = ((bound, "/etc"), (root, "/"), (ssl, "/etc/ssl"), (dpkg, "/var/lib/dpkg"))
    for target, source in binds:
        target.mkdir()
        subprocess.run(["mount", "--bind", source, str(target)], check=True)
    try:
        for bad in (bound, bound / "cron.d", root / "etc", root / "var" / "lib" / "dpkg", root, ssl, ssl / "certs", dpkg):
            with pytest.raises(InvalidSpec, match="by another path"):
                Sandbox.create(workspace=f"{bad}:ro")
    finally:
        for target, _ in binds:
            subprocess.run(["umount", str(target)], check=True)
    assert cgroups.list_sandbox_groups() == before
    (tmp_path / "proj" / "src").mkdir()
    with Sandbox.create(workspace=str(tmp_path / "proj" / "src")) as sb:
        assert sb.commands.run("echo ok > /workspace/f && cat /workspace/f").stdout == "ok\n"
    assert (tmp_path / "proj" / "src" / "f").read_text() == "ok\n"


def test_another_corral_instances_state_or_images_are_no_workspace(tmp_path: Path) -> None:
    """Only this instance's state and image directories were refused: `--workspace
    /tmp/other-state:ro` listed another instance's registry.db, owners/, uids/ and images/, and rw
    would have written as root into its records and images.  Another instance's are known by their
    layout: a workspace that is one, lies in one or holds one among its entries is refused (deeper
    is not searched: every create would pay for it); a project that only looks
    a little like one (a `names/` or a `sandboxes/` directory) works."""
    from corral.errors import InvalidSpec
    from corral.images import store
    from corral.registry import Registry, state_dir

    other = tmp_path / "other"
    other_state = state_dir(other / "state")  # as another instance makes and uses it
    Registry(other_state).rows()
    (other_state / "uids").mkdir(mode=0o700)
    other_images = other / "deep" / "er" / "images"
    other_images.mkdir(parents=True)
    digest = "sha256:" + "0e" * 32
    store.set_name(other_images, "base", digest)
    with store.digest_lock(other_images, digest):
        (other_images / store.hex_of(digest) / "rootfs" / "etc").mkdir(parents=True)
    (other_images / store.hex_of(digest) / "image.json").write_text("{}")
    before = cgroups.list_sandbox_groups()
    for bad in (other_state, other_state / "sandboxes", other_state / "uids", other, other / "deep" / "er",
                other_images, other_images / "names", other_images / store.hex_of(digest) / "rootfs" / "etc"):
        for mode in ("ro", "rw"):
            with pytest.raises(InvalidSpec, match="Corral's own state or image"):
                Sandbox.create(workspace=f"{bad}:{mode}")
    assert cgroups.list_sandbox_groups() == before
    project = tmp_path / "project"
    for name in ("names", "sandboxes", "src/names", "src/sandboxes"):
        (project / name).mkdir(parents=True)
    (project / "registry.db").write_text("not a registry\n")
    with Sandbox.create(workspace=str(project)) as sb:
        assert sb.commands.run("ls /workspace && echo ok > /workspace/f").stdout == "names\nregistry.db\nsandboxes\nsrc\n"
    assert (project / "f").read_text() == "ok\n"


def test_a_workspace_never_shows_a_users_keys_or_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--workspace ~` was taken for any user but root: the sandbox read ``~/.ssh/id_rsa`` (the
    brief's own example of what a prompt injection steals), and rw wrote back into
    ``~/.ssh/authorized_keys`` and ``~/.bashrc`` (a login, code at the user's next shell).  A
    home directory, a directory holding one, a credential store and a directory holding ``.ssh`` or
    ``.gnupg`` are refused before anything is made; a project inside the home works."""
    from corral.errors import InvalidSpec

    home = tmp_path / "home" / "alice"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text("KEY\n")
    (home / ".aws" / "sso").mkdir(parents=True)
    (home / ".config" / "git").mkdir(parents=True)
    (home / ".local" / "bin").mkdir(parents=True)
    (tmp_path / "keys" / ".gnupg").mkdir(parents=True)
    (home / "proj").mkdir()
    monkeypatch.setenv("HOME", str(home))
    before = cgroups.list_sandbox_groups()
    for bad, said in ((home, "home directory"), (tmp_path / "home", "home directory"),
                      (home / ".ssh", "credential store"), (home / ".aws" / "sso", "credential store"),
                      (home / ".config", "dot-directories"), (home / ".local" / "bin", "dot-directories"),
                      (tmp_path / "keys", "holds .gnupg")):
        with pytest.raises(InvalidSpec, match=said):
            Sandbox.create(workspace=str(bad))
        with pytest.raises(InvalidSpec, match=said):
            Sandbox.create(workspace=f"{bad}:ro")
    with pytest.raises(InvalidSpec, match="home directory"):
        Sandbox.create(workspace="~")
    assert cgroups.list_sandbox_groups() == before
    with Sandbox.create(workspace="~/proj") as sb:
        assert sb.commands.run("echo ok > /workspace/f && cat /workspace/f").stdout == "ok\n"
        assert sb.commands.run("cat /workspace/../.ssh/id_rsa").exit_code != 0
    assert (home / "proj" / "f").read_text() == "ok\n"


def test_directory_modes_are_written_back(tmp_path: Path) -> None:
    """A directory the sandbox makes private stays private on the host: write-back made every
    directory 0755, so another host user read ``private/id_rsa``.  Set-group-id is not kept
    (as set-user/group-id bits of files are not), nor is writing by others: a sandbox made the
    user's `.git` and files 0777/0666 on the host, where any host user could then swap the
    repository's hooks or edit its scripts, to run as the user (root, often)."""
    (tmp_path / "existing").mkdir(mode=0o755)
    (tmp_path / ".git" / "hooks").mkdir(parents=True, mode=0o755)
    (tmp_path / "build.sh").write_text("echo built\n")
    with Sandbox.create(workspace=str(tmp_path)) as sb:
        r = sb.commands.run("cd /workspace && mkdir -m 700 private && echo KEY > private/id_rsa"
                            " && chmod 644 private/id_rsa && chmod 750 existing && mkdir -m 1777 sticky"
                            " && mkdir -m 2775 shared && chmod 777 .git && chmod 666 build.sh"
                            " && echo new > open.txt && chmod 662 open.txt")
        assert r.exit_code == 0, r
        assert sb.commands.run("stat -c %a /workspace/private").stdout == "700\n"
        sb.commands.run("chmod 711 /workspace/private")  # a later change of mode alone comes back too
    modes = {name: stat.S_IMODE((tmp_path / name).stat().st_mode)
             for name in ("private", "existing", "sticky", "shared", ".git", "build.sh", "open.txt")}
    assert modes == {"private": 0o711, "existing": 0o750, "sticky": 0o1775, "shared": 0o775, ".git": 0o775,
                     "build.sh": 0o664, "open.txt": 0o660}
    assert stat.S_IMODE((tmp_path / "private" / "id_rsa").stat().st_mode) == 0o644


@pytest.mark.parametrize("overlay", [True, False], ids=["overlay", "copy"])
def test_write_back_goes_to_the_directory_given_not_where_a_swapped_path_leads(
        overlay: bool, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Write-back opened the workspace by its path at every command: a host user owning a
    directory on the path swapped it for a link mid-session, and the next write-back, as root,
    wrote the sandbox's file into a root-only directory the link led to (``/etc``'s stand-in).
    Now it goes through the directory opened at create, wherever the path leads since."""
    from corral.host import ws_overlay

    monkeypatch.setattr(ws_overlay, "ENABLED", overlay)
    # a directory alice can reach (pytest's own are root's alone)
    tmp_path = Path(tempfile.mkdtemp(prefix="crl-swap-", dir="/tmp"))
    os.chmod(tmp_path, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    alice = tmp_path / "alice"
    workspace = alice / "work" / "cron.d"
    workspace.mkdir(parents=True)
    for owned in (alice, alice / "work", workspace):
        os.chown(owned, 4242, 4242)
    root_only = tmp_path / "rootonly" / "cron.d"
    root_only.mkdir(parents=True)
    with Sandbox.create(workspace=str(workspace)) as sb:
        swap = f"mv {alice}/work {alice}/work.old && ln -s {tmp_path}/rootonly {alice}/work"
        subprocess.run(["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "sh", "-c", swap], check=True)
        assert sb.commands.run("echo x > /workspace/planted").exit_code == 0
    assert list(root_only.iterdir()) == []
    assert (alice / "work.old" / "cron.d" / "planted").read_text() == "x\n"
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    assert str(alice / "work.old" / "cron.d") not in held  # the directory's descriptor went with it


@pytest.mark.parametrize("tier,overlay", [("process", True), ("process", False), ("gvisor", True), ("microvm", False)],
                         ids=["process-overlay", "process-copy", "gvisor", "microvm"])
def test_write_back_and_copy_in_never_cross_a_mount_inside_the_workspace(
        tier: str, overlay: bool, tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory (and a file) mounted inside the workspace is not the workspace's: a chroot's
    bound ``/etc``, a volume.  Write-back, as root, wrote the sandbox's files into it on every
    tier (a root-owned ``cron.d/evil``, a ``planted`` file, the 0640 ``shadow`` replaced by the
    sandbox's 0644 one), and the microVM's copy-in showed the sandbox its files (helper rt119).
    Now the sandbox sees an empty directory and an empty file there and what it does to them
    stays its own, deleting them too; its writes elsewhere in the workspace still come back."""
    from corral.host import ws_overlay

    from .tier_probe import skip_unless_tier

    if tier != "process":
        skip_unless_tier(tier, state_dir)
    monkeypatch.setattr(ws_overlay, "ENABLED", overlay)
    etc, secret, ws = tmp_path / "fake-etc", tmp_path / "secret", tmp_path / "project"
    (etc / "cron.d").mkdir(parents=True)
    (etc / "shadow").write_text("root:SECRET-HASH:1:0:99999:7:::\n")
    os.chmod(etc / "shadow", 0o640)
    (etc / "cron.d" / "job").write_text("job\n")
    secret.write_text("FILE-SECRET\n")
    os.chmod(secret, 0o600)
    (ws / "sub").mkdir(parents=True)
    (ws / "passwd").write_text("")
    (ws / "README").write_text("project\n")
    before = {path: (path.read_text(), path.stat()[:5]) for path in (etc / "shadow", etc / "cron.d" / "job", secret)}
    binds = ((etc, ws / "sub"), (secret, ws / "passwd"))
    mounted: list[Path] = []
    try:
        for source, target in binds:
            subprocess.run(["mount", "--bind", str(source), str(target)], check=True)
            mounted.append(target)
        with Sandbox.create(tier=tier, workspace=str(ws)) as sb:
            seen = sb.commands.run("cat /workspace/sub/shadow /workspace/sub/cron.d/job /workspace/passwd; "
                                   "ls -A /workspace/sub")
            assert "SECRET" not in seen.stdout and "job" not in seen.stdout, seen
            r = sb.commands.run("mkdir -p /workspace/sub/cron.d && echo evil > /workspace/sub/cron.d/evil"
                                " && echo x > /workspace/sub/planted && echo root::0:0::: > /workspace/sub/shadow"
                                " && echo new > /workspace/passwd && echo back > /workspace/README"
                                " && mkdir /workspace/mine && echo y > /workspace/mine/f")
            assert r.exit_code == 0, r
            assert (ws / "README").read_text() == "back\n"  # written back after that command
            assert sb.commands.run("rm -rf /workspace/sub /workspace/passwd").exit_code == 0
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", "-l", str(target)], check=True)
    assert sorted(str(p.relative_to(etc)) for p in etc.rglob("*")) == ["cron.d", "cron.d/job", "shadow"]
    assert {path: (path.read_text(), path.stat()[:5]) for path in before} == before
    assert (ws / "README").read_text() == "back\n" and (ws / "mine" / "f").read_text() == "y\n"
