"""What only the gVisor tier promises: gVisor's kernel answers the syscalls, no
part of the sandbox is host root, commands' trees die on timeout, network is
off, and neither a clean teardown nor an owner's kill -9 leaves runsc behind.

Cost: ~10 sandboxes at ~0.5 s each on a loaded 2-core machine, ~15 s in all.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral.errors import FileError, HostNotSupported, InvalidSpec, SandboxClosed
from corral.host import uids as host_uids
from corral.tiers.gvisor import GVisorTier
from corral.tiers.gvisor.memory import OVERHEAD, MiB
from corral.tiers.gvisor.platform import PLATFORM_ENV, choose_platform, runsc_binary

from .leaks import kill_9, run_gc, sandbox_leftovers, start_owner
from .leaks import processes_naming as _processes_naming
from .tier_probe import skip_unless_tier


@pytest.fixture(scope="module", autouse=True)
def _gvisor_available(state_dir: Path) -> None:
    skip_unless_tier("gvisor", state_dir)


@pytest.fixture
def sb() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(tier="gvisor", memory="256M")
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_syscalls_are_answered_by_gvisor_not_the_host_kernel(sb: Sandbox) -> None:
    uname = sb.commands.run(["uname", "-r"])
    assert uname.exit_code == 0
    assert uname.stdout.strip() != os.uname().release
    # gVisor's kernel log is its own boot banner, not the host's ring buffer
    dmesg = sb.commands.run(["dmesg"])
    assert "Starting gVisor" in dmesg.stdout, dmesg
    host_log = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
    assert "Starting gVisor" not in host_log
    assert os.uname().release not in sb.commands.run(["cat", "/proc/version"]).stdout


def test_no_part_of_the_sandbox_runs_as_host_root(sb: Sandbox) -> None:
    assert sb.commands.run(["id", "-u"]).stdout.strip() == "1000"
    pids = _processes_naming(sb.id)
    assert pids, "the Sentry and gofer carry the sandbox id on their command line"
    for pid in pids:
        uids = Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[:4]
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        if name == "runsc":
            continue  # the launcher itself exited after `run --detach`; only a zombie could be here
        assert "0" not in uids, f"{name} ({pid}) runs with a host root uid: {uids}"
    # what the sandbox writes belongs to its own unprivileged host uid
    sb.commands.run(["sh", "-c", "echo x > /workspace/owned"])
    run_dir = Path(os.environ["CORRAL_STATE_DIR"]) / "sandboxes" / sb.id
    owner = (run_dir / "disk" / "ws" / "owned").stat().st_uid
    assert owner not in (0, 1000) and host_uids.UID_BASE <= owner < host_uids.UID_TOP, owner
    # the image's files are not the sandbox's: writing them is denied, reading works
    denied = sb.commands.run(["sh", "-c", "echo x > /usr/bin/corral-test"])
    assert denied.exit_code != 0
    assert sb.commands.run(["sh", "-c", "echo ok > /tmp/f && cat /tmp/f"]).stdout == "ok\n"


def test_the_files_api_acts_as_the_sandboxs_user_not_as_root(sb: Sandbox) -> None:
    """gVisor has no setfsuid, and its agent, root, ran the files API as root: through a link the
    sandbox's user planted (/tmp/out -> /etc) the host's write reached /etc, and /etc/passwd and
    /usr/bin/ls were writable through it.  Now each file request runs as the user (as on the
    process and microVM tiers)."""
    planted = sb.commands.run("id -u; ln -s /etc /tmp/out")
    assert planted.stdout == "1000\n", planted.stderr
    for path in ("/tmp/out/profile.d/zz.sh", "/etc/passwd", "/usr/bin/ls"):
        with pytest.raises(FileError) as refused:
            sb.files.write(path, "echo injected\n")
        assert refused.value.errno == errno.EACCES, (path, refused.value)
    assert sb.commands.run("head -c 5 /etc/passwd; ls /etc/profile.d/zz.sh 2>&1 | wc -l").stdout == "root:1\n"
    # the allowed direction: the user's own files, made as the user
    sb.files.write("/tmp/mine.txt", "mine")
    assert sb.files.read("/tmp/mine.txt") == "mine"
    assert sb.commands.run("stat -c %u /tmp/mine.txt").stdout == "1000\n"
    with Sandbox.create(tier="gvisor", user="root") as root:  # a root sandbox's files API is root's
        root.files.write("/etc/motd", "hi")
        assert root.commands.run("cat /etc/motd").stdout == "hi"


#: what the probe did after `unshare -U -r`: its new namespace's CAP_NET_ADMIN and CAP_NET_RAW were
#: honoured over the sandbox's own network namespace (the MTU of its loopback changed for good)
NESTED_ROOT = ("unshare -U -r sh -c 'ip link set lo mtu 1286 && echo CHANGED-MTU; "
               "ip addr add 10.9.9.9/32 dev lo && echo ADDED-ADDRESS'")


@pytest.mark.parametrize("user", ["user", "root"])
def test_commands_cannot_make_namespaces_and_the_sandboxs_loopback_stays_its_own(sb: Sandbox, user: str) -> None:
    """The process tier's seccomp policy, loaded by runsc into gVisor's kernel: no namespace of
    any kind (unshare, setns, clone with a namespace flag; clone3 is ENOSYS, so libc uses clone),
    whatever the user, and ordinary work (threads, fork and exec, a pool of processes) runs."""
    mtu = sb.commands.run("cat /sys/class/net/lo/mtu", user=user).stdout
    nested = sb.commands.run(NESTED_ROOT, user=user)
    assert nested.exit_code != 0 and nested.stdout == "", nested
    assert "Operation not permitted" in nested.stderr, nested
    ctypes_calls = {
        "libc.unshare(0x10000000)": "EPERM",  # CLONE_NEWUSER
        "libc.unshare(0x40000000)": "EPERM",  # CLONE_NEWNET
        "libc.unshare(0x00000400)": "EPERM",  # CLONE_FS: unshare is refused whole, as in the process tier
        "libc.setns(0, 0)": "EPERM",
        "libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)": "EPERM",  # clone(NEWUSER | SIGCHLD)
        "libc.syscall(56, 0x40000000 | 17, 0, 0, 0, 0)": "EPERM",  # clone(NEWNET | SIGCHLD)
        "libc.syscall(56, 0x00020000 | 17, 0, 0, 0, 0)": "EPERM",  # clone(NEWNS | SIGCHLD)
        "libc.syscall(435, 0, 0)": "ENOSYS",  # clone3: its flags are in memory, libc falls back
        "libc.ptrace(16, 1, 0, 0)": "EPERM",  # PTRACE_ATTACH (no tracer could let clone3 through)
        "libc.syscall(41, 17, 3, 0)": "EPERM",  # AF_PACKET: no CAP_NET_RAW without a namespace
    }
    code = ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"for expr in {list(ctypes_calls)!r}:\n"
            "    r = eval(expr)\n"
            "    print('ok' if r >= 0 else errno.errorcode[ctypes.get_errno()])\n")
    answers = sb.commands.run(["python3", "-c", code], user=user)
    assert dict(zip(ctypes_calls, answers.stdout.split(), strict=True)) == ctypes_calls, answers
    assert sb.commands.run("cat /sys/class/net/lo/mtu", user=user).stdout == mtu
    assert sb.commands.run("ip -o addr show lo", user=user).stdout.count("inet ") == 1
    assert sb.commands.run("grep ^Seccomp: /proc/self/status", user=user).stdout.split() == ["Seccomp:", "2"]
    # the allowed direction: threads (pthread_create tries clone3 first), fork and exec, a process
    # pool, background jobs, gVisor's own kernel log
    work = sb.commands.run(["python3", "-c", (
        "import concurrent.futures as cf, multiprocessing, subprocess, os\n"
        "print(sum(cf.ThreadPoolExecutor(8).map(lambda x: x * x, range(100))))\n"
        "print(subprocess.run(['sh', '-c', '(sleep 0.1 &); echo exec'], capture_output=True, text=True).stdout, end='')\n"
        "pid = os.fork()\n"
        "os._exit(7) if pid == 0 else print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
        "with multiprocessing.Pool(2) as pool:\n"
        "    print(pool.map(abs, [-1, -2]))\n"
    )], user=user, timeout=60)
    assert work.stdout == "328350\nexec\n7\n[1, 2]\n", work
    assert "Starting gVisor" in sb.commands.run("dmesg", user=user).stdout


def test_timeout_kills_the_command_and_its_children(sb: Sandbox) -> None:
    r = sb.commands.run(["sh", "-c", "sleep 300 & sleep 301 & wait"], timeout=1)
    assert r.timed_out and r.exit_code == 124
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        ps = sb.commands.run(["ps", "-eo", "args"]).stdout
        if "sleep 30" not in ps:
            break
        time.sleep(0.1)
    assert "sleep 300" not in ps and "sleep 301" not in ps, ps


def _sleepers(sb: Sandbox, expected: list[str]) -> list[str]:
    """The `sleep 3NN` processes alive in the sandbox, once they are ``expected`` or 5 s passed
    (killed ones are reaped a moment later)."""
    deadline = time.monotonic() + 5
    while True:
        left = [a for a in sb.commands.run(["ps", "-eo", "args"]).stdout.splitlines() if a.startswith("sleep 3")]
        if left == expected or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def test_a_kill_reaches_what_left_the_commands_process_group_and_only_that_commands(sb: Sandbox) -> None:
    """Each command is in a cgroup of gVisor's own (the agent's command groups): a timeout or a
    kill reaches children that made a session of their own too -- before, they lived until the
    sandbox was destroyed.  A command that ends by itself leaves its background children alone,
    and a kill reaches no other command's.  Several rounds in one sandbox: the groups of ended
    commands go, and the 5th round holds as the 1st did."""
    escapes = "(setsid sleep 301 &); (setsid sh -c 'sleep 302 & exec sleep 303' &); setsid sleep 304 & "
    kept = sb.commands.run("(setsid sleep 399 &); echo left")  # the allowed direction
    assert kept.stdout == "left\n"
    for round in range(5):
        r = sb.commands.run(escapes + "exec sleep 300", timeout=1)
        assert r.timed_out and r.exit_code == 124
        assert _sleepers(sb, ["sleep 399"]) == ["sleep 399"], f"round {round}: the timeout left them"
        up = threading.Event()
        handle = sb.commands.start(escapes + "echo up; exec sleep 300", timeout=60, on_stdout=lambda _, ev=up: ev.set())
        assert up.wait(10)
        handle.kill()
        handle.wait()
        assert _sleepers(sb, ["sleep 399"]) == ["sleep 399"], f"round {round}: the kill left them"
    groups = sb.commands.run("ls /sys/fs/cgroup/pids | grep -c '^c'").stdout.strip()
    assert int(groups) <= 3, f"{groups} command groups left after 11 commands"  # kept's, ls's own


@pytest.mark.parametrize("user", ["user"])
def test_the_user_can_neither_leave_its_commands_group_nor_write_beside_it(sb: Sandbox, user: str) -> None:
    r = sb.commands.run("echo $$ > /sys/fs/cgroup/pids/cgroup.procs; mkdir /sys/fs/cgroup/pids/mine; "
                        "echo x > /sys/fs/cgroup/junk; grep pids /proc/self/cgroup", user=user)
    assert r.stderr.count("Permission denied") == 3, r
    assert r.stdout.rstrip().split("/")[-1].startswith("c"), r  # still in its command's group


def test_signals_reach_the_command(sb: Sandbox) -> None:
    handle = sb.commands.start(["python3", "-c", "import time; print('up', flush=True); time.sleep(60)"], timeout=30)
    time.sleep(0.5)
    handle.send_signal(signal.SIGTERM)
    result = handle.wait()
    assert result.signal == signal.SIGTERM and not result.timed_out


def test_commands_can_run_on_a_terminal(sb: Sandbox) -> None:
    out: list[bytes] = []
    handle = sb.commands.start("tty; stty size; read line; stty size", pty=(40, 100),
                               on_output=lambda _s, c: out.append(c))
    time.sleep(0.5)
    handle.resize(30, 90)
    handle.send_stdin("go\n")
    assert handle.wait().exit_code == 0
    text = b"".join(out).decode()
    assert "/dev/pts/" in text and "40 100" in text and "30 90" in text


def test_memory_overruns_kill_the_command_not_the_sandbox(sb: Sandbox) -> None:
    # one big block, many small ones, a bytes literal: each must be OOM-killed
    # with the Sentry left alive (unguarded, the kernel kills the Sentry, or the
    # Sentry's Go runtime dies of ENOMEM creating a thread at the limit)
    hogs = ["x = bytearray(1 << 30)", "x = [bytearray(1 << 20) for _ in range(2000)]", "x = b'a' * (400 << 20)"]
    for code in hogs * 2:
        hog = sb.commands.run(["python3", "-c", code + "; print('allocated')"], timeout=60)
        assert hog.oom_killed and hog.exit_code == 137 and "allocated" not in hog.stdout, (code, hog)
    small = sb.commands.run(["python3", "-c", "x = bytearray(128 << 20); print('fits')"])
    assert small.stdout == "fits\n" and not small.oom_killed


def test_a_command_started_right_after_an_overrun_is_not_killed_with_it(sb: Sandbox) -> None:
    """The guard may still be handling an overrun when the hog's result is back (the Sentry
    frees its memory late under load), and it killed every command running meanwhile: a CI run's
    next command came back empty.  A command now starts once the overrun is handled."""
    for _ in range(6):
        hog = sb.commands.run(["python3", "-c", "x = [bytearray(1 << 20) for _ in range(2000)]"], timeout=60)
        assert hog.oom_killed, hog
        after = sb.commands.run(["python3", "-c", "x = bytearray(64 << 20); print('alive')"], timeout=60)
        assert after.stdout == "alive\n" and not after.oom_killed, after


#: allocates STEPS x 16 MiB (touched), 0.1 s apart, after a second's wait, then holds them
_GROWER = ("import sys, time\ntime.sleep(1)\nheld = []\nfor _ in range(int(sys.argv[1])):\n"
           "    block = bytearray(16 << 20)\n    for i in range(0, len(block), 4096): block[i] = 1\n"
           "    held.append(block); time.sleep(0.1)\ntime.sleep(300)\n")


def _host_memory(sb: Sandbox) -> tuple[int, int]:
    """The sandbox's host memory cgroup: (usage, hard limit)."""
    cgroup = sb._tier_sandbox().cgroup  # type: ignore[attr-defined]
    v1 = cgroup.layout.version == 1
    group = cgroup.memory_group
    usage = int((group / ("memory.usage_in_bytes" if v1 else "memory.current")).read_text())
    return usage, int((group / ("memory.limit_in_bytes" if v1 else "memory.max")).read_text())


