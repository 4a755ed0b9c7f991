"""QEMU ``microvm`` command lines and a minimal synchronous QMP client.

One function builds the command line for both the template boot and every
restore, because a snapshot only loads into a VM with exactly the same
devices in the same order: the only things that differ are host-side
(memory file sharing, socket paths or inherited sockets, the workspace's 9p
export path, ``-incoming``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ...errors import HostNotSupported, SandboxError
from ...host import logs
from .guest import GuestAssets

#: ACPI stays on: Debian's kernels find virtio-mmio devices only through it
#: (CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES is off)
MACHINE = "microvm,x-option-roms=off,rtc=on,memory-backend=mem"
AGENT_PORT = "corral"
#: the second virtio-serial port, in every VM: network="allow"'s connections,
#: multiplexed (the guest's relay_mux.c, the host's egress_bridge.py)
EGRESS_PORT = "corral-net"
#: the virtio-net device every VM has (one device set, one template); every guest
#: restored from a template has the template's MAC, each on a link of its own
GUEST_MAC = "52:54:00:c0:44:02"


#: with CORRAL_MICROVM_TRACE: QEMU timestamps (host clock) the guest's step bytes on the serial
#: port and the virtio-serial and 9p events around them (bench/microvm.py --trace)
TRACE_ARGS = ["-msg", "timestamp=on", *(arg for event in (
    "serial_write", "virtio_console_chr_read", "virtio_console_flush_buf", "v9fs_version",
    "qemu_loadvm_state_post_main") for arg in ("-trace", event))]


def kernel_args(accel: str) -> str:
    """The guest kernel's command line.

    microvm's ACPI is "hardware reduced": no PIT, HPET or PM timer, so under
    TCG the guest cannot measure its TSC and never gets a timer interrupt (it
    hangs after "Marking TSC unstable").  Telling it the TSC frequency
    (``tsc_early_khz``; TCG's TSC runs at the host's rate) fixes that, and
    ``tsc=reliable`` keeps the clocksource watchdog from discarding it.  Under
    KVM the guest gets its clock from kvmclock and needs neither.
    ``mitigations=off``: all guest processes are one tenant, and TCG pays
    heavily for the mitigations.  ``lsm=landlock,yama psi=0``: AppArmor and
    TOMOYO have no policy in the guest and pressure accounting has no reader,
    but their hooks were ~4 % of the code TCG translates afresh after every
    restore; Landlock (for programs that sandbox themselves) and Yama's
    ptrace scope stay.
    """
    args = "console=ttyS0 quiet panic=-1 mitigations=off lsm=landlock,yama psi=0"
    if accel == "tcg":
        args += f" tsc_early_khz={host_tsc_khz()} tsc=reliable"
    return args


@lru_cache(maxsize=1)
def host_tsc_khz() -> int:
    """The host's TSC rate, measured once per machine and kept: it is part of
    every template's key, and "cpu MHz" moves on hosts that scale frequency."""
    from .guest import cache_dir

    saved = cache_dir() / "tsc_khz"
    try:
        return int(saved.read_text())
    except (OSError, ValueError):
        pass
    khz = 2_000_000
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                khz = round(float(line.split(":")[1])) * 1000
                break
    except (OSError, ValueError):
        pass
    saved.write_text(str(khz))
    return khz


#: MiB of translated code TCG keeps (``-accel tcg,tb-size=``); full, it is flushed and code is
#: translated again as it runs.  QEMU 7.2's default, 1 GiB, grew ~1.8 MiB with every command
#: (each new process's code is translated anew) past the VMM's share of the sandbox's host
#: memory limit (VMM_OVERHEAD): the host OOM-killed QEMU after 100-150 commands of a session
TCG_CACHE_MB = 192


def accel_option(accel: str) -> str:
    return f"tcg,tb-size={TCG_CACHE_MB}" if accel == "tcg" else accel


def cpu_model(accel: str) -> str:
    """Part of the template key: a snapshot only loads into the same CPU model.
    (``qemu64`` and ``max,la57=off`` were measured under TCG: no faster here.)"""
    return "host" if accel == "kvm" else "max"


@dataclass(frozen=True)
class VMPaths:
    """Host-side files of one VM."""

    agent_socket: Path
    qmp_socket: Path
    console_log: Path
    #: the template boot's egress chardev: a socket nobody connects to, so the
    #: snapshot holds the port as "host not connected" (see command_line)
    egress_socket: Path | None = None


