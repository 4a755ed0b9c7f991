"""A long session with a workspace: background processes of the sandbox change the tree while
the host walks it and writes it back, and hundreds of commands run in one sandbox.

The write-back runs as host root on a tree the sandbox controls.  Each command alone is tested
in ``test_workspace_overlay.py`` and ``test_workspace_bounds.py``; here a process the sandbox
left running swaps files, directories and links under the walk (``renameat2(RENAME_EXCHANGE)``,
atomic, so the host's every step may meet the other kind) while the host runs short commands,
each followed by a write-back.  Afterwards, on the host: nothing outside the workspace was read
into it or written, every entry is the workspace owner's, no link leads out, no write-back hung
or raised an untyped error, and the host holds at most the sandbox's disk.  Before: such races
failed commands with ``HostError`` (a file made a whiteout, socket or link under the walk); a
write-back that failed midway left a temporary file that failed every later one; a sandbox
moving its data ahead of the copy filled the host with several times its disk.

Cost: ~25 s at load 3 on 2 cores (gVisor's ~9 s of it where that tier runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral.errors import SandboxError
from corral.host import cgroups, ws_overlay

from .leaks import sandbox_leftovers
from .test_workspace_bounds import allocated
from .tier_probe import skip_unless_tier

DISK = 32 << 20
OWNER = (4321, 4321)  # the workspace's owner: not root, not the sandbox's
SECRET = b"CSSN-SECRET-7f3a9c"
CANARY = b"CSSN-CANARY-51e2d0"

#: runs in the background inside the sandbox for argv[1] seconds, then prints its counts
ATTACKER = r"""
import ctypes, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
def swap(a, b):  # atomic where the kernel can: the host sees one kind or the other, never neither
    if libc.renameat2(-100, a.encode(), -100, b.encode(), 2) != 0:
        os.rename(a, "swap.tmp"); os.rename(b, a); os.rename("swap.tmp", b)
def attempt(name, op):
    try:
        op()
        ok[name] = ok.get(name, 0) + 1
    except OSError as exc:
        failed[name] = exc.strerror
os.chdir("/workspace")
ok, failed = {}, {}
with open("f", "wb") as f: f.write(b"sandbox data\n")
for name, target in (("s-shadow", "/etc/shadow"), ("s-secret", "../outside/secret.txt"),
                     ("s-root", "/"), ("s-rootdir", "/root"), ("s-up", ".."), ("s-outside", "../outside")):
    os.symlink(target, name)
os.mkfifo("p")
sock = socket.socket(socket.AF_UNIX); sock.bind("k")
os.makedirs("d"); open("d/cssn-in", "w").write("in d\n")
os.makedirs("a/b/c"); open("a/b/c/cssn-leaf", "w").write("leaf\n")
big = os.open("big", os.O_RDWR | os.O_CREAT, 0o644)
CHUNK = 4 << 20
end, n = time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < end:
    n += 1
    for other in ("s-shadow", "s-secret", "p", "k", "s-up"):
        attempt("file<->" + other, lambda: (swap("f", other), swap("f", other)))
    for other in ("s-root", "s-rootdir", "s-up", "s-outside"):
        attempt("dir<->" + other, lambda: (swap("d", other), swap("d", other)))
    attempt("rename up", lambda: os.rename("a/b/c", "c"))
    attempt("rename down", lambda: os.rename("c", "a/b/c"))
    attempt("rename dir over link", lambda: (os.rename("a/b", "b"), os.rename("b", "a/b")))
    attempt("hard link to root's file", lambda: os.link("roots", "hl-%d" % (n % 4)))
    attempt("hard link to own file", lambda: os.link("f", "hl-own-%d" % (n % 4)))
    attempt("whiteout", lambda: os.mknod("wo-%d" % (n % 4), stat.S_IFCHR | 0o644, 0))
    for gone in ("hl-%d" % ((n + 2) % 4), "hl-own-%d" % ((n + 2) % 4), "wo-%d" % ((n + 2) % 4)):
        attempt("unlink", lambda: os.unlink(gone))
    # a sparse file whose data moves ahead of the host's copy: more data than the disk, over time
    attempt("grow", lambda: (os.ftruncate(big, 0), os.ftruncate(big, 1 << 30),
                             os.pwrite(big, b"g" * CHUNK, (n * CHUNK) % ((1 << 30) - CHUNK))))
    attempt("new file", lambda: open("n-%d" % (n % 16), "w").write(str(n)))