def _ends_and_its_limit_comes_back(sb: Sandbox, configured: int, within: float) -> None:
    """``sb`` is ended by its memory guard within ``within`` seconds, and its host limit is back."""
    deadline = time.monotonic() + within
    ended = False
    while not ended and time.monotonic() < deadline:
        try:
            sb.commands.run(["true"], timeout=10)
            time.sleep(0.5)
        except SandboxClosed:
            ended = True
    assert ended, f"the sandbox lives on holding {_host_memory(sb)[0] >> 20} MiB"
    while _host_memory(sb)[1] != configured and time.monotonic() < deadline:
        time.sleep(0.1)
    usage, limit = _host_memory(sb)
    assert limit == configured and usage <= configured, (usage >> 20, limit >> 20)


def test_a_background_process_that_overruns_ends_the_sandbox_and_the_limit_comes_back() -> None:
    """A command's `setsid` child that allocates past `memory` after the command ended: the guard
    kills only running commands (it cannot tell which process holds the memory), so it lifted the
    host limit to +1 GiB and left it there (a 256M sandbox held 1.3 GiB for good, its neighbours
    OOM-killed).  Now, once the guard has lost, the limit is restored or, where the usage is
    above it, the sandbox ended: its leftover is gone and the limit is back at `memory + 96 MiB`."""
    with Sandbox.create(tier="gvisor", memory="128M") as sb:
        _, configured = _host_memory(sb)
        assert configured == (128 + OVERHEAD // MiB) * MiB
        sb.files.write("/tmp/grow.py", _GROWER)
        kept = sb.commands.run("setsid nohup python3 /tmp/grow.py 40 >/dev/null 2>&1 & echo started")
        assert kept.stdout == "started\n"
        _ends_and_its_limit_comes_back(sb, configured, within=30)


def test_memory_the_guard_cannot_free_ends_the_sandbox_and_the_limit_comes_back() -> None:
    """A root process that left its command group (root's own sandbox may) holds past the limit:
    killing every command frees nothing, and cgroup v1 refuses to lower a limit below the usage
    (EBUSY), so the guard's lifted limit stayed for good.  Now the guard ends the sandbox: the
    command running then reports `oom_killed`, later calls `SandboxClosed`, and the limit is back."""
    with Sandbox.create(tier="gvisor", memory="64M") as sb:
        _, configured = _host_memory(sb)
        sb.files.write("/tmp/grow.py", _GROWER)
        sb.commands.run("setsid sh -c 'echo $$ > /sys/fs/cgroup/pids/cgroup.procs && exec python3 /tmp/grow.py 12' "
                        ">/dev/null 2>&1 &", user="root")
        running = sb.commands.run(["sleep", "30"], timeout=60)
        assert running.oom_killed and running.exit_code == 137, running
        _ends_and_its_limit_comes_back(sb, configured, within=20)


def test_task_limit_is_enforced_inside_gvisor_and_the_sandbox_survives() -> None:
    with Sandbox.create(tier="gvisor", pids=32) as sb:
        bomb = sb.commands.run(["sh", "-c", "for i in $(seq 100); do sleep 30 & done; wait"], timeout=20)
        assert bomb.exit_code != 0 and "fork" in bomb.stderr.lower(), bomb
        assert sb.commands.run(["echo", "alive"]).stdout == "alive\n"


def test_disk_limit_covers_tmp_too() -> None:
    # runsc would otherwise put /tmp on a tmpfs of its own, outside the disk limit
    with Sandbox.create(tier="gvisor", disk="8M") as sb:
        for path in ("/tmp/big", "/home/user/big"):
            r = sb.commands.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", "count=20"])
            assert r.exit_code != 0 and "No space left" in r.stderr, (path, r)
            sb.commands.run(["rm", "-f", path])
        assert sb.commands.run(["sh", "-c", "echo small > /tmp/ok && cat /tmp/ok"]).stdout == "small\n"


def test_too_little_memory_for_gvisor_is_a_typed_error() -> None:
    with pytest.raises(InvalidSpec, match="at least 32M"):
        Sandbox.create(tier="gvisor", memory="16M")
    with Sandbox.create(tier="gvisor", memory="32M") as sb:
        assert sb.commands.run(["python3", "-c", "print('fits')"]).stdout == "fits\n"


def test_network_is_off_but_loopback_inside_works(sb: Sandbox) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        outside = sb.commands.run(["python3", "-c", (
            "import socket\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('reached')\n"
            "except OSError as e:\n    print('denied', e)\n"
        )])
    finally:
        server.close()
    assert "reached" not in outside.stdout and "denied" in outside.stdout
    inside = sb.commands.run(["python3", "-c", (
        "import socket\n"
        "s = socket.create_server(('127.0.0.1', 0))\n"
        "c = socket.create_connection(s.getsockname(), timeout=2)\n"
        "print('loopback ok')\n"
    )])
    assert inside.stdout == "loopback ok\n", inside
    interfaces = sb.commands.run(["cat", "/proc/net/dev"]).stdout
    assert "eth" not in interfaces and "veth" not in interfaces


def test_allow_mode_goes_through_the_egress_proxy_only(state_dir: Path) -> None:
    """network="allow" in gVisor: the agent's relay on gVisor's own loopback reaches the host's
    egress proxy through a host Unix socket (--host-uds=open).  The allowed target answers, with
    the brokered secret swapped in; another port is refused and audited; nothing bypasses the proxy."""
    import http.server
    import threading

    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("X-Key", ""))
            body = b"allowed-target\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.create_server(("127.0.0.1", 0)) as other:
        other_port = other.getsockname()[1]
        try:
            with Sandbox.create(tier="gvisor", memory="256M", allow=[f"127.0.0.1:{port}"],
                                unsafe_allow_ranges=["127.0.0.1/32"], secrets=["GV_KEY@127.0.0.1"],
                                secret_values={"GV_KEY": "real-gvisor-secret"}) as sb:
                # --noproxy '': the proxy variables exempt 127.0.0.1, the test's target is there
                ok = sb.commands.run(f"curl -sS -m 10 --noproxy '' -H \"X-Key: $GV_KEY\" "
                                     f"http://127.0.0.1:{port}/")
                assert ok.stdout == "allowed-target\n", ok
                assert seen == ["real-gvisor-secret"]
                placeholder = sb.commands.run("printenv GV_KEY").stdout.strip()
                assert placeholder and "real-gvisor-secret" not in placeholder
                refused = sb.commands.run(f"curl -fsS -m 10 --noproxy '' http://127.0.0.1:{other_port}/")
                assert refused.exit_code == 22 and "403" in refused.stderr, refused  # curl -f: the proxy said no
                # bypassing the proxy: gVisor's netstack has only its own loopback
                direct = sb.commands.run(f"curl -sS -m 5 --noproxy '*' http://127.0.0.1:{port}/; "
                                         "curl -sS -m 5 --noproxy '*' http://169.254.169.254/")
                assert "allowed-target" not in direct.stdout and direct.exit_code != 0
                assert len(seen) == 1
                events = sb.network.audit()
                assert [(e.kind, e.destination, e.rule) for e in events] == [
                    ("refused", f"127.0.0.1:{other_port}", "not-allowed")], events
                run_dir_socket = list(Path(os.environ["CORRAL_STATE_DIR"]).glob(f"sandboxes/{sb.id}/egress/proxy.sock"))
                assert run_dir_socket and oct(run_dir_socket[0].stat().st_mode & 0o777) == "0o660"
            # the proxy's socket, its thread and the sandbox's run dir go with it
            assert not run_dir_socket[0].exists()
            assert not [t for t in threading.enumerate() if t.name == f"egress-{sb.id}"]
            assert sandbox_leftovers(sb.id, state_dir) == []
        finally:
            server.shutdown()
            server.server_close()


