"""No sandbox empties a host-wide kernel table for the others (``host/shared_tables.py``):
terminals, open files, process ids, tasks, asynchronous I/O.  Each attack takes what one sandbox can
take, then another sandbox (and the host) must still get its share."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral import Sandbox
from corral.host import cgroups
from corral.host.shared_tables import PTYS_PER_SANDBOX

from .leaks import all_leftovers, assert_gone_soon, kill_9, remove_cgroup_parent, run_gc, start_owner
from .sandbox_wait import lines_written

#: takes terminals until refused, says how many and why, then holds them
TAKE_TERMINALS = """python3 -c '
import os, time
fds = []
try:
    while len(fds) < 10000:
        fds.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
    print(len(fds), "none refused", flush=True)
except OSError as e:
    print(len(fds), e.errno, flush=True)
time.sleep(120)
' >/tmp/taken 2>&1 &"""


def _on_a_terminal(sb: Sandbox, cmd: str) -> tuple[int, bytes]:
    out: list[bytes] = []
    result = sb.commands.start(cmd, pty=(24, 80), on_output=lambda _s, c: out.append(c)).wait()
    return result.exit_code, b"".join(out) + result.stderr.encode()


def test_one_sandboxs_terminals_leave_every_other_sandbox_its_own() -> None:
    hog, other = Sandbox.create(), Sandbox.create()
    try:
        hog.commands.run(TAKE_TERMINALS)
        taken, errno_ = lines_written(hog, "/tmp/taken", 1, 30).split()
        # its own devpts's bound, not the host's shared table (3,071 were taken before)
        assert int(taken) == PTYS_PER_SANDBOX and errno_ == "28"  # ENOSPC
        # while it holds them: another sandbox opens terminals, and runs a command on one
        r = other.commands.run("python3 -c 'import pty; print(len(pty.openpty()))'")
        assert (r.exit_code, r.stdout) == (0, "2\n"), r.stderr
        code, out = _on_a_terminal(other, "tty")
        assert code == 0 and b"/dev/pts/" in out
        # the agent's terminals come from the same bound: a command of the sandbox that took
        # them all is refused at once, and gets one again once they are let go
        code, out = _on_a_terminal(hog, "tty")
        assert code == -1 and b"openpty: No space left on device" in out
        hog.commands.run(["pkill", "-f", "ptmx"])
        deadline = time.monotonic() + 10
        while (code, out) == (-1, out) and time.monotonic() < deadline:
            time.sleep(0.1)
            code, out = _on_a_terminal(hog, "tty")
        assert code == 0 and b"/dev/pts/" in out
    finally:
        hog.kill()
        other.kill()


def test_native_asynchronous_io_is_refused_so_no_sandbox_takes_the_hosts_table() -> None:
    before = int(Path("/proc/sys/fs/aio-nr").read_text())
    with Sandbox.create() as sb:
        r = sb.commands.run("""python3 -c '
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
ctx = ctypes.c_ulong(0)
print(libc.syscall(206, 4096, ctypes.byref(ctx)), errno.errorcode[ctypes.get_errno()])
'""")
        assert r.stdout.split() == ["-1", "ENOSYS"], r.stderr  # (a program takes its fallback)
        assert int(Path("/proc/sys/fs/aio-nr").read_text()) == before
        # POSIX asynchronous I/O (glibc's, on threads) still works
        r = sb.commands.run("""python3 -c '
import ctypes, os
rt = ctypes.CDLL("librt.so.1", use_errno=True)
class aiocb(ctypes.Structure):
    _fields_ = [("fildes", ctypes.c_int), ("lio_opcode", ctypes.c_int), ("reqprio", ctypes.c_int),
                ("buf", ctypes.c_void_p), ("nbytes", ctypes.c_size_t), ("rest", ctypes.c_char * 512)]
fd = os.open("/etc/hostname", os.O_RDONLY)
buf = ctypes.create_string_buffer(64)
cb = aiocb(fd, 0, 0, ctypes.cast(buf, ctypes.c_void_p), 64)
assert rt.aio_read(ctypes.byref(cb)) == 0, ctypes.get_errno()
while rt.aio_error(ctypes.byref(cb)) == 115: pass  # EINPROGRESS
print(rt.aio_return(ctypes.byref(cb)) > 0)
'""")
        assert r.stdout == "True\n", r.stderr


#: one sandbox's share of open files: more than half the kernel's default table on this host
#: (2,466,093 for 24 GiB), so that two of them filled it before the table was widened
FILES_PER_SANDBOX = 1_300_000