print(n, sorted(ok), failed, flush=True)
""".replace("stat.S_IFCHR", "0o020000")


WAIT_FOR_ATTACKER = "while [ ! -s /tmp/attack.out ]; do sleep 0.01; done; cat /tmp/attack.out"


@pytest.fixture(params=["process", "process-copy", "gvisor"])
def tier(request: pytest.FixtureRequest, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "gvisor":
        skip_unless_tier(request.param, state_dir)
    if request.param == "process-copy":  # the copy used where a workspace cannot be idmapped
        monkeypatch.setattr(ws_overlay, "ENABLED", False)
    yield request.param.split("-")[0]



def plant(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    """The user's workspace (owned by OWNER, with a file of root's) and, beside it, files the
    sandbox must never reach: their names and contents."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "canary.txt").write_bytes(CANARY)
    os.chown(ws, *OWNER)
    (ws / "roots").write_bytes(b"root's file\n")
    os.chmod(ws / "roots", 0o644)
    return ws, outside, {p.name: p.read_bytes() for p in outside.iterdir()}


def host_secrets() -> list[bytes]:
    """Bytes that must never show in the workspace: the canaries and /etc/shadow's lines."""
    shadow = [line for line in Path("/etc/shadow").read_bytes().splitlines() if len(line) > 8]
    return [SECRET, CANARY, *shadow[:3]]


def failure(exc: BaseException) -> str:
    """An error and where its cause was raised."""
    cause = exc.__cause__ or exc
    where = traceback.extract_tb(cause.__traceback__)[-1] if cause.__traceback__ else None
    return f"{type(exc).__name__}: {exc}" + (f" (at {Path(where.filename).name}:{where.lineno})" if where else "")


def data_of(path: Path) -> bytes:
    """The bytes of a file's data extents (its holes skipped: the sparse file is 1 GiB)."""
    out, fd = [], os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while True:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:
                return b"".join(out)
            offset = os.lseek(fd, start, os.SEEK_HOLE)
            out.append(os.pread(fd, offset - start, start))
    finally:
        os.close(fd)


def check_host(tmp_path: Path, ws: Path, outside: Path, before: dict[str, bytes]) -> None:
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "ws"], "written beside the workspace"
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before, "the outside files changed"
    for top in (Path("/"), Path("/root"), Path("/etc")):
        assert not list(top.glob("cssn-*")), f"the write-back wrote into {top}"
    secrets = host_secrets()
    for path in ws.rglob("*"):
        st = path.lstat()
        if (st.st_uid, st.st_gid) != OWNER:
            assert path == ws / "roots", f"{path} is owned by {st.st_uid}:{st.st_gid}"
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(path)
            resolved = os.path.normpath(os.path.join(path.parent, target))
            assert not target.startswith("/") and resolved.startswith(f"{ws}/"), f"{path} -> {target}"
        elif stat.S_ISREG(st.st_mode):
            data = data_of(path)
            assert not any(s in data for s in secrets), f"{path} holds host data"
        else:
            assert stat.S_ISDIR(st.st_mode), f"{path} is a {stat.filemode(st.st_mode)}"
        assert not path.name.startswith(".corral-tmp"), f"a write-back's temporary file was left: {path}"


