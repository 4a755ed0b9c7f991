"""The *converter* of a live snapshot (live.py): a QEMU with the VM's devices and its RAM in a
preallocated memfd, that loads the running VM's migration stream and never runs the guest, then
saves its device state; its memfd is the snapshot's memory image until copied out.

It holds as much host memory as the guest has RAM, beside the VM's own, so it runs in a host
cgroup of its own (:func:`group_name`) below the sandboxes' parent: limited to what it must
hold (:func:`memory_limit`) and counted in what all sandboxes may use together.  It joins the
group before QEMU starts, so the memfd's pages (charged to whoever touches them first: QEMU's
preallocation) are charged there; a dead owner's group is reaped with its sandbox
(``MicroVMTier.reap``)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import SandboxError
from ...host import cgroups
from ...spec import MiB
from ..linux.agent_build import agent_binary
from . import qemu, template, vmm

if TYPE_CHECKING:
    from .sandbox import MicroVMSandbox

MIGRATE_TIMEOUT = 120.0
#: host memory the converter holds beside its guest RAM (the memfd): QEMU itself, its devices and
#: the migration's buffers; its group's peak was 22 MiB above the guest RAM of a 256M sandbox and
#: 26 MiB above a 1G one's (it never runs the guest: no TCG translation cache)
CONVERTER_OVERHEAD = 64 * MiB
#: threads preallocating the memfd (docs/snapshots.md); the group's CPU quota lets them all run,
#: above a sandbox's own quota of fewer CPUs: the preallocation is what snapshot() waits for, and
#: the stream's load what the VM stays stopped for (at 2 CPUs ~0.4 s and ~0.2 s for a 256M VM).
#: It is bounded in time (one converter per VM at a time), and under contention it yields as the
#: sandbox does: its group has the sandbox's CPU weight (MicroVMSandbox.weigh_helper_group)
PREALLOC_THREADS = 2


def group_name(sandbox_id: str) -> str:
    """The converter's host cgroup, beside its sandbox's below the sandboxes' parent."""
    return f"{sandbox_id}-snapshot"


def memory_limit(ram_mb: int) -> int:
    return ram_mb * MiB + CONVERTER_OVERHEAD


@dataclass
class Converter:
    """A running converter: its QEMU, a QMP connection to it, and its host cgroup; one owner
    (live.RamWrite once the VM runs on) closes it, which kills QEMU and removes the group."""

    proc: subprocess.Popen[bytes]
    qmp: qemu.QMP
    cgroup: cgroups.SandboxCgroup
    #: the VM it works for, which sets the group's CPU weight while it runs
    vm: MicroVMSandbox

    def close(self) -> None:
        try:
            self.qmp.close()
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        finally:
            self.vm.forget_helper_group(self.cgroup)
            self.cgroup.destroy()  # (kills whatever of it is left, too)