#: forks enough processes to hold ``FILES_PER_SANDBOX`` files (eventfds: one file each), each
#: holding what its open-files limit lets it; prints the total, then holds them
TAKE_FILES = """python3 -c '
import os, resource, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
each = hard - 16
report_r, report_w = os.pipe()
children = -(-%d // each)
for _ in range(children):
    if os.fork() == 0:
        os.close(report_r)
        n = 0
        try:
            while n < each:
                os.eventfd(0); n += 1
        except OSError:
            pass
        os.write(report_w, b"%%d\\n" %% n)
        time.sleep(300)
        os._exit(0)
os.close(report_w)
reports = os.fdopen(report_r)
total = sum(int(reports.readline()) for _ in range(children))
print(total, flush=True)
' >/tmp/files 2>&1 &"""


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 10_000,
                    reason="a sandbox's processes hold at most this process's hard open-files limit each")
def test_the_open_files_of_two_sandboxes_leave_the_host_and_a_third_sandbox_room() -> None:
    hogs = [Sandbox.create(memory="1536M", pids=256) for _ in range(2)]
    try:
        for hog in hogs:
            hog.commands.run(TAKE_FILES % FILES_PER_SANDBOX)
        for hog in hogs:
            # each takes all it asked for: open files are bounded by its memory, not by a table
            # they share with everything else on the host
            assert int(lines_written(hog, "/tmp/files", 1, 120)) >= FILES_PER_SANDBOX
        with Sandbox.create() as third:
            r = third.commands.run("python3 -c 'import os; print(len([os.eventfd(0) for _ in range(1000)]))'")
            assert (r.exit_code, r.stdout) == (0, "1000\n"), r.stderr
        # a host process without privilege opens files too (root's ignore the table)
        r = subprocess.run(["cat", "/proc/sys/kernel/ostype"], capture_output=True, text=True, user=65534, timeout=30)
        assert r.stdout == "Linux\n", r.stderr
    finally:
        for hog in hogs:
            hog.kill()


def test_a_sandbox_given_many_pids_leaves_the_host_pids() -> None:
    # pids=40000 is a valid spec; before the pid table was widened (32,768 here) it left the
    # host no pid at all.  Threads take pids as processes do, and cost less to make.
    with Sandbox.create(memory="2G", pids=40_000, timeout=120) as hog:
        # in two processes: a process's threads are bounded by its memory map count (65,530)
        hog.commands.run("""python3 -c '
import os, threading, time
threading.stack_size(65536)
os.fork()
n = 0
try:
    while n < 17000:
        threading.Thread(target=time.sleep, args=(300,), daemon=True).start(); n += 1
except RuntimeError:
    pass
print(n, flush=True)
time.sleep(300)
' >>/tmp/threads 2>&1 &""")
        assert lines_written(hog, "/tmp/threads", 2, 120).split() == ["17000", "17000"]
        assert subprocess.run(["true"], timeout=30).returncode == 0
        with Sandbox.create() as other:
            assert other.commands.run("sh -c 'true & wait'").exit_code == 0


#: starts threads (8 KiB stacks, one mapping for all) until refused or ``argv[1]``, prints how
#: many, then holds them ``argv[2]`` seconds: Python's threads cost ~100 KiB each, these ~30
TAKE_TASKS = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
static int hold(void *arg) { (void)arg; for (;;) syscall(SYS_pause); return 0; }
int main(int argc, char **argv) {
    long wanted = atol(argv[1]), made = 0;
    char *stacks = mmap(NULL, (size_t)wanted * 8192, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stacks == MAP_FAILED) return 1;
    while (made < wanted && clone(hold, stacks + (made + 1) * 8192, CLONE_VM | CLONE_FS | CLONE_FILES
                                  | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM, NULL) > 0)
        made++;
    printf("%ld\n", made);
    fflush(stdout);
    sleep((unsigned)atoi(argv[2]));
    return 0;
}
"""


#: an owner whose RLIMIT_NPROC is 4,000 (this host's is half of kernel.threads-max, which root
#: may not raise here): a pids limit over it is refused, one at it works
TASK_LIMITED_OWNER = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NPROC, (4000, 4000))
from corral import Sandbox
from corral.errors import ResourceLimit
try:
    Sandbox.create(pids=4001).kill()
    print("made")
except ResourceLimit as exc:
    print("refused:", exc)
with Sandbox.create(pids=4000) as sb:
    print(sb.commands.run("grep 'Max processes' /proc/self/limits").stdout.split()[2])
"""


