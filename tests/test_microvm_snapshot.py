"""Live snapshots, forks and pause-to-disk of microVM sandboxes (issue 18).

A microVM's snapshot is its whole live state: a Python process holding a value in memory keeps
it in every VM made from the snapshot, while each of them gets a fresh identity (boot id, RNG,
hostname, machine id) and its own copy of the workspace; the original runs on unchanged.  Bad
input is a typed error that leaves nothing half-made.

Each VM costs seconds of TCG time on a shared machine: the checks share few VMs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import (
    FileError,
    InvalidSpec,
    InvalidState,
    ResourceLimit,
    Sandbox,
    SandboxNotFound,
    SandboxPaused,
    Snapshot,
    SnapshotCorrupt,
    SnapshotNotFound,
    parked,
)
from corral.host import cgroups
from corral.registry import Registry, gc
from corral.snapshots import DIRECTORY, SnapshotStore

from .leaks import sandbox_leftovers
from .memory_groups import usage
from .sandbox_wait import wait_until
from .server_fixtures import KEYS, ServerProcess
from .test_microvm import STOP_THE_AGENT
from .tier_probe import skip_unless_tier

#: a long-lived Python process (working directory /tmp: /workspace is unmounted for a moment
#: while a snapshot is taken) holding a value only in its memory, answering on a Unix socket
HOLDER = r"""
import os, socket
value = os.urandom(16).hex()
server = socket.socket(socket.AF_UNIX)
server.bind("/tmp/vs-holder.sock")
server.listen()
while True:
    conn, _ = server.accept()
    conn.send(f"{value} {os.urandom(32).hex()} {os.getpid()}".encode())
    conn.close()
"""
#: what a VM says: the holder's value, its fresh random bytes and pid; then from a new process:
#: boot id, 32 random bytes, hostname, machine id, the workspace's file
ASK = r"""
import os, socket, time
for _ in range(600):
    try:
        conn = socket.socket(socket.AF_UNIX)
        conn.connect("/tmp/vs-holder.sock")
        break
    except OSError as exc:
        why = exc
        time.sleep(0.05)
else:
    raise SystemExit(f"the holder did not answer in 30 s: {why}")
print(conn.recv(300).decode())
print(open("/proc/sys/kernel/random/boot_id").read().strip(), os.urandom(32).hex(), socket.gethostname(),
      open("/etc/machine-id").read().strip(), open("/workspace/w.txt").read())