def log_tail(*paths: Path, limit: int = 800) -> str:
    """The last ``limit`` bytes of each log, for an error message: read from the end, for a log
    can be as big as what the guest wrote to its console (up to its disk limit)."""
    return "".join(logs.tail(path, limit) for path in paths).strip() or "(no output)"


def qemu_binary() -> str:
    """``CORRAL_QEMU`` picks another build (e.g. a newer QEMU unpacked beside the system's)."""
    binary = shutil.which(os.environ.get("CORRAL_QEMU", "qemu-system-x86_64"))
    if binary is None:
        raise HostNotSupported("qemu-system-x86_64 is missing: apt-get install qemu-system-x86 (or `make install`)")
    return binary


@lru_cache(maxsize=1)
def qemu_version() -> str:
    out = subprocess.run([qemu_binary(), "--version"], capture_output=True, text=True, timeout=30).stdout
    return out.splitlines()[0] if out else "unknown"


def command_line(
    *,
    accel: str,
    ram_mb: int,
    mem_path: Path | None,
    share: bool,
    assets: GuestAssets,
    paths: VMPaths,
    disk: Path | None,
    workspace: Path,
    workspace_readonly: bool,
    incoming: bool = False,
    listen_fds: tuple[int, int] | None = None,
    egress_fd: int | None = None,
    tap_fd: int | None = None,
    confined: bool = False,
) -> list[str]:
    """``mem_path``: the RAM file (a template's or a snapshot's, mapped privately unless ``share``);
    None: anonymous RAM of QEMU's own (a fork, loaded from its parent's migration stream).
    ``incoming``: wait for ``migrate-incoming`` (a restore).  Templates are
    saved without the "global state" section (``store-global-state=off``), so
    a restored VM starts running as soon as it is loaded, without a ``cont``
    round trip.  ``listen_fds``: (agent, QMP)
    Unix sockets already listening, created by the caller: it can connect (and
    queue the configuration) at once instead of polling for QEMU's sockets.
    ``egress_fd``: the egress port's listening socket (network="allow"); without
    it and without ``paths.egress_socket`` the port is backed by ``null``: the
    device set, and so the snapshot, is the same either way.
    ``disk``: the image (rootdisk), read-only and shared by every VM of the
    image; only the KVM probe boots without one.
    ``tap_fd``: network="open"'s tap (made and opened by the host in the sandbox's
    namespace); without it the virtio-net device's backend is a port on an
    otherwise empty hub, where every frame the guest sends is dropped.
    ``confined``: QEMU runs in the sandbox's user namespace (tier.py's ``_launch``), so its own
    seccomp filter may refuse every set*id call too."""
    argv = [
        qemu_binary(),
        "-M", MACHINE,
        "-accel", accel_option(accel),
        "-cpu", cpu_model(accel),
        "-smp", "1",
        "-m", f"{ram_mb}M",
        "-object", (f"memory-backend-file,id=mem,size={ram_mb}M,mem-path={mem_path},share={'on' if share else 'off'}"
                    if mem_path is not None else f"memory-backend-ram,id=mem,size={ram_mb}M"),
        "-nographic", "-nodefaults", "-no-reboot", "-no-user-config",
        "-serial", f"file:{paths.console_log}",
        "-device", "virtio-serial-device",
    ]
    if listen_fds is None:
        argv += [
            "-chardev", f"socket,id=agent,path={paths.agent_socket},server=on,wait=off",
            "-qmp", f"unix:{paths.qmp_socket},server=on,wait=off",
        ]
    else:
        argv += [
            "-chardev", f"socket,id=agent,fd={listen_fds[0]},server=on,wait=off",
            "-chardev", f"socket,id=qmp,fd={listen_fds[1]},server=on,wait=off",
            "-mon", "chardev=qmp,mode=control",
        ]
    argv += ["-device", f"virtserialport,chardev=agent,name={AGENT_PORT}"]
    # The template's port is an unconnected socket: a restored guest then believes
    # no host is there until QEMU really has one (a socket chardev drops what is
    # written before it is connected; the guest's relay blocks instead).  A VM
    # without egress gets ``null``: nothing on the host, and nothing in the guest
    # ever writes to the port.
    if egress_fd is not None:
        argv += ["-chardev", f"socket,id=egress,fd={egress_fd},server=on,wait=off"]
    elif paths.egress_socket is not None:
        argv += ["-chardev", f"socket,id=egress,path={paths.egress_socket},server=on,wait=off"]
    else:
        argv += ["-chardev", "null,id=egress"]
    argv += ["-device", f"virtserialport,chardev=egress,name={EGRESS_PORT}"]
    # never user-mode networking (slirp): QEMU itself would be the guest's router
    if tap_fd is not None:
        argv += ["-netdev", f"tap,id=net,fd={tap_fd},vhost=off"]
    else:
        argv += ["-netdev", "hubport,id=net,hubid=0"]
    # guest_announce=off: no gratuitous ARP from the guest's driver after a restore (guest code
    # every VM would run); QEMU's own announcement goes to the backend (the hub drops it)
    argv += ["-device", f"virtio-net-device,netdev=net,mac={GUEST_MAC},guest_announce=off"]
    if disk is not None:
        # read-only, so many QEMUs share it (shared image locks) and a guest cannot
        # write it; the host's page cache holds it once for all of them
        argv += [
            "-drive", f"file={disk},if=none,id=image,format=raw,readonly=on",
            "-device", "virtio-blk-device,drive=image",
        ]
    ro = ",readonly=on" if workspace_readonly else ""
    # passthrough: the guest's owners and modes are the files' own.  QEMU runs as root of the
    # sandbox's user namespace (uid N in the guest = the range's N on the host, as in the
    # process tier) with only the file capabilities this needs (vmm.py's VMM_CAPS)
    argv += [
        "-fsdev", f"local,id=ws,path={workspace},security_model=passthrough{ro}",
        "-device", "virtio-9p-device,fsdev=ws,mount_tag=ws",
    ]
    argv += ["-global", "migration.store-global-state=off"]
    if incoming:
        # a restore runs the snapshot's kernel, already in RAM: loading the kernel
        # and initramfs files again (~11 MB into fw_cfg) would only cost time
        argv += ["-incoming", "defer"]
    else:
        argv += ["-kernel", str(assets.kernel), "-initrd", str(assets.initrd), "-append", kernel_args(accel)]
    if confined:
        # QEMU's own seccomp filter: no obsolete or resource-control syscalls, no spawning (the
        # snapshot comes through an inherited fd: migrate-incoming fd:N, where QEMU 7.2 has no
        # file: URI) and no set*id (it starts as the user it stays)
        argv += ["-sandbox", "on,obsolete=deny,elevateprivileges=deny,resourcecontrol=deny,spawn=deny"]
    return argv


