"""What a sandbox can learn of the host's and other sandboxes' activity through files they share.

The process tier's ``/proc`` is a procfs of the host's kernel: its host-wide files were the
host's, live and alike in every sandbox -- every tenant's interrupts per CPU and device, forks,
pressure stalls to the microsecond, page allocator and disk counters (timing channels between
tenants) and the host kernel's command line.  Those are now empty files of the sandbox's own,
or the host's lines with every count 0 (``stat``, ``vmstat``).

inotify reports every open, read and write of a watched inode, whoever makes it.  The process
tier's ``/dev/null``, ``/dev/urandom``, ``/dev/tty``... were the host's own nodes (bwrap's ``--dev``
binds them) and ``/.corral/agent`` the one binary every sandbox execs: a sandbox watching them
saw the host's and every other tenant's use of them (50 host writes to ``/dev/null`` were 52
``IN_MODIFY`` inside; another sandbox starting was an ``IN_OPEN`` of the agent).  Now the
devices are nodes of the sandbox's own and the agent can be run but not read there.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

import pytest

from corral import Sandbox

from .tier_probe import skip_unless_tier

WATCHED = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")

#: watches the devices until /tmp/stop appears, then uses /dev/null itself (the watch works);
#: prints {path: events} and the errno of a watch on the agent's binary
WATCHER = r"""
import ctypes, errno, json, os, select, struct, time
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(os.O_NONBLOCK)
IN_ACCESS, IN_MODIFY, IN_OPEN = 1, 2, 0x20
names, unwatched = {}, []
for path in WATCHED_PATHS:
    wd = libc.inotify_add_watch(fd, path.encode(), IN_ACCESS | IN_MODIFY | IN_OPEN)
    if wd < 0:
        unwatched.append(path)
    else:
        names[wd] = path
agent = libc.inotify_add_watch(fd, b"/.corral/agent", IN_ACCESS | IN_OPEN)
agent_errno = "ok" if agent >= 0 else errno.errorcode[ctypes.get_errno()]
seen = {path: 0 for path in names.values()}

def drain(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not select.select([fd], [], [], 0.1)[0]:
            continue
        data, at = os.read(fd, 65536), 0
        while at < len(data):
            wd, _, _, size = struct.unpack_from("iIII", data, at)
            at += 16 + size
            seen[names.get(wd, "/.corral/agent")] = seen.get(names.get(wd, "/.corral/agent"), 0) + 1

open("/tmp/ready", "w").close()
deadline = time.monotonic() + 60
while not os.path.exists("/tmp/stop") and time.monotonic() < deadline:
    drain(0.2)
outside = dict(seen)
with open("/dev/null", "w") as null:
    null.write("own")
drain(0.5)
print(json.dumps({"outside": outside, "own_null": seen["/dev/null"] - outside["/dev/null"], "agent": agent_errno,
                  "unwatched": unwatched}))
""".replace("WATCHED_PATHS", repr(WATCHED))


def _wait_for(sb: Sandbox, path: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not sb.files.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def watch_devices(sb: Sandbox, tier: str, user: str) -> None:
    """WATCHER inside as ``user`` while the host uses the devices and another sandbox starts and
    uses them: it sees only the sandbox's own use (also checked after the long session of
    test_session_containment.py)."""
    sb.files.write("/tmp/watch.py", WATCHER)
    watcher = sb.commands.run("python3 /tmp/watch.py", background=True, user=user, timeout=90)
    _wait_for(sb, "/tmp/ready")
    for _ in range(50):
        with open("/dev/null", "w") as null:
            null.write("x")
    for _ in range(20):
        with open("/dev/urandom", "rb") as urandom:
            urandom.read(16)
    with Sandbox.create(tier=tier) as other:
        assert other.commands.run("echo x > /dev/null; head -c 16 /dev/urandom | wc -c").stdout == "16\n"
    sb.files.write("/tmp/stop", "")
    result = watcher.wait()
    assert result.exit_code == 0, (user, result)
    seen = json.loads(result.stdout)
    assert seen["unwatched"] == [], (user, seen)
    assert seen["outside"] == dict.fromkeys(WATCHED, 0), (user, seen)
    assert seen["own_null"] >= 1, (user, seen)  # the watch works: the sandbox's own write is reported
    if tier == "process":  # the agent's binary is the host's: run, never read (gVisor's is its own copy)
        assert seen["agent"] == "EACCES", (user, seen)


@pytest.mark.parametrize("tier", ["process", "gvisor"])
@pytest.mark.parametrize("user", ["user", "root"])
def test_a_sandbox_sees_only_its_own_use_of_its_devices_and_no_other_sandbox_start(
        tier: str, user: str, state_dir: Path) -> None:
    skip_unless_tier(tier, state_dir)
    with Sandbox.create(tier=tier) as sb:
        watch_devices(sb, tier, user)


def test_the_sandboxs_own_device_nodes_are_the_devices_they_name() -> None:
    with Sandbox.create() as sb:
        assert_own_device_nodes(sb)


def assert_own_device_nodes(sb: Sandbox) -> None:
    """The process tier's own nodes work as the devices they name, and stay as they are (also
    checked after the long session of test_session_containment.py)."""
    r = sb.commands.run(
        "echo gone > /dev/null && cat /dev/null | wc -c; head -c 4 /dev/zero | od -An -tx1; "
        "head -c 32 /dev/urandom | wc -c; head -c 8 /dev/random | wc -c; "
        "/usr/bin/printf x > /dev/full; echo full=$?; stat -c '%t:%T %a' /dev/null /dev/zero /dev/full /dev/tty")
    lines = r.stdout.splitlines()
    assert lines[:4] == ["0", " 00 00 00 00", "32", "8"], r
    assert "No space left on device" in r.stderr and "full=1" in lines, r
    host = [f"{os.major(os.stat(p).st_rdev):x}:{os.minor(os.stat(p).st_rdev):x} 666"
            for p in ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty")]
    assert lines[5:9] == host, r
    assert sb.commands.run("cat /.corral/agent > /dev/null").exit_code != 0  # exec-only
    # /dev is the sandbox's own tmpfs, its terminals and its shared memory: no node of the host's
    # is even underneath (bwrap's --dev bound them, and the sandbox's own over them)
    dev_mounts = [line.split(" - ")[0].split()[4] + " " + line.split(" - ")[1].split()[0]
                  for line in sb.commands.run("cat /proc/self/mountinfo").stdout.splitlines()
                  if line.split()[4].startswith("/dev")]
    assert dev_mounts == ["/dev tmpfs", "/dev/pts devpts", "/dev/shm tmpfs"], dev_mounts
    # the nodes cannot be changed or replaced, even by root
    r = sb.commands.run("chmod 600 /dev/null; rm -f /dev/null; mknod /tmp/n c 1 3; ls -l /dev/null",
                        user="root")
    assert "crw-rw-rw-" in r.stdout and r.exit_code == 0, r


#: what each masked /proc entry holds inside (bytes; a directory: its entries), as the user and
#: as root, and what writing to it and unmounting it did; then the tools that read the host-wide
#: files left (stat, meminfo, loadavg, uptime) still work
READ_MASKS = r"""
for f in NAMES; do
  if [ -d /proc/$f ]; then printf '%s=%s ' $f "$(ls -A /proc/$f | wc -l)"; else printf '%s=%s ' $f "$(cat /proc/$f | wc -c)"; fi
