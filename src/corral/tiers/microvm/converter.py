"""The *converter* of a live snapshot (live.py): a QEMU with the VM's devices and its RAM in a
preallocated memfd, that loads the running VM's migration stream and never runs the guest, then
saves its device state; its memfd is the snapshot's memory image until copied out."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import SandboxError
from ..linux.agent_build import agent_binary
from . import qemu, template, vmm

if TYPE_CHECKING:
    from .sandbox import MicroVMSandbox

MIGRATE_TIMEOUT = 120.0


def start(vm: MicroVMSandbox, vm_dir: Path, incoming: socket.socket) -> tuple[subprocess.Popen[bytes], qemu.QMP]:
    """A QEMU with the VM's devices and its RAM in a memfd (shared), that loads the stream from
    ``incoming`` and never runs the guest (``-S``); confined as the VM's own QEMU is (root of
    the sandbox's user namespace, taken from it, with its files as descriptors: vmm.py)."""
    empty = vm_dir / "empty"
    empty.mkdir(mode=0o755)
    qemu_pid = vm.qemu_pid()
    if qemu_pid is None:
        raise SandboxError(f"sandbox {vm.id} has no QEMU")
    files = {"userns": os.open(f"/proc/{qemu_pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)}
    try:
        files["disk"] = os.open(vm.image_disk.path, os.O_PATH | os.O_CLOEXEC)
        files["ws"] = os.open(empty, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        files["console"] = os.open(vm_dir / "console.log", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.fchown(files["console"], vm.uid_range.base, vm.uid_range.base)
        return _start(vm, vm_dir, incoming, files)
    finally:
        for fd in files.values():
            os.close(fd)


def _start(vm: MicroVMSandbox, vm_dir: Path, incoming: socket.socket, files: dict[str, int]
           ) -> tuple[subprocess.Popen[bytes], qemu.QMP]:
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
        argv[backend] = f"memory-backend-memfd,id=mem,size={vm.ram_mb}M,share=on,prealloc=on,prealloc-threads=2"
        argv.append("-S")  # loads, never runs
        argv += ["-name", converter_name(vm.id)]  # outside the sandbox's cgroup (its memory would not fit
        # beside the VM's): found by this name if the owner dies meanwhile (kill_converters)
        argv = [*vmm.launcher(agent_binary(vm._tier.state_dir), files["userns"], vm._tier.accel, vm._tier.seccomp),
                *argv]
        with open(vm_dir / "qemu.log", "wb") as log:
            # (its PR_SET_PDEATHSIG does not survive the launcher's change of uid: a dead owner's
            # converter is killed by name, kill_converters)
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