def test_a_background_process_racing_the_write_back_reaches_nothing_outside(tier: str, tmp_path: Path) -> None:
    ws, outside, before = plant(tmp_path)
    seconds = 1.5 if tier == "process" else 2.5
    errors: list[str] = []
    slowest, commands = 0.0, 0
    with Sandbox.create(tier=tier, workspace=str(ws), disk=str(DISK), memory="256M") as sb:
        sb.files.write("/tmp/attack.py", ATTACKER)
        r = sb.commands.run(f"setsid python3 /tmp/attack.py {seconds} > /tmp/attack.out 2>&1 &", cwd="/workspace")
        assert r.exit_code == 0, r.stderr
        deadline = time.monotonic() + seconds + 0.5
        while time.monotonic() < deadline:
            start = time.monotonic()
            try:
                r = sb.commands.run(f"echo {commands} > tick", cwd="/workspace", timeout=10)
            except SandboxError as exc:  # a HostError here was the write-back's OSError
                errors.append(failure(exc))
            except Exception as exc:  # anything else raised from the owner fails the test too
                errors.append(f"untyped {failure(exc)}")
            else:
                assert r.exit_code == 0, r.stderr
            slowest = max(slowest, time.monotonic() - start)
            commands += 1
        report = sb.commands.run(WAIT_FOR_ATTACKER, timeout=20).stdout
        print(f"{tier}: {commands} commands, slowest {slowest:.3f} s; attacker: {report}")
        rounds, done = report.split(" ", 1)
        assert int(rounds) > 20 and "'file<->s-shadow'" in done and "'dir<->s-root'" in done, report
        r = sb.commands.run("echo last > last", cwd="/workspace")
        assert r.exit_code == 0
    assert not errors, f"{len(errors)} of {commands} commands failed: {errors[:3]}"
    assert (ws / "last").read_text() == "last\n"
    check_host(tmp_path, ws, outside, before)
    assert allocated(ws) <= DISK, f"the host holds {allocated(ws)} bytes of a {DISK}-byte sandbox's files"
    assert slowest < 5.0


#: a 1 GiB sparse file whose 8 MiB of data move ahead of the host's copy: written, then the
#: 8 MiB before punched, for argv[1] seconds
MOVING = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
SIZE, CHUNK = 1 << 30, 8 << 20
fd = os.open("/workspace/big", os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, SIZE)
end, pos, n = time.monotonic() + float(sys.argv[1]), 0, 0
while time.monotonic() < end:
    os.pwrite(fd, b"z" * CHUNK, pos)
    assert libc.fallocate(fd, 3, (pos - CHUNK) % SIZE, CHUNK) == 0  # PUNCH_HOLE | KEEP_SIZE
    pos, n = (pos + CHUNK) % SIZE, n + 1
print(n, flush=True)
"""


@pytest.mark.parametrize("copy", [False, True], ids=["overlay", "copy"])
def test_data_moving_ahead_of_the_copy_does_not_fill_the_host(copy: bool, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # each write-back copied whatever data it met, and the sandbox kept moving its 8 MiB ahead of
    # the copy: a 32 MiB sandbox put 216-240 MiB in the user's directory; now a write-back copies
    # at most the sandbox's disk (the host holds a file's old copy beside its new one until the
    # rename: at most twice that, for an instant)
    # gVisor's (runsc 20221219) has no FALLOC_FL_PUNCH_HOLE to move data with; its write-back is this code
    if copy:
        monkeypatch.setattr(ws_overlay, "ENABLED", False)
    ws = tmp_path / "ws"
    ws.mkdir()
    peak = 0
    with Sandbox.create(workspace=str(ws), disk=str(DISK), memory="256M") as sb:
        sb.files.write("/tmp/moving.py", MOVING)
        assert sb.commands.run("setsid python3 /tmp/moving.py 2 > /tmp/attack.out 2>&1 &").exit_code == 0
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert sb.commands.run("true", cwd="/workspace").exit_code == 0
            peak = max(peak, allocated(ws))
        rounds = int(sb.commands.run(WAIT_FOR_ATTACKER).stdout)
    assert rounds > 20
    assert peak <= 2 * DISK, f"the host held {peak >> 20} MiB of a {DISK >> 20} MiB sandbox's files"
    assert allocated(ws) <= DISK and (ws / "big").stat().st_size == 1 << 30


@pytest.mark.parametrize("copy", [False, True], ids=["overlay", "copy"])
def test_commands_finishing_at_once_write_back_one_at_a_time(copy: bool, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # the copy's write-back had no lock: three commands finishing at once wrote the same
    # temporary names, and most failed with HostError (File exists), leaving one in the workspace
    if copy:
        monkeypatch.setattr(ws_overlay, "ENABLED", False)
    ws = tmp_path / "ws"
    ws.mkdir()
    errors: list[str] = []
    with Sandbox.create(workspace=str(ws), disk=str(DISK)) as sb:

        def run(k: int) -> None:
            for i in range(25):
                try:
                    sb.commands.run(f"for j in 1 2 3 4 5 6; do echo {k}-{i} > same$j; done", cwd="/workspace")
                except SandboxError as exc:
                    errors.append(failure(exc))

        threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        inside = sb.commands.run("cat same1 same6", cwd="/workspace").stdout
    assert not errors, f"{len(errors)} of 75 commands failed: {errors[:3]}"
    assert sorted(p.name for p in ws.iterdir()) == [f"same{j}" for j in range(1, 7)]
    assert (ws / "same1").read_text() + (ws / "same6").read_text() == inside


def test_a_long_name_of_many_byte_characters_is_written_back(tmp_path: Path) -> None:
    # the write-back's temporary name was cut to 255 characters, not bytes: a file named with
    # 127 "é" (254 bytes) made that command and every later one fail with ENAMETOOLONG
    ws = tmp_path / "ws"
    ws.mkdir()
    long = "é" * 127
    with Sandbox.create(workspace=str(ws)) as sb:
        r = sb.commands.run(["python3", "-c", f"open('{long}', 'w').write('long')"], cwd="/workspace")
        assert r.exit_code == 0, r.stderr
        assert sb.commands.run("echo after > after", cwd="/workspace").exit_code == 0
    assert (ws / long).read_text() == "long"
    assert (ws / "after").read_text() == "after\n"
    assert sorted(p.name for p in ws.iterdir()) == sorted(["after", long])


#: a listing of the workspace as the sandbox sees it: {path: kind and, for a file, its sha256}
LISTING = """
import hashlib, json, os
out = {}
for top, dirs, files in os.walk("."):
    for name in dirs + files:
        path = os.path.join(top, name)[2:]
        if os.path.islink(path):
            out[path] = "l " + os.readlink(path)
        elif os.path.isdir(path):
            out[path] = "d"
        else:
            out[path] = "f " + hashlib.sha256(open(path, "rb").read()).hexdigest()