def test_a_pids_limit_over_what_the_owner_lets_a_user_run_is_refused_not_cut_short(state_dir: Path) -> None:
    # the sandbox's tasks run as its own uid, which the owner's RLIMIT_NPROC bounds too: before,
    # pids=100100 gave ~96,000 tasks in silence (the limit here)
    before = set(all_leftovers(state_dir))
    r = subprocess.run([sys.executable, "-c", TASK_LIMITED_OWNER], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    refused, allowed = r.stdout.splitlines()
    assert refused.startswith("refused: pids: 4001 is more tasks than this host lets one user run (4000"), refused
    assert allowed == "4000"
    assert set(all_leftovers(state_dir)) == before


def test_the_tasks_of_two_sandboxes_leave_the_host_and_a_third_sandbox_room(tmp_path: Path) -> None:
    # pids=100100 is a valid spec.  Each sandbox's uid may have half the kernel's task table
    # (RLIMIT_NPROC's default); with the table at the kernel's default (192,724 here), two such
    # sandboxes took every task slot: the host and every other sandbox failed to fork
    (tmp_path / "take.c").write_text(TAKE_TASKS)
    subprocess.run(["cc", "-O2", "-static", "-o", str(tmp_path / "take"), str(tmp_path / "take.c")], check=True)
    # as many as a sandbox may ask for here (its uid's RLIMIT_NPROC: a pids limit over it is refused)
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    pids = 100_100 if nproc == resource.RLIM_INFINITY else min(100_100, nproc)
    wanted = pids  # (until refused: the sandbox's shell and agent count too)
    hogs = [Sandbox.create(memory="4G", pids=pids, timeout=300, workspace=str(tmp_path)) for _ in range(2)]
    try:
        for hog in hogs:
            hog.commands.run(f"/workspace/take {wanted} 120 >/tmp/tasks 2>&1 &")
        taken = [int(lines_written(hog, "/tmp/tasks", 1, 120)) for hog in hogs]
        assert all(n >= wanted - 100 for n in taken), (taken, nproc)
        assert subprocess.run(["true"], timeout=30).returncode == 0
        with Sandbox.create() as third:
            assert third.commands.run("sh -c 'true & wait'").exit_code == 0
    finally:
        for hog in hogs:
            hog.kill()


def _set_cpu_limit(sandbox_id: str, cpus: float) -> None:
    layout = cgroups.detect()
    group = layout.controllers["cpu"] / cgroups.PARENT / sandbox_id
    quota = int(cpus * 100_000)
    if layout.version == 2:
        (group / "cpu.max").write_text(f"{quota} 100000")
    else:
        (group / "cpu.cfs_quota_us").write_text(str(quota))


def test_a_sandbox_of_many_tasks_under_a_small_cpu_limit_ends_at_its_kill_in_seconds(tmp_path: Path) -> None:
    # the kernel ends killed tasks on their own CPU time: 30,000 threads at cpus=0.02 took minutes
    # to end, and the sandbox's kill gave up after 12 s (it raised, and left them to the janitor);
    # a kill now lifts the CPU limit of the tasks it killed (they run no code of theirs again)
    (tmp_path / "take.c").write_text(TAKE_TASKS)
    subprocess.run(["cc", "-O2", "-static", "-o", str(tmp_path / "take"), str(tmp_path / "take.c")], check=True)
    sb = Sandbox.create(memory="2G", pids=31_000, timeout=300, workspace=str(tmp_path))
    try:
        sb.commands.run("/workspace/take 30000 300 >/tmp/tasks 2>&1 &")
        assert int(lines_written(sb, "/tmp/tasks", 1, 120)) == 30_000
        # made at cpus=1 (made at 0.02, they took minutes); the limit then as if asked for at create
        _set_cpu_limit(sb.id, 0.02)
        # the limit holds while the sandbox lives: two seconds of spinning get ~2% of a CPU
        spun = sb.commands.run("python3 -c 'import time\nt=time.monotonic()\nwhile time.monotonic()-t<2: pass\n"
                               "print(time.process_time())'", timeout=60)
        assert float(spun.stdout) < 0.5, spun.stdout
        start = time.monotonic()
        sb.kill()
        assert time.monotonic() - start < 30
    finally:
        sb.kill()
    assert sb.id not in cgroups.list_sandbox_groups()


def test_a_killed_owners_sandbox_of_many_tasks_under_a_small_cpu_limit_is_reaped_whole(
        tmp_path: Path, state_dir: Path) -> None:
    # the janitor's kill waited 5 s and its rmdir 2 s for tasks the kernel ended at 2% of a CPU:
    # `corral gc` named the sandbox reaped and left its groups and their dying tasks behind
    (tmp_path / "take.c").write_text(TAKE_TASKS)
    subprocess.run(["cc", "-O2", "-static", "-o", str(tmp_path / "take"), str(tmp_path / "take.c")], check=True)
    owner, ids = start_owner(
        f"sb = Sandbox.create(memory='2G', pids=31_000, timeout=300, workspace={str(tmp_path)!r})\n"
        "sb.commands.run('/workspace/take 30000 300 >/tmp/tasks 2>&1 &')\n"
        "from tests.sandbox_wait import lines_written\n"
        "print(lines_written(sb, '/tmp/tasks', 1, 120).strip(), sb.id, flush=True)")
    try:
        assert ids[0] == "30000", ids
        _set_cpu_limit(ids[1], 0.02)
    finally:
        kill_9(owner)
    run_gc(ids[1])
    assert_gone_soon(ids[1], state_dir, 30)


def _tcp_memory() -> int:
    """The host's TCP buffers in use, in bytes (``net.ipv4.tcp_mem`` counts them: one pool)."""
    for line in Path("/proc/net/sockstat").read_text().splitlines():
        if line.startswith("TCP:"):
            return int(line.split()[-1]) * 4096
    raise AssertionError("no TCP line in /proc/net/sockstat")


#: 600 loopback connections whose receivers read nothing, each sender filling what it may
HOLD_TCP = """python3 -c '
import resource, socket, time
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
srv = socket.socket(); srv.bind(("127.0.0.1", 7000)); srv.listen(1024)
pairs, data = [], b"x" * (1 << 20)
for _ in range(600):
    c = socket.create_connection(("127.0.0.1", 7000)); s, _ = srv.accept()
    s.setblocking(False)
    try:
        while True: s.send(data)
    except OSError: pass
    pairs.append((c, s))
print(len(pairs), flush=True)
time.sleep(120)
' >/tmp/tcp 2>&1 &"""


def test_a_sandboxs_tcp_buffers_count_against_it_not_only_against_the_hosts_pool() -> None:
    with Sandbox.create(memory="256M") as sb:
        # the allowed thing: a loopback transfer of 64 MiB inside the sandbox
        r = sb.commands.run("""python3 -c '
import socket, threading
srv = socket.socket(); srv.bind(("127.0.0.1", 7001)); srv.listen()
def send():
    s, _ = srv.accept(); s.sendall(b"y" * (64 << 20)); s.close()
threading.Thread(target=send).start()
c = socket.create_connection(("127.0.0.1", 7001)); n = 0
while chunk := c.recv(1 << 20): n += len(chunk)
print(n)
'""", timeout=60)
        assert r.stdout == f"{64 << 20}\n", r.stderr
        before = _tcp_memory()
        sb.commands.run(HOLD_TCP)
        assert lines_written(sb, "/tmp/tcp", 1, 60) == "600\n"
        held = _tcp_memory() - before
        # 1.98 GB of the host's pool (2.2 GiB at most here) before; on cgroup v1 the sandbox's
        # group now has a TCP limit (a quarter of its memory), which the kernel passes by one
        # buffer per socket that reads nothing (~75 KB on loopback): ~110 MB; on v2 they are
        # part of its memory
        assert held < 256 << 20, f"{held >> 20} MiB of the host's TCP memory"


TOGETHER = """
import json, sys, threading
from corral import Sandbox
hog = "python3 -c 'import time; x = bytearray(600 << 20); time.sleep(3); print(len(x))'"
with Sandbox.create(memory="768M") as a, Sandbox.create(memory="768M") as b:
    alone = a.commands.run(hog, timeout=60)  # the allowed direction: one fits
    results = {}
    def run(name, sb):
        results[name] = sb.commands.run(hog, timeout=60)
    threads = [threading.Thread(target=run, args=item) for item in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"alone": [alone.exit_code, alone.oom_killed],
                      **{k: [r.exit_code, r.oom_killed] for k, r in results.items()},
                      "after": [a.commands.run("echo alive").stdout, b.commands.run("echo alive").stdout]}))
"""


def test_sandboxes_together_stay_within_what_the_host_gives_them_all(tmp_path: Path) -> None:
    """Each sandbox's limit bounded it, but nothing bounded their sum: sandboxes each within
    their limits could fill the host together, and the global OOM killer then chose among every
    process of the host (the owner holding them, sshd).  Their parent group now has a limit
    (``cgroups.sandboxes_memory``: the host less a tenth, at least 1 GiB; here set to 1 GiB in a
    parent of this test's own): two 768M sandboxes each allocating 600 MB at once get one command
    OOM-killed inside, and both sandboxes go on."""
    import json

    from corral.host import cgroups

    parent = f"corral-together-{tmp_path.name[-12:]}"
    env = {**__import__("os").environ, "CORRAL_CGROUP_PARENT": parent, "CORRAL_SANDBOXES_MEMORY": "1G"}
    try:
        out = subprocess.run([sys.executable, "-c", TOGETHER], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        layout = cgroups.detect()
        limit_file = "memory.max" if layout.version == 2 else "memory.limit_in_bytes"
        assert (layout.controllers["memory"] / parent / limit_file).read_text().strip() == str(1 << 30)
    finally:
        remove_cgroup_parent(parent)
    assert seen["alone"] == [0, False], seen
    outcomes = sorted([tuple(seen["a"]), tuple(seen["b"])])
    assert outcomes == [(0, False), (137, True)], seen
    assert seen["after"] == ["alive\n", "alive\n"], seen
