"""What only the microVM tier promises: its own kernel, fresh randomness and
identity in every VM restored from the shared snapshot, a command's whole
tree killed inside the guest, and nothing left on the host after teardown or
after its owner is killed and ``corral gc`` runs.

Each VM costs seconds of TCG time on a shared machine: these tests use four.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral.errors import InvalidSpec
from corral.images import ImageLayout, resolve
from corral.tiers import tier_class
from corral.tiers.microvm import MicroVMSandbox, rootdisk

from .leaks import all_leftovers, sandbox_leftovers


def py(code: str) -> list[str]:
    return ["python3", "-c", code]


@pytest.fixture(scope="module", autouse=True)
def _microvm_available(state_dir: Path) -> None:
    availability = tier_class("microvm").probe(state_dir)
    if not availability.available:
        pytest.skip(f"tier microvm unavailable: {availability.reason}")


@pytest.fixture(scope="module")
def vm() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(tier="microvm", memory="256M")
    try:
        yield sandbox
    finally:
        sandbox.kill()


def _vm(sandbox: Sandbox) -> MicroVMSandbox:
    inner = sandbox._inner  # the test checks the real VM behind the API
    assert isinstance(inner, MicroVMSandbox)
    return inner


def _qemu_pid(sandbox: Sandbox) -> int:
    pid = _vm(sandbox).qemu_pid()
    assert isinstance(pid, int)
    return pid


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_probe_says_which_accelerator_and_why(vm: Sandbox, state_dir: Path) -> None:
    # (the vm fixture makes sure the guest is built: before that the probe only
    # says it will be fetched on first use)
    availability = tier_class("microvm").probe(state_dir)
    accel = availability.details.get("accelerator")
    assert accel == _vm(vm)._tier.accel, availability
    # the KVM decision comes from booting a guest, never from /dev/kvm merely existing
    assert ("KVM guest booted" in availability.reason) == (accel == "kvm"), availability.reason
    if accel == "tcg":
        assert "TCG" in availability.reason, availability.reason
        assert "did not boot" in availability.reason or "/dev/kvm" in availability.reason


def test_guest_runs_its_own_kernel(vm: Sandbox) -> None:
    r = vm.commands.run(py("import platform; print(platform.release()); print(open('/proc/version').read())"))
    release, version = r.stdout.split("\n", 1)
    assert release != os.uname().release
    assert release == _vm(vm).kernel_release
    assert "Debian" in version
    # the guest's memory is the VM's: it sees its own RAM, not the host's 24 GiB
    mem = vm.commands.run(py("print(open('/proc/meminfo').readline())")).stdout
    assert int(mem.split()[1]) < 1024 * 1024


def test_image_is_shared_read_only_with_a_private_writable_layer(vm: Sandbox) -> None:
    marker = "/usr/corral-microvm-write-test"
    r = vm.commands.run(py(f"open({marker!r}, 'w').write('guest'); print(open({marker!r}).read())"))
    assert r.stdout == "guest\n", r  # the guest's overlay takes the write...
    assert not Path(marker).exists()  # ...and the host's /usr never sees it


def test_read_only_workspace_is_read_only_in_the_guest(tmp_path: Path) -> None:
    (tmp_path / "input.txt").write_text("host data")
    with Sandbox.create(tier="microvm", memory="256M", workspace=f"{tmp_path}:ro") as sb:
        r = sb.commands.run(py(
            "print(open('/workspace/input.txt').read())\n"
            "try:\n"
            "    open('/workspace/input.txt', 'w').write('changed')\n"
            "except OSError as e:\n"
            "    print('denied', e.errno)\n"
        ))
    assert r.stdout.splitlines() == ["host data", "denied 30"], r  # EROFS
    assert (tmp_path / "input.txt").read_text() == "host data"


def test_timeout_kills_the_whole_tree_inside_the_guest(vm: Sandbox) -> None:
    daemon = "import time\nwhile True:\n    open('/tmp/beat', 'a').write('x')\n    time.sleep(0.1)\n"
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {daemon!r}], start_new_session=True)\n"
        "time.sleep(60)\n"
    )
    r = vm.commands.run(py(code), timeout=15)
    assert r.timed_out and r.exit_code == 124
    size = len(vm.files.read("/tmp/beat", format="bytes"))
    assert size > 0, "the daemon never ran: the test proves nothing"
    time.sleep(1.0)
    assert len(vm.files.read("/tmp/beat", format="bytes")) == size, "a daemonized child survived the timeout"


def test_restored_sandboxes_get_fresh_randomness_and_identity() -> None:
    code = "import os; print(os.urandom(32).hex()); print(open('/etc/machine-id').read().strip())"
    outputs = []
    for _ in range(2):
        with Sandbox.create(tier="microvm", memory="256M") as sb:
            assert "migrate_incoming" in _vm(sb).timings, "the sandbox was not restored from the snapshot"
            outputs.append(sb.commands.run(py(code)).stdout.split())
    (random_a, id_a), (random_b, id_b) = outputs
    assert len(random_a) == 64 and random_a != random_b
    assert id_a != id_b


def test_identity_files_leave_the_images_etc_as_it_was(vm: Sandbox, state_dir: Path) -> None:
    # the guest writes hostname and machine-id into the overlay's upper /etc before
    # mounting it, giving that /etc the image's owner, mode and mtime
    etc = (resolve("host", state_dir).layers[0][1] / "etc").stat()
    out = vm.commands.run(["stat", "-c", "%a %u %g %Y", "/etc"]).stdout.split()
    assert out == [f"{etc.st_mode & 0o7777:o}", str(etc.st_uid), str(etc.st_gid), str(int(etc.st_mtime))]
    assert vm.files.read("/etc/hostname").strip() == "sandbox"
    assert len(vm.files.read("/etc/machine-id").strip()) == 32
    # the image's other files are still there, below the upper /etc
    assert "root:" in vm.files.read("/etc/passwd")


def test_agent_runs_outside_the_commands_cgroup_and_in_the_new_root(vm: Sandbox) -> None:
    # the agent is started before the snapshot (in the initramfs) and shares pid 1's
    # root: after the restore it must see the sandbox's root and sit in cgroup "agent"
    r = vm.commands.run(["sh", "-c", "cat /proc/$PPID/comm /proc/$PPID/cgroup /proc/$PPID/root/etc/hostname"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == ["corral-agent", "0::/agent", "sandbox"]


def test_a_command_whose_cgroup_leaf_cannot_be_made_is_not_run() -> None:
    # the leaf's mkdir is sent with the exec, not waited for: its failure must still
    # keep the command from running (here guest root forbade new leaves)
    with Sandbox.create(tier="microvm", memory="256M") as sb:
        limit = "echo 0 > /sys/fs/cgroup/sandbox/cgroup.max.descendants"
        assert sb.commands.run(["sh", "-c", limit]).exit_code == 0
        r = sb.commands.run(["touch", "/tmp/ran"])
        assert r.exit_code != 0 and "could not place the command" in r.stderr
        assert not sb.files.exists("/tmp/ran"), "the refused command ran"  # (files: no command needed)


def test_teardown_leaves_no_vm_behind(state_dir: Path) -> None:
    sb = Sandbox.create(tier="microvm", memory="256M")
    pid = _qemu_pid(sb)
    run_dir = state_dir / "sandboxes" / sb.id
    assert (run_dir / "agent.sock").exists()
    sb.kill()
    assert not _alive(pid)
    assert not run_dir.exists()
    assert sandbox_leftovers(sb.id, state_dir) == []


def test_network_other_than_none_is_refused_and_leaves_nothing(state_dir: Path) -> None:
    before = set(all_leftovers(state_dir))  # the module's VM may be alive
    with pytest.raises(InvalidSpec, match="microvm"):
        Sandbox.create(tier="microvm", network="open")
    assert set(all_leftovers(state_dir)) == before


OWNER = textwrap.dedent(
    """
    import sys, time
    from corral import Sandbox
    sb = Sandbox.create(tier="microvm", memory="256M")
    print(sb.id, sb._inner.qemu_pid(), flush=True)
    time.sleep(600)
    """
)


def test_killed_owner_is_reaped_by_gc(state_dir: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline().split()
        assert len(line) == 2, "the owner did not create its sandbox"
        sandbox_id, pid = line[0], int(line[1])
        assert _alive(pid)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert _alive(pid), "QEMU died with its owner: gc is not exercised"
    assert sandbox_leftovers(sandbox_id, state_dir) != []
    corral = Path(sys.executable).with_name("corral")
    result = subprocess.run([str(corral), "gc"], capture_output=True, text=True, env=os.environ.copy(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert sandbox_id in result.stdout
    assert not _alive(pid)
    assert sandbox_leftovers(sandbox_id, state_dir) == []


def test_image_disk_merges_the_layers_keeping_metadata_and_is_built_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (no VM: the disk alone, in a cache of its own)
    monkeypatch.setenv("CORRAL_MICROVM_CACHE", str(tmp_path / "cache"))
    top, usr = tmp_path / "top", tmp_path / "usr"
    (top / "etc").mkdir(parents=True)
    (top / "usr").mkdir()
    (top / "etc" / "secret").write_text("s")
    os.chmod(top / "etc" / "secret", 0o600)
    os.chown(top / "etc" / "secret", 1234, 5678)
    os.symlink("usr/bin", top / "bin")
    (usr / "bin").mkdir(parents=True)
    (usr / "bin" / "tool").write_text("#!/bin/sh\n")
    os.chmod(usr / "bin" / "tool", 0o755)
    os.utime(top / "etc", (1_600_000_000, 1_600_000_000))
    layout = ImageLayout("test", (("/", top), ("/usr", usr)))
    disk = rootdisk.image_disk(layout)
    out = tmp_path / "out"
    subprocess.run(["fsck.erofs", f"--extract={out}", str(disk.path)], check=True, capture_output=True)
    secret = (out / "etc" / "secret").stat()
    assert (secret.st_mode & 0o7777, secret.st_uid, secret.st_gid) == (0o600, 1234, 5678)
    assert (out / "etc").stat().st_mtime == 1_600_000_000
    assert os.readlink(out / "bin") == "usr/bin"
    assert (out / "usr" / "bin" / "tool").read_text() == "#!/bin/sh\n"  # the second layer, merged
    assert os.access(out / "usr" / "bin" / "tool", os.X_OK)
    assert not os.path.ismount(top / "usr")  # the bind mounts went with their namespace
    assert rootdisk.image_disk(layout) == disk  # built once: the same file and build id
    rootdisk._keys.clear()
    (top / "etc" / "secret").write_text("t")  # same size, other bytes
    assert rootdisk.content_key(layout) != disk.key.split("-")[0]


def test_the_host_images_disk_is_the_same_in_every_state_dir(tmp_path: Path) -> None:
    # the skeleton is per state dir; its disk (minutes to build) must not be
    a, b = resolve("host", tmp_path / "a"), resolve("host", tmp_path / "b")
    assert a.layers[0][1] != b.layers[0][1]
    assert rootdisk.content_key(a) == rootdisk.content_key(b)