def start(vm: MicroVMSandbox, vm_dir: Path, incoming: socket.socket) -> Converter:
    """A QEMU with the VM's devices and its RAM in a memfd (shared), that loads the stream from
    ``incoming`` and never runs the guest (``-S``); confined as the VM's own QEMU is (root of
    the sandbox's user namespace, taken from it, with its files as descriptors: vmm.py), in a
    host cgroup of its own sized for the guest's RAM."""
    from .sandbox import VMM_PIDS

    empty = vm_dir / "empty"
    empty.mkdir(mode=0o755)
    qemu_pid = vm.qemu_pid()
    if qemu_pid is None:
        raise SandboxError(f"sandbox {vm.id} has no QEMU")
    limits = dataclasses.replace(vm.spec.limits, memory=memory_limit(vm.ram_mb), pids=VMM_PIDS,
                                 cpus=max(vm.spec.limits.cpus, float(PREALLOC_THREADS)))
    group = cgroups.SandboxCgroup(group_name(vm.id), limits, vm._tier._layout)
    files: dict[str, int] = {}
    try:
        vm.weigh_helper_group(group)  # before QEMU starts: its preallocation is most of its CPU
        files["userns"] = os.open(f"/proc/{qemu_pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        files["disk"] = os.open(vm.image_disk.path, os.O_PATH | os.O_CLOEXEC)
        files["ws"] = os.open(empty, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        files["console"] = os.open(vm_dir / "console.log", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.fchown(files["console"], vm.uid_range.base, vm.uid_range.base)
        proc, qmp = _start(vm, vm_dir, incoming, files, group)
    except BaseException:
        vm.forget_helper_group(group)
        group.destroy()
        raise
    finally:
        for fd in files.values():
            os.close(fd)
    return Converter(proc, qmp, group, vm)


def _start(vm: MicroVMSandbox, vm_dir: Path, incoming: socket.socket, files: dict[str, int],
           group: cgroups.SandboxCgroup) -> tuple[subprocess.Popen[bytes], qemu.QMP]:
    listeners = []
    for name in ("conv-agent.sock", "conv-qmp.sock"):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        (vm._run_dir / name).unlink(missing_ok=True)
        listener.bind(str(vm._run_dir / name))
        listener.listen(1)
        listeners.append(listener)
    try:
        paths = qemu.VMPaths(vm._run_dir / "conv-agent.sock", vm._run_dir / "conv-qmp.sock",
                             vmm.fd_path(files["console"]))
        argv = qemu.command_line(
            accel=vm._tier.accel, ram_mb=vm.ram_mb, mem_path=vm_dir / "ram", share=True, assets=vm._tier.assets,
            paths=paths, disk=vmm.fd_path(files["disk"]), workspace=vmm.fd_path(files["ws"]),
            workspace_readonly=False, incoming=True, listen_fds=(listeners[0].fileno(), listeners[1].fileno()),
            confined=True,
        )
        # its RAM in a memfd: loading the stream into a shared mapping of a file on disk faults
        # every page through the file system (~6 s for 400 MB on ext4 here, ~1 s on shmem); the
        # image is copied out afterwards, sparse (memimage.write_sparse).  Preallocated before
        # the VM stops (every page is touched by the load anyway, zero pages too: QEMU reads them
        # to compare): the VM is stopped ~0.15 s instead of ~0.7 s for 512 MiB; two threads
        # preallocate 512 MiB in ~0.2 s instead of ~0.45 s (docs/snapshots.md)
        backend = next(i for i, arg in enumerate(argv) if arg.startswith("memory-backend-file,id=mem,"))
        argv[backend] = (f"memory-backend-memfd,id=mem,size={vm.ram_mb}M,share=on,prealloc=on,"
                         f"prealloc-threads={PREALLOC_THREADS}")
        argv.append("-S")  # loads, never runs
        argv += ["-name", converter_name(vm.id)]  # found by this name too if the owner dies (kill_converters)
        # in its group before QEMU starts: the memfd's pages are charged to the group of the
        # process that first touches them (QEMU's preallocation), and they stay charged there
        procs_files = [str(path) for path in group.procs_files(group.leaf("vmm"))]
        argv = vmm.joining(procs_files, [
            *vmm.launcher(agent_binary(vm._tier.state_dir), files["userns"], vm._tier.accel, vm._tier.seccomp),
            *argv])
        with open(vm_dir / "qemu.log", "wb") as log:
            # (its PR_SET_PDEATHSIG does not survive the launcher's change of uid: a dead owner's
            # converter is killed with its group, and by name: MicroVMTier.reap)
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/",
                                    pass_fds=[*(listener.fileno() for listener in listeners), *files.values()],
                                    preexec_fn=template._die_with_parent)
        for listener in listeners:
            listener.close()  # QEMU's now: one that dies resets our connection instead of leaving it queued
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.connect(str(paths.qmp_socket))
            qmp = qemu.QMP(sock, timeout=MIGRATE_TIMEOUT)
            qmp.send_fd("in", incoming.fileno())
            qmp.command("migrate-incoming", uri="fd:in")
        except BaseException as exc:
            proc.kill()
            proc.wait()
            if isinstance(exc, OSError):
                raise SandboxError(f"the snapshot's converter QEMU failed ({exc}): "
                                   f"{qemu.log_tail(vm_dir / 'qemu.log', limit=400)}") from None
            raise
        return proc, qmp
    finally:
        for listener in listeners:
            listener.close()
        for name in ("conv-agent.sock", "conv-qmp.sock"):
            (vm._run_dir / name).unlink(missing_ok=True)


def converter_name(sandbox_id: str) -> str:
    return f"corral-snapshot-{sandbox_id}"


def kill_converters(sandbox_id: str) -> None:
    """SIGKILL the snapshot converters of ``sandbox_id`` a dead owner left (MicroVMTier.reap)."""
    wanted = f"\0{converter_name(sandbox_id)}\0".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if wanted in Path(f"/proc/{entry}/cmdline").read_bytes():
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def wait_loaded(qmp: qemu.QMP, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while True:
        status = qmp.command("query-migrate").get("status", "")
        if status == "completed":
            return
        if status in ("failed", "cancelled") or proc.poll() is not None:
            raise SandboxError(f"the snapshot's converter could not load the VM (status {status!r})")
        if time.monotonic() > deadline:
            raise SandboxError("the snapshot's converter did not load the VM in time")
        time.sleep(0.005)