def test_teardown_leaves_no_runsc_state(state_dir: Path) -> None:
    sandbox = Sandbox.create(tier="gvisor")
    sandbox.commands.run(["true"])
    sandbox_id = sandbox.id
    run_dir = state_dir / "sandboxes" / sandbox_id
    assert (run_dir / "runsc").is_dir(), "runsc's --root lives in the sandbox's run dir"
    sandbox.kill()
    assert not run_dir.exists()
    assert _processes_naming(sandbox_id) == []
    assert sandbox_leftovers(sandbox_id, state_dir) == []
    # its reserved host uid is released (other tiers may hold uids of their own: wasm standby guests)
    assert not any(p.read_text() == sandbox_id for p in (state_dir / "uids").iterdir())


@pytest.mark.parametrize("network", ["none", "allow"])
def test_owner_killed_then_gc_leaves_nothing(state_dir: Path, network: str) -> None:
    # allow: the proxy's socket and egress dir are in the run dir, the proxy a thread of the owner
    owner, ids = start_owner(f"sb = Sandbox.create(tier='gvisor', network={network!r})\n"
                             "sb.commands.run(['sh', '-c', 'sleep 600 &'])\n"
                             "print(sb.id, flush=True)", sleep=600)
    try:
        (sandbox_id,) = ids
        assert sandbox_id.startswith("sb-"), sandbox_id
        assert _processes_naming(sandbox_id)
    finally:
        kill_9(owner)
    run_gc(sandbox_id)
    assert sandbox_leftovers(sandbox_id, state_dir) == []
    assert _processes_naming(sandbox_id) == []