print(json.dumps(out))
"""


def host_listing(ws: Path) -> dict[str, str]:
    out = {}
    for path in ws.rglob("*"):
        rel = str(path.relative_to(ws))
        if path.is_symlink():
            out[rel] = "l " + os.readlink(path)
        elif path.is_dir():
            out[rel] = "d"
        else:
            out[rel] = "f " + hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def session_step(i: int) -> tuple[str, float]:
    """Command ``i`` of a session, and its timeout: one that times out, one killed, one leaving
    a background writer, one failing, the rest ordinary (files made, changed, moved, deleted)."""
    kind = i % 10
    if kind == 0:
        return f"echo {i} > timed-out; sleep 5", 0.05
    if kind == 1:
        return f"echo {i} > killed; kill -9 $$", 10
    if kind == 2:  # ends on its own, after the command: marks its end for the final wait
        return (f"(for j in 1 2 3 4 5; do echo $j >> bg/w{i % 30}; sleep 0.01; done; touch bg/done-{i})"
                " > /dev/null 2>&1 &"), 10
    if kind == 3:
        return f"echo {i} > failed; exit 3", 10
    return (f"mkdir -p d{i % 7}/e && echo {i} > d{i % 7}/e/f{i % 13} && mv d{i % 7}/e/f{i % 13} g{i % 11}"
            f" && rm -rf d{(i + 3) % 7}; ln -sfn g{i % 11} link{i % 3}"), 10


def owner_counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), threading.active_count()


@pytest.mark.parametrize("tier_name", ["process", "gvisor"])
def test_a_session_of_hundreds_of_commands_keeps_the_write_back_and_the_owner_whole(
        tier_name: str, tmp_path: Path, state_dir: Path) -> None:
    if tier_name == "gvisor":
        skip_unless_tier(tier_name, state_dir)
    count = 300 if tier_name == "process" else 40
    ws = tmp_path / "ws"
    ws.mkdir()
    os.chown(ws, *OWNER)
    Sandbox.create(tier=tier_name, workspace=str(ws)).kill()  # what the first sandbox starts for good
    fds_before, threads_before = owner_counts()
    with Sandbox.create(tier=tier_name, workspace=str(ws), disk=str(DISK), memory="256M") as sb:
        assert sb.commands.run("mkdir bg", cwd="/workspace").exit_code == 0
        exits, started = {}, time.monotonic()
        for i in range(count):
            if i == 20:
                fds_warm, threads_warm = owner_counts()
            command, timeout = session_step(i)
            r = sb.commands.run(command, cwd="/workspace", timeout=timeout)
            exits[i % 10] = (r.exit_code, r.timed_out)
        assert exits[0][1] and exits[1][0] != 0 and exits[3][0] == 3 and exits[4] == (0, False), exits
        fds_end, threads_end = owner_counts()
        print(f"{count} commands in {time.monotonic() - started:.2f} s")
        backgrounds = " ".join(f"bg/done-{i}" for i in range(count) if i % 10 == 2)
        r = sb.commands.run(f"for f in {backgrounds}; do while [ ! -e $f ]; do sleep 0.01; done; done",
                            cwd="/workspace", timeout=20)
        assert r.exit_code == 0, r.stderr
        r = sb.commands.run(["python3", "-c", "open('last', 'w').write('last')\n" + LISTING], cwd="/workspace")
        assert r.exit_code == 0, r.stderr
        inside = json.loads(r.stdout)
        sandbox_id = sb.id
        # the cgroup leaves of finished commands go (their background processes have ended)
        kill_group = cgroups.detect().kill_root / cgroups.PARENT / sandbox_id
        leaves = [p.name for p in kill_group.iterdir() if p.is_dir()] if kill_group.is_dir() else []
        print(f"{tier_name}: {len(leaves)} cgroup leaves after {count} commands")
        assert len(leaves) <= 4, leaves
    print(f"{tier_name}: owner fds {fds_before} -> {fds_warm} -> {fds_end} -> {len(os.listdir('/proc/self/fd'))}, "
          f"threads {threads_before} -> {threads_warm} -> {threads_end} -> {threading.active_count()}")
    assert (ws / "last").read_text() == "last"
    assert len(inside) > 20 and host_listing(ws) == inside
    assert all(p.lstat().st_uid == OWNER[0] for p in ws.rglob("*"))
    # the owner holds no more per command: a few descriptors and threads of slack, not one per command
    assert fds_end - fds_warm <= 4 and threads_end - threads_warm <= 2, (fds_warm, fds_end, threads_warm, threads_end)
    deadline = time.monotonic() + 5  # the sandbox's own threads end as it goes
    while owner_counts()[1] > threads_before and time.monotonic() < deadline:
        time.sleep(0.01)
    fds_after, threads_after = owner_counts()
    assert fds_after <= fds_before and threads_after <= threads_before, (fds_before, fds_after, threads_after)
    assert sandbox_leftovers(sandbox_id, state_dir) == []


#: creates a sandbox on the workspace and runs one command that writes a large file; its
#: write-back is where the test kills this process
WRITER = """
import sys
from corral import Sandbox
sb = Sandbox.create(workspace=sys.argv[1], memory="256M")
print(sb.id, flush=True)
sb.commands.run("head -c 600M /dev/zero > /workspace/big", timeout=120)
print("written back", flush=True)
"""


def test_an_owner_killed_during_a_write_back_leaves_no_partial_file_in_the_users_directory(
        tmp_path: Path, state_dir: Path) -> None:
    """A file is copied into the user's directory under a name only once it is whole and the
    user's: before, an owner killed mid-copy left ``.corral-tmp-PID-big``, partial and root's
    (0600), for good (gc did not know it, later write-backs skipped other pids' names)."""
    import subprocess
    import sys

    workspace = tmp_path / "ws"
    workspace.mkdir()
    owner = subprocess.Popen([sys.executable, "-c", WRITER, str(workspace)], stdout=subprocess.PIPE, text=True)
    killed_mid_copy = False
    try:
        assert owner.stdout is not None
        sandbox_id = owner.stdout.readline().strip()
        deadline = time.monotonic() + 120
        while owner.poll() is None and time.monotonic() < deadline:
            try:  # the copy's file, named or not, open in the owner and in the user's directory
                held = [os.readlink(f"/proc/{owner.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{owner.pid}/fd")]
            except OSError:
                held = []
            if any(path.startswith(f"{workspace}/") for path in held):
                owner.kill()
                killed_mid_copy = True
                break
            time.sleep(0.002)
    finally:
        owner.kill()
        owner.wait()
    assert killed_mid_copy, "the owner was not seen copying"
    subprocess.run([sys.executable, "-m", "corral.cli", "gc"], check=True, capture_output=True, timeout=120)
    assert sandbox_leftovers(sandbox_id, state_dir) == []
    left = sorted(os.listdir(workspace))
    assert left in ([], ["big"]), left  # nothing, or the whole file (killed between its link and rename)
    if left:
        assert (workspace / "big").stat().st_size == 600 << 20