"""


@pytest.fixture(scope="module", autouse=True)
def _microvm_available(state_dir: Path) -> None:
    skip_unless_tier("microvm", state_dir)


@pytest.fixture(scope="module")
def parent() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(tier="microvm", memory="256M")
    try:
        sandbox.files.write("/workspace/w.txt", "parent-file")
        sandbox.commands.run(["python3", "-c", HOLDER], cwd="/tmp", background=True)
        yield sandbox
    finally:
        sandbox.kill()


def state_of(sb: Sandbox) -> dict[str, str]:
    result = sb.commands.run(["python3", "-c", ASK], cwd="/")
    assert result.exit_code == 0, result
    held, fresh = result.stdout.splitlines()
    value, held_random, pid = held.split()
    boot_id, random, hostname, machine_id, ws = fresh.split()
    return {"value": value, "held_random": held_random, "pid": pid, "boot_id": boot_id, "random": random,
            "hostname": hostname, "machine_id": machine_id, "ws": ws}


def test_snapshot_and_forks_keep_memory_and_processes_with_a_fresh_identity(parent: Sandbox, state_dir: Path) -> None:
    before = state_of(parent)
    parent.pause()
    parent.resume()
    assert state_of(parent)["value"] == before["value"]

    # a command streaming output when the snapshot is taken: the copies' agents may send the
    # rest of what it wrote, which their hosts drop before their first answer
    noisy = parent.commands.run(["sh", "-c", "for i in $(seq 8); do head -c 60000 /dev/zero | tr '\\0' x; sleep 0.05; done"],
                                cwd="/tmp", background=True)
    # taken by a thread that ends at once: what is left to write (the converter QEMU saving the
    # device state, the memory image) outlives it
    taken: list[Snapshot] = []
    taker = threading.Thread(target=lambda: taken.append(parent.snapshot()))
    taker.start()
    taker.join()
    [snap] = taken
    assert (snap.kind, snap.tier) == ("live", "microvm") and snap.size > 0 and snap.written > 0
    # (3 > MicroVMTier.direct_forks: through a snapshot whose memory image the forks share; it
    # waits for the first snapshot's memory image to be written)
    forks = parent.fork(3)
    whole = SnapshotStore(state_dir).whole(snap.id)  # returned before its memory image was on disk:
    assert 0 < whole.written <= snap.written and whole.size <= snap.size  # upper bounds until then
    assert "writing" not in json.loads((state_dir / DIRECTORY / snap.id / "meta.json").read_text())
    noisy.kill()
    try:
        seen = [state_of(fork) for fork in forks]
        after = state_of(parent)
        # the parent runs on unchanged: same process, same value, same identity, its workspace back
        for key in ("value", "pid", "boot_id", "hostname", "machine_id", "ws"):
            assert after[key] == before[key], key
        for state, fork in zip(seen, forks, strict=True):
            assert (state["value"], state["pid"], state["ws"]) == (before["value"], before["pid"], "parent-file")
            assert state["hostname"] == fork.id
        # no two of them share random numbers, boot id or machine id (the parent included)
        for key in ("boot_id", "random", "held_random", "hostname", "machine_id"):
            values = [before[key], *(state[key] for state in seen)]
            assert len(set(values)) == 4, (key, values)
        # each fork's workspace is its own copy
        forks[0].files.write("/workspace/w.txt", "fork-0")
        assert parent.files.read("/workspace/w.txt") == "parent-file"
        assert forks[1].files.read("/workspace/w.txt") == "parent-file"
        # a fork can be forked (its boot id mount is replaced, not stacked), and commands run on
        with Sandbox.create(snapshot=snap.id) as again:
            assert state_of(again)["value"] == before["value"]
            assert again.commands.run("echo ok").stdout == "ok\n"
    finally:
        for fork in forks:
            fork.kill()
        Sandbox.delete_snapshot(snap.id)
    assert all(not sandbox_leftovers(fork.id, state_dir) for fork in forks)


def test_bad_input_is_a_typed_error_that_starts_nothing(parent: Sandbox, state_dir: Path) -> None:
    with pytest.raises(InvalidState, match="not paused"):
        parent.resume()
    # a process working in /workspace keeps it busy: refused, naming it, and nothing changes
    busy = parent.commands.run(["sleep", "600"], cwd="/workspace", background=True)
    running = (f'for i in $(seq 200); do [ "$(cat /proc/{busy.pid}/comm)" = sleep ] && exit 0; sleep 0.05; done;'
               ' exit 1')
    assert parent.commands.run(running, cwd="/").exit_code == 0
    with pytest.raises(InvalidState, match=r"sleep.*working directory"):
        parent.snapshot()
    busy.kill()
    busy.wait()
    assert parent.files.read("/workspace/w.txt") == "parent-file"
    assert not [p for p in (state_dir / DIRECTORY).iterdir() if p.name.startswith(".")]

    snap = parent.snapshot()
    with pytest.raises(InvalidSpec, match="network"):
        Sandbox.create(snapshot=snap.id, network="allow")
    before = {row.id for row in Registry.at(state_dir).rows()} | set(os.listdir(state_dir / "sandboxes"))
    vm = state_dir / DIRECTORY / snap.id / "vm"
    state = (vm / "state").read_bytes()
    (vm / "state").write_bytes(state[:-1] + bytes([state[-1] ^ 1]))
    with pytest.raises(SnapshotCorrupt, match="state"):
        Sandbox.create(snapshot=snap.id)
    (vm / "state").write_bytes(state)
    # the memory image: flipped (a copy, so its inode and times change as a restore's would)
    ram = bytearray((vm / "ram").read_bytes())
    ram[len(ram) // 2] ^= 1
    (vm / "ram").unlink()
    (vm / "ram").write_bytes(bytes(ram))
    with pytest.raises(SnapshotCorrupt, match="memory"):
        Sandbox.create(snapshot=snap.id)
    with open(vm / "ram", "r+b") as f:
        f.truncate(4096)
    with pytest.raises(SnapshotCorrupt, match="memory"):
        Sandbox.create(snapshot=snap.id)
    after = {row.id for row in Registry.at(state_dir).rows()} | set(os.listdir(state_dir / "sandboxes"))
    assert after == before
    # the CLI lists it as a live snapshot and removes it
    corral = [sys.executable, "-m", "corral.cli"]
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_URL"}
    listed = subprocess.run([*corral, "snapshot", "ls", "--json"], capture_output=True, text=True, env=env, check=True)
    assert [(s["kind"], s["tier"]) for s in json.loads(listed.stdout) if s["id"] == snap.id] == [("live", "microvm")]
    removed = subprocess.run([*corral, "snapshot", "rm", snap.id], capture_output=True, text=True, env=env)
    assert (removed.returncode, removed.stdout) == (0, snap.id + "\n")
    assert not (state_dir / DIRECTORY / snap.id).exists()


def test_a_fork_loads_the_running_vm_into_memory_of_its_own_and_a_failed_one_leaves_nothing(
        parent: Sandbox, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import corral.local_transport as local

    made: list[str] = []
    new_id = local.new_sandbox_id
    monkeypatch.setattr(local, "new_sandbox_id", lambda: made.append(new_id()) or made[-1])
    store = state_dir / DIRECTORY
    stored = sorted(os.listdir(store)) if store.is_dir() else []
    # 96 MiB the parent wrote (its root is in guest RAM): in no template or snapshot file
    big = ["python3", "-c", "open('/tmp/vf-big', 'wb').write(b'x' * (96 << 20))"]
    assert parent.commands.run(big, cwd="/").exit_code == 0
    kids = parent.fork(2)  # (the stream copied to both)
    try:
        for kid in kids:
            qemu = kid._inner.qemu_pid()  # type: ignore[attr-defined]  # the real VM behind the API
            ram = kid._inner.ram_mb << 20  # type: ignore[attr-defined]
            spans = [line.split() for line in Path(f"/proc/{qemu}/maps").read_text().splitlines()]
            [guest] = [f for f in spans if (lambda lo, hi: int(hi, 16) - int(lo, 16))(*f[0].split("-")) == ram]
            assert guest[4] == "0", guest  # guest RAM is QEMU's own (anonymous), no file's copy-on-write
            # ... so charged to the fork's own host cgroup: the 96 MiB and the rest the guest holds
            assert kid._inner.cgroup.memory_usage() >= (96 + 64) << 20  # type: ignore[attr-defined]
            assert kid.commands.run("wc -c < /tmp/vf-big").stdout.strip() == str(96 << 20)
    finally:
        for kid in kids:
            kid.kill()
        parent.commands.run(["rm", "-f", "/tmp/vf-big"])
    assert (sorted(os.listdir(store)) if store.is_dir() else []) == stored  # nothing stored on the way
    assert all(not sandbox_leftovers(kid.id, state_dir) for kid in kids)

    # a process working in /workspace keeps it busy: the fork is refused, naming it; the forks
    # already starting (their QEMUs wait for the stream) are gone, the parent runs on unchanged
    busy = parent.commands.run(["sleep", "600"], cwd="/workspace", background=True)
    running = (f'for i in $(seq 200); do [ "$(cat /proc/{busy.pid}/comm)" = sleep ] && exit 0; sleep 0.05; done;'
               ' exit 1')
    assert parent.commands.run(running, cwd="/").exit_code == 0
    made.clear()
    with pytest.raises(InvalidState, match=r"sleep.*working directory"):
        parent.fork(2)
    busy.kill()
    busy.wait()
    assert len(made) == 2 and all(not sandbox_leftovers(sandbox_id, state_dir) for sandbox_id in made)
    assert parent.files.read("/workspace/w.txt") == "parent-file"
    assert parent.commands.run("echo ok").stdout == "ok\n"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_pause_to_disk_releases_the_vm_and_resumes_it_with_its_memory(parent: Sandbox, state_dir: Path) -> None:
    before = state_of(parent)
    qemu = parent._inner.qemu_pid()  # type: ignore[attr-defined]  # the real VM behind the API
    parent.pause(to_disk=True)
    assert parent.paused and parent.is_running() and not _alive(qemu)
    assert not sandbox_leftovers(parent.id, state_dir)  # nothing live: no QEMU, cgroup, mount or registry row
    with pytest.raises(SandboxPaused):
        parent.commands.run("true")
    with pytest.raises(InvalidState, match="already paused"):
        parent.pause(to_disk=True)
    assert Sandbox.list_snapshots() == []  # its state is not a snapshot of the user's
    # a damaged state: resume is a typed error that starts nothing, and the sandbox stays paused
    # (its own: a deleted snapshot earlier tests' VMs still map stays, retired, until gc)
    [saved] = [p for p in (state_dir / DIRECTORY).iterdir() if p.name.startswith("snap-")
               and json.loads((p / "meta.json").read_text()).get("parked_by") == parent.id]
    good = (saved / "vm" / "state").read_bytes()
    (saved / "vm" / "state").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(SnapshotCorrupt):
        parent.resume()
    assert parent.paused and not sandbox_leftovers(parent.id, state_dir)
    (saved / "vm" / "state").write_bytes(good)
    assert [(i.sandbox_id, i.state) for i in Sandbox.list() if i.sandbox_id == parent.id] == [(parent.id, "paused")]
    parent.resume()
    after = state_of(parent)
    # the same VM: its process and memory, and its identity (no fresh one: it is not a copy)
    for key in ("value", "pid", "boot_id", "hostname", "machine_id", "ws"):
        assert after[key] == before[key], key
    assert after["random"] != before["random"]
    # the VM maps its saved memory image: it stays counted (not listed), and gc leaves it, while it runs
    [held] = [s for s in SnapshotStore(state_dir).held_by(None) if s.id == saved.name]
    gc(state_dir)
    assert held.size > 100 << 20 and (saved / "vm" / "ram").exists()
    with Sandbox.create(tier="process") as other, pytest.raises(InvalidState, match="cannot pause to disk"):
        other.pause(to_disk=True)


def test_a_deleted_snapshot_stays_counted_while_vms_made_from_it_map_its_memory(
        parent: Sandbox, state_dir: Path) -> None:
    """Red-team probe 98: deleting a live snapshot freed 0 MB while two VMs made from it ran (they
    map its memory image; 239 MB went only when they were killed), and its tenant's quota counted
    none of it.  It is now retired: not listed nor usable, counted, kept by gc until the last VM
    made from it is gone, then removed."""
    snap = parent.snapshot()
    store = SnapshotStore(state_dir)
    kid = Sandbox.create(snapshot=snap.id)
    try:
        assert Sandbox.delete_snapshot(snap.id)
        assert snap.id not in [s.id for s in Sandbox.list_snapshots()]
        with pytest.raises(SnapshotNotFound):
            Sandbox.create(snapshot=snap.id)
        assert not Sandbox.delete_snapshot(snap.id)
        [held] = [s for s in store.held_by(None) if s.id == snap.id]
        assert held.size > 100 << 20
        gc(state_dir)
        assert (state_dir / DIRECTORY / snap.id / "vm" / "ram").exists()
        assert kid.commands.run("echo ok").stdout == "ok\n"
    finally:
        kid.kill()
    gc(state_dir)
    assert not (state_dir / DIRECTORY / snap.id).exists() and snap.id not in [s.id for s in store.held_by(None)]


def test_a_command_running_at_a_pause_to_disk_still_ends_at_its_timeout() -> None:
    """The host's side of a command goes with its parked VM (its handle ends: the sandbox
    stopped), but the command is in the VM's saved memory: after resume() it ran on with no
    timeout, no host to kill it and nothing listing it.  Now its time left is kept in the saved
    state and it is killed when that time is up (the time parked does not count)."""
    def sleeping(sb: Sandbox) -> int:
        return int(sb.commands.run("pgrep -c -x sleep || true").stdout)

    with Sandbox.create(tier="microvm", memory="256M") as sb:
        handle = sb.commands.start("sleep 1000", timeout=6, cwd="/tmp")  # (a busy /workspace cannot be saved)
        wait_until(lambda: sleeping(sb), 10, every=0.1)
        ran = time.monotonic()
        sb.pause(to_disk=True)
        parked = time.monotonic()
        assert handle.done  # the host's side of it went with the VM
        time.sleep(1.0)
        sb.resume()
        ran -= time.monotonic() - parked  # the time parked does not count
        assert sleeping(sb) == 1, "it did not run on after resume"
        wait_until(lambda: not sleeping(sb), ran + 20 - time.monotonic(), every=0.2)
        assert sleeping(sb) == 0, "a command carried over a pause to disk ran past its timeout"
        assert time.monotonic() - ran >= 5, "it was killed before its time was up"


def test_a_command_copied_into_a_fork_or_a_snapshots_sandbox_ends_at_its_timeout_there() -> None:
    """A fork, and a sandbox made from a live snapshot, hold the parent's running commands in
    their memory: there they ran on past their timeouts (nothing on the copy's host side knew
    them) and ``commands.list()`` showed nothing.  Now each copy kills a carried command when
    the time its timeout had left is up, lists it, and kills it on request (that copy's only)."""
    def sleeping(sb: Sandbox, seconds: int) -> int:
        return int(sb.commands.run(f"pgrep -c -f '^sleep {seconds}$' || true").stdout)

    timeout = 25  # room for a fork, a snapshot and a create under TCG before it is up
    with Sandbox.create(tier="microvm", memory="256M") as sb:
        short = sb.commands.start("sleep 1000", timeout=timeout, cwd="/tmp")  # (a busy /workspace cannot be saved)
        long = sb.commands.start("sleep 2000", timeout=300, cwd="/tmp")
        wait_until(lambda: sleeping(sb, 1000) and sleeping(sb, 2000), 10, every=0.1)
        started = time.monotonic()
        copies = sb.fork(1)  # straight from the running VM
        snap = sb.snapshot()
        try:
            copies.append(Sandbox.create(snapshot=snap.id))  # through the store
            assert time.monotonic() - started < timeout - 3, "too slow to tell the timeout held"
            for copy in copies:
                listed = {c.pid: c.argv for c in copy.commands.list()}
                assert short.pid in listed and long.pid in listed, listed
                assert sleeping(copy, 1000) == 1, "killed before its time was up"
            with pytest.raises(InvalidSpec, match="not waited for"):
                copies[0].commands.connect(long.pid)
            assert copies[0].commands.kill(long.pid)  # that copy's command, not the others'
            wait_until(lambda: not sleeping(copies[0], 2000), 20, every=0.2)
            assert (sleeping(copies[0], 2000), sleeping(copies[1], 2000), sleeping(sb, 2000)) == (0, 1, 1)
            assert long.pid not in [c.pid for c in copies[0].commands.list()]
            for where in (sb, *copies):
                wait_until(lambda where=where: not sleeping(where, 1000), started + timeout + 30 - time.monotonic(), every=0.5)
                assert sleeping(where, 1000) == 0, "a copied command ran past its timeout"
                assert short.pid not in [c.pid for c in where.commands.list()]
            assert short.wait().timed_out
            assert [c.pid for c in copies[1].commands.list()] == [long.pid]
        finally:
            for copy in copies:
                copy.kill()
            Sandbox.delete_snapshot(snap.id)


def test_a_copied_command_that_stops_the_copys_agent_stops_the_copy_at_its_timeout(state_dir: Path) -> None:
    """A command run as guest root can SIGSTOP the guest's agent, which writes a command's kill: the
    host then stops the VM KILL_GRACE after the kill (test_microvm.py).  A fork holds such a command
    in its memory, and its copy of the command stops the fork's agent too: the fork's kill at the
    deadline was written by that stopped agent, nothing was there to stop the VM, and the command
    ran on in the fork past its timeout for as long as the fork lived (its QEMU still running 42 s
    into a 12 s timeout, while the parent's stopped at 17 s).  Now a copied command's kill has the
    same backstop: not seen to end within KILL_GRACE, the copy's VM stops."""
    from corral.errors import SandboxClosed
    from corral.tiers.microvm import MicroVMSandbox
    from corral.tiers.microvm.sandbox import KILL_GRACE

    def qemu_alive(sb: Sandbox) -> bool:
        inner = sb._inner
        assert isinstance(inner, MicroVMSandbox)
        pid = inner.qemu_pid()
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    timeout = 15
    sb = Sandbox.create(tier="microvm", memory="256M", user="root")
    copies: list[Sandbox] = []
    try:
        handle = sb.commands.start(["sh", "-c", f"sleep 6; {STOP_THE_AGENT}; sleep 1000"],
                                   timeout=timeout, cwd="/tmp")
        started = time.monotonic()
        copies = sb.fork(1)
        copy = copies[0]
        assert time.monotonic() - started < 5, "the fork took too long to tell (its agent stops 6 s in)"
        assert handle.pid in [c.pid for c in copy.commands.list()], "the command was not carried into the fork"
        ends = started + timeout + KILL_GRACE + 20  # + TCG's slowness on a loaded machine
        wait_until(lambda: not qemu_alive(copy), ends - time.monotonic(), every=0.2)
        assert not qemu_alive(copy), (f"the fork's VM ran on {time.monotonic() - started:.0f} s after its command "
                                      f"(timeout {timeout} s) stopped its agent")
        assert time.monotonic() - started >= timeout - 1, "the fork was stopped before the command's time was up"
        begun = time.monotonic()
        with pytest.raises(SandboxClosed, match="did not confirm"):
            copy.commands.run("true", timeout=5)
        assert time.monotonic() - begun < 2, "a call on the stopped fork waited"
        assert handle.wait().timed_out  # the parent's own backstop, as before
    finally:
        for copy in copies:
            copy.kill()
        sb.kill()
    for made in (sb, *copies):
        assert sandbox_leftovers(made.id, state_dir) == []


OWNER_PARKS = """
import os
from corral import Sandbox
sb = Sandbox.create(tier="microvm", memory="256M")
sb.set_timeout(20)
sb.pause(to_disk=True)
print(sb.id, flush=True)
os._exit(0)
"""


def test_a_sandbox_paused_to_disk_is_listed_and_ends_at_its_lifetime_once_its_owner_is_gone(
        state_dir: Path) -> None:
    """Its owner gone, a sandbox paused to disk was kept past its lifetime (record and ~100 MB
    state: ``gc`` reaped nothing) and ``corral ls`` never showed it.  Now ``ls`` lists it paused,
    and ``gc`` ends it LIFETIME_GRACE after its lifetime, its saved state with it."""
    from corral.registry import LIFETIME_GRACE

    owner = subprocess.run([sys.executable, "-c", OWNER_PARKS], capture_output=True, text=True, timeout=300,
                           env=os.environ.copy())
    sandbox_id = owner.stdout.strip()
    assert owner.returncode == 0 and sandbox_id.startswith("sb-"), owner.stderr
    record = parked.load(state_dir, sandbox_id)
    assert record is not None and record.end_at is not None
    corral = [sys.executable, "-m", "corral.cli", "ls", "--json"]
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_URL"}

    def listed() -> list[tuple[str, str]]:
        out = subprocess.run(corral, capture_output=True, text=True, env=env, check=True).stdout
        return [(row["id"], row["state"]) for row in json.loads(out) if row["id"] == sandbox_id]

    def state_of_it() -> list[str]:
        return [p.name for p in (state_dir / DIRECTORY).iterdir() if p.name == record.snapshot_id]

    assert listed() == [(sandbox_id, "paused")]
    assert state_of_it() == [record.snapshot_id]
    if time.time() < record.end_at:
        assert sandbox_id not in gc(state_dir)  # within its lifetime: left alone
    time.sleep(max(0.0, record.end_at + LIFETIME_GRACE + 0.5 - time.time()))
    assert sandbox_id in gc(state_dir)
    assert parked.load(state_dir, sandbox_id) is None and state_of_it() == [] and listed() == []
    assert sandbox_id not in [i.sandbox_id for i in Sandbox.list()]
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(sandbox_id)


def test_paused_to_disk_survives_a_server_restart_and_stays_the_tenants(state_dir: Path) -> None:
    alice, bob = ({"url": "", "api_key": KEYS[who]} for who in ("alice", "bob"))
    # room for one live snapshot (~140 MB of memory image) and not two
    with ServerProcess(state_dir / "srv-vs-live", keys=KEYS, config={"max_snapshot_bytes_per_tenant": "200M",
                                                                         "max_sandboxes_per_tenant": 3}) as server:
        alice["url"] = bob["url"] = server.url
        sb = Sandbox.create(tier="microvm", memory="256M", **alice)
        sb.commands.run(["python3", "-c", HOLDER], cwd="/tmp", background=True)
        sb.files.write("/workspace/w.txt", "remote-file")
        before = state_of(sb)
        [kid] = sb.fork(1)  # through the server's fork route: straight from the VM (Sandbox.fork)
        assert state_of(kid)["value"] == before["value"]
        with pytest.raises(ResourceLimit, match="live sandboxes"):  # each fork counts: 4 > 3
            sb.fork(2)
        assert len([i for i in Sandbox.list(**alice)]) == 2
        kid.kill()
        snap = sb.snapshot()  # a live snapshot is the tenant's, as any other
        assert snap.kind == "live"
        with pytest.raises(SnapshotNotFound):
            Sandbox.create(snapshot=snap.id, **bob)
        sb.pause(to_disk=True)
        server.kill9()  # the server dies; the sandbox paused to disk held nothing live
        server.start()
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(sb.id, **bob)
        back = Sandbox.connect(sb.id, **alice)
        assert back.paused
        with pytest.raises(SandboxPaused):  # said before the quota's 429 (the tenant is near its bytes)
            back.snapshot()
        back.resume()
        after = state_of(back)
        for key in ("value", "pid", "boot_id", "ws"):
            assert after[key] == before[key], key
        with Sandbox.create(snapshot=snap.id, **alice) as child:
            assert state_of(child)["value"] == before["value"]
            # 80 MiB of the child's memory made non-zero: its memory image is then surely larger
            # than what the quota has left (a snapshot is ~100-140 MB; two of them fitted once)
            child.commands.run(["python3", "-c", "import os; b = os.urandom(80 << 20)"], cwd="/tmp")
            with pytest.raises(ResourceLimit):  # counted against the tenant's snapshot quota
                child.snapshot()
            # a fork stores no snapshot: the snapshot quota does not hold it back
            [grandchild] = child.fork(1)
            assert grandchild.commands.run("echo ok").stdout == "ok\n"
            grandchild.kill()
        back.kill()
        assert Sandbox.delete_snapshot(snap.id, **alice)
        assert not list((server.state / "parked").iterdir())


def test_gc_removes_a_saved_state_whose_pause_to_disk_never_finished(state_dir: Path) -> None:
    store = state_dir / DIRECTORY
    store.mkdir(mode=0o700, exist_ok=True)
    made = {}
    for name, owner in (("snap-00000000000000c1", "sb-00000000000000c1"), ("snap-00000000000000c2", "sb-00000000000000c2")):
        (store / name / "files").mkdir(parents=True)
        (store / name / "meta.json").write_text(f'{{"parked_by": "{owner}"}}')
        os.utime(store / name / "meta.json", (1.0, 1.0))  # written long ago
        made[name] = owner
    # the second one's sandbox was paused to disk (its record names it); the first one's never was
    parked.save(state_dir, parked.Parked("sb-00000000000000c2", "snap-00000000000000c2", {}, {}, 0.0))
    gc(state_dir)
    assert not (store / "snap-00000000000000c1").exists() and (store / "snap-00000000000000c2").exists()
    parked.remove(state_dir, "sb-00000000000000c2")
    gc(state_dir)
    assert not (store / "snap-00000000000000c2").exists()


#: an owner that takes one live snapshot whole, then starts another and is killed while its
#: converter holds the VM's memory (the test reads its sandbox id and the cgroups it left between)
OWNER_SNAPSHOTS = """
import json, sys, threading
from pathlib import Path
from corral import Sandbox
from corral.host import cgroups
work = Path(sys.argv[1])
sb = Sandbox.create(tier="microvm", memory="256M")
inner = sb._inner
for part in ("whole", "held"):
    (work / part).mkdir()
inner.snapshot(work / "whole" / "files")
print(sb.id, json.dumps(sorted(cgroups.list_sandbox_groups())), flush=True)
written, rest = inner.snapshot_begin(work / "held" / "files")
print("held", flush=True)
threading.Event().wait()
"""


def _memory_cgroup_of(pid: int) -> str:
    """The memory controller's group of ``pid`` (v1: its own line; v2: the one hierarchy's)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    v1 = [line.split(":", 2)[2] for line in lines if "memory" in line.split(":", 2)[1].split(",")]
    return v1[0] if v1 else next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))


def _processes_named(name: str) -> list[int]:
    wanted = f"\0{name}\0".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if wanted in Path(f"/proc/{entry}/cmdline").read_bytes() and _alive(int(entry)):
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_snapshots_converter_is_charged_under_the_sandboxes_parent_and_nothing_of_it_survives(
        state_dir: Path, tmp_path: Path) -> None:
    """The converter holds a copy of the guest's RAM (a 256M sandbox: 384 MiB of memfd) beside the
    VM: it ran in its owner's cgroup, outside every sandbox limit and the sandboxes' parent's.  Now
    it is in a group of its own below that parent, limited to the guest RAM and its overhead, with
    the memfd's pages charged there; the group goes with the written snapshot, and with its
    sandbox when the owner is killed while the converter runs (``gc``)."""
    from corral.host import cgroups
    from corral.tiers.microvm import converter

    owner = subprocess.Popen([sys.executable, "-c", OWNER_SNAPSHOTS, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, env=os.environ.copy())
    sandbox_id, group = "", Path("/nonexistent")
    try:
        assert owner.stdout is not None
        sandbox_id, groups_after_whole = owner.stdout.readline().split(" ", 1)
        assert sandbox_id.startswith("sb-")
        # a snapshot written whole left no group beside its sandbox's
        assert [name for name in json.loads(groups_after_whole) if name.startswith(sandbox_id)] == [sandbox_id]
        assert owner.stdout.readline().strip() == "held"
        [conv] = _processes_named(converter.converter_name(sandbox_id))
        where = _memory_cgroup_of(conv)
        assert where.startswith(f"/{cgroups.PARENT}/{sandbox_id}-"), where  # below the sandboxes' parent
        layout = cgroups.detect()
        group = layout.controllers["memory"] / where.lstrip("/")
        ram = 384 << 20  # the guest RAM of a 256M sandbox (MicroVMTier.ram_mb)
        usage, limit = ("memory.current", "memory.max") if layout.version == 2 else (
            "memory.usage_in_bytes", "memory.limit_in_bytes")
        charged = int((group / usage).read_text())
        assert charged >= ram  # the preallocated memfd, charged to its group ...
        # ... and so to the parent whose limit is what all sandboxes may use together
        assert int((layout.controllers["memory"] / cgroups.PARENT / usage).read_text()) >= charged
        assert int((group / limit).read_text()) == converter.memory_limit(384)
    finally:
        owner.kill()
        owner.wait()
    gc(state_dir)  # the dead owner's sandbox, its converter and the converter's group
    assert wait_until(lambda: not _processes_named(converter.converter_name(sandbox_id)), 10)
    assert group.name not in cgroups.list_sandbox_groups()
    assert wait_until(lambda: not sandbox_leftovers(sandbox_id, state_dir), 10)


def _cpu_weight_of(group: cgroups.SandboxCgroup) -> int:
    """The group's CPU weight as the kernel holds it (v2's ``cpu.weight``, v1's ``cpu.shares``)."""
    return int((group._cpu / ("cpu.weight" if group.layout.version == 2 else "cpu.shares")).read_text())


def test_a_snapshots_converter_weighs_what_its_sandbox_does(tmp_path: Path) -> None:
    """A server splits a tenant's CPU weight among its sandboxes (8 of them: 128 cpu.shares each),
    but a microVM's snapshot converter ran in its own group at the default weight (1024): 8x what
    the sandbox it works for weighs against other tenants'.  Now the converter's group is given
    the sandbox's weight when it is made, and follows it while it runs."""
    from corral.tiers.microvm.sandbox import MicroVMSandbox

    with Sandbox.create(tier="microvm", memory="256M") as sb:
        vm = sb._inner
        assert isinstance(vm, MicroVMSandbox) and vm.cgroup is not None
        vm.share_cpu(100 / 8)  # what `corral serve` gives each of a tenant's 8 sandboxes
        _written, rest = vm.snapshot_begin(tmp_path / "files")
        try:
            assert rest.converter is not None
            held = rest.converter.cgroup
            default = 100 if held.layout.version == 2 else 1024
            assert _cpu_weight_of(held) == _cpu_weight_of(vm.cgroup) < default
            vm.share_cpu(100 / 2)  # the tenant's count fell while the converter ran
            assert _cpu_weight_of(held) == _cpu_weight_of(vm.cgroup) == (50 if held.layout.version == 2 else 512)
        finally:
            rest.abandon()
        assert not vm._helper_groups  # the closed converter's group is no longer written
        vm.share_cpu(100)


SNAPSHOT_THEN_EXIT = """
from corral import Sandbox
with Sandbox.create(tier="microvm", memory="256M") as sb:
    sb.commands.run("echo kept-across-exit > /tmp/mark")
    print(sb.snapshot().id, flush=True)
"""


def test_a_snapshot_taken_just_before_the_process_exits_is_kept_whole(state_dir: Path) -> None:
    """A live snapshot is returned while its memory image is still written in the background; a
    script that took one and exited at once lost it: the writer's hashing executor refused work at
    the interpreter's shutdown, and the snapshot the script had printed was removed."""
    done = subprocess.run([sys.executable, "-c", SNAPSHOT_THEN_EXIT], capture_output=True, text=True,
                          env=os.environ.copy(), timeout=300)
    assert done.returncode == 0 and "failed" not in done.stderr, done.stderr
    snapshot_id = done.stdout.strip()
    assert snapshot_id in [s.id for s in SnapshotStore(state_dir).list()]
    with Sandbox.create(snapshot=snapshot_id) as copy:
        assert copy.commands.run("cat /tmp/mark").stdout == "kept-across-exit\n"
    assert Sandbox.delete_snapshot(snapshot_id)


#: guest root: leave the guest's ``sandbox`` cgroup (the snapshot's freeze does not stop it), wait
#: for the host's "detach" to unmount /workspace, then put a file where its mount point was: the
#: host's "attach" after the migration into the converter fails (ENOTDIR)
BREAK_THE_REATTACH = r"""
import os, time
open("/sys/fs/cgroup/cgroup.procs", "w").write(str(os.getpid()))
os.chdir("/")
def mounted():
    return any(line.split()[4] == "/workspace" for line in open("/proc/self/mountinfo"))
open("/tmp/watching", "w").close()
end = time.time() + 300
while mounted() and time.time() < end:
    time.sleep(0.001)
os.rmdir("/workspace")
open("/workspace", "w").close()
open("/tmp/replaced", "w").close()
"""


def _converter_left(sandbox_id: str) -> list[str]:
    """The converter QEMUs (by their name on the command line) and groups of ``sandbox_id``."""
    from corral.tiers.microvm import converter

    return ([f"process {pid}" for pid in _processes_named(converter.converter_name(sandbox_id))]
            + [f"cgroup {name}" for name in cgroups.list_sandbox_groups() if name == converter.group_name(sandbox_id)])


def _end_converter(sandbox_id: str) -> None:
    """What the old code left: not left to the host when the test fails."""
    from corral.tiers.microvm import converter

    converter.kill_converters(sandbox_id)
    cgroups.reap(converter.group_name(sandbox_id))


def test_a_snapshot_whose_workspace_reattach_fails_leaves_no_converter(state_dir: Path) -> None:
    """A guest root made the workspace's re-attach fail after the VM was migrated into the
    snapshot's converter: snapshot() raised, and the converter (a QEMU holding a 403 MiB copy of a
    256M sandbox's RAM, in its own group, running as the sandbox's uids) was owned by nobody: it
    survived the sandbox's kill, its owner's exit and gc, one more per attempt.  Now the failed
    snapshot closes it; the VM runs on (without its workspace) and is killed cleanly."""
    sb = Sandbox.create(tier="microvm", memory="256M", user="root")
    left_by_snapshot: list[str] = []
    try:
        sb.files.write("/root/break.py", BREAK_THE_REATTACH)
        sb.commands.run("cd / && setsid python3 /root/break.py </dev/null >/dev/null 2>&1 &", timeout=30)
        assert wait_until(lambda: sb.commands.run("test -e /tmp/watching").exit_code == 0, 60)
        with pytest.raises(FileError, match="/workspace"):
            sb.snapshot()
        assert sb.commands.run("test -f /workspace && test -e /tmp/replaced", cwd="/").exit_code == 0  # the guest did it
        left_by_snapshot = _converter_left(sb.id)
        assert sb.commands.run("echo still-running", cwd="/").stdout == "still-running\n"
        assert [s for s in SnapshotStore(state_dir).list() if s.sandbox_id == sb.id] == []
    finally:
        sb.kill()
        left_by_kill = _converter_left(sb.id)
        _end_converter(sb.id)
    assert left_by_snapshot == [] and left_by_kill == []
    assert wait_until(lambda: not sandbox_leftovers(sb.id, state_dir), 10)


def test_a_sandbox_kills_a_converter_nobody_owns_before_its_uids_go(state_dir: Path, tmp_path: Path) -> None:
    """Defence in depth: a converter whose owner lost it (the state the failed re-attach above
    left) was not the sandbox's to end: it ran on after the kill, as uids handed to the next
    sandbox.  Now a sandbox's destroy kills every converter of its own before it releases them."""
    from corral.tiers.microvm import live
    from corral.tiers.microvm.sandbox import MicroVMSandbox

    sb = Sandbox.create(tier="microvm", memory="256M")
    try:
        vm = sb._inner
        assert isinstance(vm, MicroVMSandbox)
        (tmp_path / "snap").mkdir()
        _written, lost = live.capture(vm, vm._channel_or_raise(), tmp_path / "snap" / "files", None)
        assert _converter_left(sb.id)  # running, held by nobody but ``lost`` (never finished nor abandoned)
        del lost
    finally:
        sb.kill()
        left_by_kill = _converter_left(sb.id)
        _end_converter(sb.id)
    assert left_by_kill == []
    assert wait_until(lambda: not sandbox_leftovers(sb.id, state_dir), 10)


def test_gc_reaps_a_converters_group_whose_sandbox_is_gone_and_no_other(state_dir: Path) -> None:
    """A converter's group (``<id>-snapshot``) whose sandbox was destroyed held its QEMU and
    memory through ``corral gc`` (it reaped 0: the sandbox had no row left).  Now gc kills and
    removes a helper's group when no row and no group of its sandbox remains; one whose sandbox's
    group is there (a live sandbox, of any state directory) is left alone."""
    from secrets import token_hex

    from corral.spec import Limits
    from corral.tiers.microvm import converter

    gone, live_one = "sb-" + token_hex(8), "sb-" + token_hex(8)
    groups = {sid: cgroups.SandboxCgroup(converter.group_name(sid), Limits()) for sid in (gone, live_one)}
    sandbox_group = cgroups.SandboxCgroup(live_one, Limits())  # another state directory's live sandbox
    sleepers = {sid: subprocess.Popen(["sleep", "300"]) for sid in groups}
    try:
        for sid, group in groups.items():
            group.attach(sleepers[sid].pid, group.leaf("vmm"))
        gc(state_dir)
        assert sleepers[gone].wait(timeout=10) == -9
        assert converter.group_name(gone) not in cgroups.list_sandbox_groups()
        assert sleepers[live_one].poll() is None
        assert converter.group_name(live_one) in cgroups.list_sandbox_groups()
    finally:
        for sid, group in groups.items():
            group.destroy()
            sleepers[sid].kill()
            sleepers[sid].wait()
        sandbox_group.destroy()


def test_a_restored_workspace_is_charged_to_the_new_vm_not_its_owner(owner_group: Path) -> None:
    """A VM made from a live snapshot gets the snapshot's workspace copied onto its disk tmpfs by
    the owner, and a tmpfs page is charged to its writer: 2 x 100 MiB in the snapshot (100 MiB
    of it the workspace's) grew the owner's group by 203 MiB (the files and the blobs' page
    cache), outside every limit.  Now one child in the VM's memory group writes them (a fork's
    copy too: livefork.py)."""
    size = 48 << 20
    with Sandbox.create(tier="microvm", memory="256M", disk="128M") as sb:
        assert sb.commands.run(f"head -c {size} /dev/urandom > /workspace/big", timeout=120).exit_code == 0
        snapshot = sb.snapshot()
    try:
        owner = owner_group
        before_owner = usage(owner)
        with Sandbox.create(snapshot=snapshot.id) as kid:
            grown_owner = usage(owner) - before_owner
            assert grown_owner < size // 2, grown_owner >> 20
            assert kid.commands.run("wc -c < /workspace/big").stdout == f"{size}\n"
    finally:
        assert Sandbox.delete_snapshot(snapshot.id)