def connect_unix(path: Path, deadline: float, proc: subprocess.Popen[bytes] | None = None) -> socket.socket:
    """Connect to a socket QEMU is about to create."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(str(path))
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if proc is not None and proc.poll() is not None:
                raise SandboxError(f"QEMU exited with status {proc.returncode} before {path.name} appeared") from None
            if time.monotonic() > deadline:
                raise SandboxError(f"QEMU did not open {path.name} in time") from None
            time.sleep(0.002)


class QMP:
    """Just enough QMP: commands in order, events remembered."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self._sock = sock
        self._sock.settimeout(timeout)
        self._buf = b""
        self.events: list[dict[str, Any]] = []
        self._read()  # greeting
        self.command("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise SandboxError("QEMU closed its QMP socket")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        message: dict[str, Any] = json.loads(line)
        return message

    def command(self, name: str, **arguments: Any) -> Any:
        request: dict[str, Any] = {"execute": name}
        if arguments:
            request["arguments"] = arguments
        self._sock.sendall(json.dumps(request).encode() + b"\n")
        return self._reply(name)

    def send_fd(self, name: str, fd: int) -> None:
        """Hand QEMU a file descriptor (``getfd``, the fd rides along as SCM_RIGHTS) for a later
        ``migrate fd:NAME`` or ``migrate-incoming fd:NAME``."""
        request = json.dumps({"execute": "getfd", "arguments": {"fdname": name}}).encode() + b"\n"
        socket.send_fds(self._sock, [request], [fd])
        self._reply("getfd")

    def _reply(self, name: str) -> Any:
        """The answer to the command just sent (events meanwhile are kept in ``events``)."""
        while True:
            message = self._read()
            if "event" in message:
                self.events.append(message)
                continue
            if "error" in message:
                raise SandboxError(f"QMP {name}: {message['error'].get('desc', message['error'])}")
            return message.get("return")

    def wait_migration(self, deadline: float) -> None:
        while True:
            status = self.command("query-migrate").get("status", "")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise SandboxError(f"migration {status}")
            if time.monotonic() > deadline:
                raise SandboxError(f"migration did not complete in time (status {status!r})")
            time.sleep(0.005)

    def wait_resumed(self) -> None:
        """Block until the VM runs: already running, or the RESUME event (no polling)."""
        if self.command("query-status").get("status") == "running":
            return
        while not any(e.get("event") == "RESUME" for e in self.events):
            message = self._read()
            if "event" in message:
                self.events.append(message)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
