"""The walls hold for root inside too (issue 13): each check runs as the sandbox user and as
``user="root"``, on the process, gVisor and microVM tiers.

Root inside holds ROOT_CAPS in the sandbox's own user namespace only: no CAP_SYS_ADMIN,
CAP_SYS_MODULE, CAP_SYSLOG, CAP_MKNOD, CAP_SYS_CHROOT..., and the seccomp filter (process
tier, and gVisor's, loaded into its kernel) is the one the sandbox user has.  gVisor answers a
few of these from its own kernel (its own dmesg, its own netstack's sysctls): what is checked
there is that nothing reaches the host's.  In a microVM, ``user="root"`` is root of the guest's
own kernel: it may mount, set the guest's hostname and sysctls, make device nodes, even end its
own VM (``kill -9 -1`` reaches the guest's agent); what is checked is that none of it reaches the
host or a neighbour.  The guest's uid 1000 is refused all of it by that kernel.

Cost: 4 sandboxes (and 4 neighbours), ~8 s on a loaded 2-core machine; the microVM's 2 (and 2
neighbours) ~20 s more under TCG.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox, SandboxError

from .tier_probe import skip_unless_tier

#: the first runsc whose /proc checks another user's access to a process (google/gvisor 561ff6d,
#: "proc: fix security checks on /proc/pid files", 2025-12-08): before it, /proc/PID/environ and
#: maps were 0444 with no ptrace check and /proc/PID/fd 0555 with links any user could follow
RUNSC_PROC_CHECKED = 20251208

CASES = [(tier, user) for tier in ("process", "gvisor", "microvm") for user in ("user", "root")]

#: (what, command): each must fail wherever it runs
DENIED = {
    "mount tmpfs": "mount -t tmpfs none /mnt",
    "mount cgroup (release_agent)": "mount -t cgroup -o memory none /mnt",
    "write a release_agent": "echo /x > /sys/fs/cgroup/memory/release_agent",
    "unshare mount ns": "unshare -m true",
    "unshare net ns": "unshare -n true",
    # in gVisor too: its kernel made one, whose capabilities reached the sandbox's own network
    "unshare user ns": "unshare -U true",
    "write a kernel sysctl": "echo c13 > /proc/sys/kernel/hostname",
    "sysctl -w": "sysctl -w kernel.domainname=c13",
    "read /dev/kmsg": "head -c1 /dev/kmsg",
    "mknod a disk": "mknod /tmp/c13dev b 8 0",
    "chroot": "chroot / true",
    "sethostname": "hostname c13",
    "ptrace pid 1": "python3 -c 'import ctypes,sys; sys.exit(ctypes.CDLL(None).ptrace(16, 1, 0, 0) != 0)'",
    "bpf": "python3 -c 'import ctypes,sys; sys.exit(ctypes.CDLL(None).syscall(321, 0, 0, 0) < 0)'",
    "add a network link": "ip link add c13x type veth peer name c13y",
    "sysrq": "echo c > /proc/sysrq-trigger",
    "read the agent memory": "head -c1 /proc/1/mem",
}
#: the agent's protocol pipes: gVisor lets root of its namespace open another root process's
#: descriptors (no dumpable check there); what it could send, the host does not trust anyway
AGENT_PIPES = {"open the agent pipes": "sh -c 'exec 3>/proc/1/fd/1'"}
#: what the process tier (the host kernel, behind seccomp) refuses and gVisor's own kernel answers
DENIED_ON_THE_HOST_KERNEL = {
    "dmesg (syslog)": "dmesg",
    "read the agent environment": "cat /proc/1/environ",  # gVisor shows it (it holds only PATH)
}
#: guest root in a microVM: root of the guest's own kernel, whose answers stay the guest's
GUEST_ROOT = ("mount -t tmpfs none /mnt && hostname c13 && sysctl -qw kernel.domainname=c13 && "
              "echo 1 > /proc/sys/net/ipv4/ip_forward && mknod /tmp/c13dev b 8 0 && unshare -m true && "
              "dmesg >/dev/null && hostname && cat /proc/sys/kernel/domainname")
HOST_STATE = ("/proc/sys/kernel/hostname", "/proc/sys/kernel/domainname", "/proc/sys/net/ipv4/ip_forward")


def _host_state() -> list[str]:
    return [Path(p).read_text() for p in HOST_STATE]


@pytest.fixture(scope="module", params=CASES, ids=[f"{t}-{u}" for t, u in CASES])
def case(request: pytest.FixtureRequest, state_dir: Path) -> Iterator[tuple[Sandbox, str, str]]:
    tier, user = request.param
    if tier != "process":
        skip_unless_tier(tier, state_dir)
    sb = Sandbox.create(tier=tier, user=user, memory="256M")
    try:
        assert sb.commands.run("id -u").stdout == ("0\n" if user == "root" else "1000\n")
        yield sb, tier, user
    finally:
        sb.kill()


def test_privileged_operations_are_refused(case: tuple[Sandbox, str, str]) -> None:
    sb, tier, user = case
    host_state = _host_state()
    if (tier, user) == ("microvm", "root"):
        # root of its own kernel: allowed there, and the host's hostname, sysctls, links are untouched
        r = sb.commands.run(GUEST_ROOT)
        assert r.stdout == "c13\nc13\n", r
        assert _host_state() == host_state
        assert subprocess.run(["ip", "link", "show", "c13x"], capture_output=True).returncode != 0
        return
    checks = {**DENIED, **(DENIED_ON_THE_HOST_KERNEL if tier != "gvisor" else {}),
              **(AGENT_PIPES if (tier, user) != ("gvisor", "root") else {})}
    if tier == "microvm":
        # the guest's kernel lets an unprivileged user make a user namespace (bwrap, browsers'
        # sandboxes use it); its root has nothing over the guest, and the guest kernel is not the host's
        del checks["unshare user ns"]
    script = "".join(f"if ( {cmd} ) >/dev/null 2>&1; then echo 'ALLOWED: {what}'; fi\n" for what, cmd in checks.items())
    host_before = Path("/proc/sys/kernel/hostname").read_text(), Path("/proc/sys/net/ipv4/ip_forward").read_text()
    r = sb.commands.run(script + "echo done")
    assert r.stdout == "done\n", r.stdout
    # the allowed direction: the same shell runs ordinary commands, and gVisor's own answers stay its own
    assert sb.commands.run("echo 1 > /proc/sys/net/ipv4/ip_forward; dmesg; true; echo ok").stdout.endswith("ok\n")
    assert (Path("/proc/sys/kernel/hostname").read_text(), Path("/proc/sys/net/ipv4/ip_forward").read_text()) \
        == host_before


def test_host_files_stay_invisible_and_unwritten(case: tuple[Sandbox, str, str]) -> None:
    sb, _, user = case
    canary = Path("/root/.c13-canary")
    canary.write_text("C13-TOPSECRET")
    try:
        r = sb.commands.run("cat /root/.c13-canary; cat /etc/shadow; ls -a /root /work; "
                            "echo x > /etc/c13-written; echo done")
        assert "C13-TOPSECRET" not in r.stdout + r.stderr and r.stdout.endswith("done\n")
        assert sb.commands.run("test -e /root/.c13-canary || test -e /work").exit_code == 1
        assert not Path("/etc/c13-written").exists()
        # root's write lands in the sandbox's own /etc (the allowed direction), the user's is refused
        wrote = sb.commands.run("cat /etc/c13-written").stdout
        assert wrote == ("x\n" if user == "root" else "")
    finally:
        canary.unlink()


def _runsc_checks_proc() -> bool:
    from corral.tiers.gvisor.platform import runsc_binary, runsc_version
    return runsc_version(runsc_binary()) >= RUNSC_PROC_CHECKED


# (before the neighbours' test: in a microVM, guest root's `kill -9 -1` there ends the sandbox)
def test_the_users_commands_cannot_read_a_root_commands_environment_or_descriptors(
        case: tuple[Sandbox, str, str], request: pytest.FixtureRequest) -> None:
    """What the owner hands a root command (``env=``, the files it opens) is root's: the default
    user's commands, running beside it, read neither (the host kernel and a guest's kernel check
    ptrace access to /proc/PID/environ, maps and fd; gVisor before 20251208 does not)."""
    sb, tier, _ = case
    if tier == "gvisor" and not _runsc_checks_proc():
        request.applymarker(pytest.mark.xfail(
            strict=True, reason=f"runsc before {RUNSC_PROC_CHECKED} shows /proc/PID/environ, maps and fd "
                                "to every user (fixed upstream in google/gvisor 561ff6d)"))
    up = threading.Event()
    root = sb.commands.start("umask 077; echo c13 > /tmp/c13-root-only; exec 7</tmp/c13-root-only; echo up; exec sleep 60", user="root",
                             env={"C13_ROOT_SECRET": "s3cr3t-c13"}, timeout=120, on_stdout=lambda _: up.set())
    try:
        assert up.wait(30), "the root command did not start"
        r = sb.commands.run(
            "for p in /proc/[0-9]*; do "
            "  tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -q C13_ROOT_SECRET && echo environ:$p; "
            "  ls -l $p/fd 2>/dev/null | grep -q c13-root-only && echo fd:$p; "
            "  head -c 1 $p/fd/7 >/dev/null 2>&1 && echo opened:$p; "
            "done; echo scanned", user="user")
        assert r.stdout.endswith("scanned\n"), r
        assert r.stdout == "scanned\n", f"the default user read root's: {r.stdout.split()}"
        # the allowed direction: root sees its own command's environment
        seen = sb.commands.run("grep -lz C13_ROOT_SECRET /proc/[0-9]*/environ 2>/dev/null | head -1",
                               user="root")
        assert seen.stdout.startswith("/proc/"), seen
    finally:
        root.kill()


def test_neighbours_and_host_processes_are_out_of_reach(case: tuple[Sandbox, str, str]) -> None:
    sb, tier, user = case
    # long enough to outlast a neighbour VM's template boot and guest root's 30 s `kill -9 -1` wait
    # under load: a sleep that ends by itself would look killed-from-inside (exit 0 after 60 s did)
    victim = subprocess.Popen(["sleep", "3600"])
    neighbour = Sandbox.create(tier=tier, user=user, memory="256M")
    # guest root's `kill -9 -1` reaches the guest's agent (not pid 1 there): it ends its own VM, last
    vm_root = (tier, user) == ("microvm", "root")
    try:
        # killed below; its timeout (60 s by default, and a command nobody waits for ends at it)
        # outlasts any wait here
        other = neighbour.commands.start("exec sleep 3600", timeout=3600)
        r = sb.commands.run(f"kill -9 {victim.pid}; {'' if vm_root else 'kill -9 -1;'} "
                            "ls /proc | grep -cE '^[0-9]+$'; echo done")
        # (a guest's /proc lists its own kernel's threads too)
        assert r.stdout.endswith("done\n") and int(r.stdout.split()[-2]) < (200 if tier == "microvm" else 20), r
        assert "No such process" in r.stderr, r.stderr  # the host's pid names nothing inside
        if vm_root:
            with contextlib.suppress(SandboxError):
                sb.commands.run("kill -9 -1", timeout=10)  # the agent dies: no answer comes
        assert victim.poll() is None, f"the host process ended ({victim.returncode}): reached from inside"
        assert not other.done, "the neighbour's command survived"
        assert neighbour.commands.run("echo alive").stdout == "alive\n"
        other.kill()
        other.wait()
    finally:
        neighbour.kill()
        victim.kill()
        victim.wait()
    # the sandbox itself is fine after its own `kill -9 -1` (the agent is outside its reach too)
    if not vm_root:
        assert sb.commands.run("echo still").stdout == "still\n"
    assert os.path.exists(f"/proc/{os.getpid()}")