def test_platform_probe_is_cached_and_a_bad_choice_is_refused(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runsc = runsc_binary()
    first = choose_platform(runsc, state_dir)
    assert first.name in ("systrap", "ptrace", "kvm")
    start = time.monotonic()
    assert choose_platform(runsc, state_dir) == first
    assert time.monotonic() - start < 0.1, "the second choice comes from the cache"
    monkeypatch.setenv(PLATFORM_ENV, "bogus")
    with pytest.raises(HostNotSupported, match="bogus"):
        choose_platform(runsc, state_dir)
    assert not GVisorTier.probe(state_dir).available


def test_an_old_runsc_is_refused_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Debian bookworm's own runsc: its statx breaks `ls`; the probe must say so and how to fix it
    old = tmp_path / "runsc"
    old.write_text("#!/bin/sh\necho 'runsc version 0.0~20221219.0'\necho 'spec: 1.0.2-dev'\n")
    old.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(HostNotSupported, match=r"too old.*bookworm-backports"):
        runsc_binary()
    availability = GVisorTier.probe(tmp_path)
    assert not availability.available and "make install" in availability.fix


def test_a_platform_that_hangs_is_given_up_on_and_cleaned_up(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # on this host --platform=kvm hangs (PVM-style KVM): the probe's deadline must end it
    # and leave no process or cgroup behind; on a host where kvm works it is simply chosen
    from corral.host import cgroups

    monkeypatch.setenv(PLATFORM_ENV, "kvm")
    start = time.monotonic()
    try:
        assert choose_platform(runsc_binary(), state_dir).name == "kvm"
    except HostNotSupported as exc:
        assert "kvm" in str(exc)
    assert time.monotonic() - start < 8
    assert not any(name.startswith("gvisor-probe-") for name in cgroups.list_sandbox_groups())
    assert _processes_naming("gvisor-probe-") == []


def test_the_platform_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    # `runsc do` makes its bundle in $TMPDIR; a probe killed at its deadline (kvm hangs on this
    # host) left it there: one /tmp/runsc-doNNN per such probe
    import tempfile

    from corral.tiers.gvisor.platform import probe_platform

    before = set(Path(tempfile.gettempdir()).glob("runsc-do*"))
    ok, detail = probe_platform(runsc_binary(), "ptrace", tmp_path, 30.0)
    assert ok, detail
    if Path("/dev/kvm").exists():
        probe_platform(runsc_binary(), "kvm", tmp_path, 3.0)  # works, fails or is killed
    assert set(Path(tempfile.gettempdir()).glob("runsc-do*")) == before
    assert list(tmp_path.iterdir()) == []