done
echo
echo x 2>/dev/null > /proc/cmdline && echo wrote || echo refused
"""


#: root's tries to take a mask away, by syscall (errno names; MNT_DETACH = 2, MS_BIND = 4096)
UNMASK = r"""
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
def tried(result):
    print(errno.errorcode[ctypes.get_errno()] if result else "done")
tried(libc.umount2(b"/proc/interrupts", 0))
tried(libc.umount2(b"/proc/cmdline", 2))
tried(libc.mount(b"/proc/self/status", b"/proc/cmdline", None, 4096, None))
tried(libc.mount(b"proc", b"/mnt", b"proc", 0, None))
"""


def assert_hosts_proc_counters_masked(sb: Sandbox) -> None:
    """The process tier's masked ``/proc`` entries are empty, for the user and root, and stay so
    (also checked after the long session of test_session_containment.py)."""
    from corral.tiers.linux.rootfs import MASKED_PROC_DIRS, MASKED_PROC_FILES, QUIET_PROC_FILES

    names = [name for name in MASKED_PROC_FILES + MASKED_PROC_DIRS if os.path.exists(f"/proc/{name}")]
    # the host's are not empty (the check below can fail): the counters, its command line
    assert all(os.listdir(f"/proc/{n}") if os.path.isdir(f"/proc/{n}") else Path(f"/proc/{n}").read_bytes()
               for n in names), names
    assert {"cmdline", "interrupts"} <= set(names)
    script = READ_MASKS.replace("NAMES", " ".join(names))
    empty = " ".join(f"{name}=0" for name in names) + " "
    for user in ("user", "root"):
        r = sb.commands.run(script, user=user)
        assert r.stdout.splitlines() == [empty, "refused"], (user, r)
    # root can neither unmount a mask nor mount over one, and the masks stay empty
    r = sb.commands.run("python3 -c " + shlex.quote(UNMASK), user="root")
    assert r.stdout.split() == ["EPERM"] * 4, r
    assert sb.commands.run(script, user="root").stdout.splitlines() == [empty, "refused"]
    # stat and vmstat: the host's lines, every count 0 but the boot time (the host's: a disk write
    # there, or another sandbox's forks, moved intr and processes)
    for name in QUIET_PROC_FILES:
        inside = sb.commands.run(f"cat /proc/{name}").stdout.splitlines()
        host = Path(f"/proc/{name}").read_text().splitlines()
        assert [line.split()[0] for line in inside] == [line.split()[0] for line in host], (name, inside)
        counts = {line.split()[0]: line.split()[1:] for line in inside}
        assert counts.pop("btime", None) == next((line.split()[1:] for line in host if line.startswith("btime")), None)
        assert counts.pop("procs_running", ["1"]) == ["1"]
        assert all(value == "0" for values in counts.values() for value in values), (name, inside)
    # what ps, top, free, uptime and vmstat read is there, and they work
    r = sb.commands.run("ps -e -o pid=,comm= | head -1; free -m | head -2 | tail -1; uptime; top -bn1 | head -1; "
                        "grep -c ^cpu /proc/stat; vmstat 1 1 | tail -1; python3 -c 'import os; print(os.cpu_count())'")
    assert r.exit_code == 0 and r.stderr == "", r
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["1", "agent"] and lines[1].startswith("Mem:"), r
    assert "load average" in lines[2] and lines[3].startswith("top - "), r
    assert int(lines[4]) == 1 + (os.cpu_count() or 1) and lines[5].split()[:2] == ["1", "0"], r
    assert lines[6] == str(os.cpu_count()), r


@pytest.mark.parametrize("user", ["user", "root"])
def test_the_process_tiers_proc_shows_no_host_wide_counter_nor_the_hosts_command_line(user: str) -> None:
    with Sandbox.create(user=user) as sb:
        assert_hosts_proc_counters_masked(sb)
