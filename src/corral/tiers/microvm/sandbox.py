"""One microVM sandbox (:class:`MicroVMSandbox`): its QEMU, restored from a template (or a
live snapshot, or a running VM's migration stream), its agent channel, and what it owns.

One sandbox owns (all released by :meth:`MicroVMSandbox.close`, or by
:meth:`~.tier.MicroVMTier.reap` after its owner died):

- a QEMU process, started in the sandbox's host cgroup (memory = guest RAM +
  QEMU's own overhead, cpu quota, pids) as root of the sandbox's user namespace
  (its uid range, ``VMM_CAPS`` only), given its files as descriptors;
- its ``run_dir``: the QMP and agent sockets, the console and QEMU logs (on the disk tmpfs) and a
  size-limited tmpfs with the workspace copy the guest reaches over 9p;
- while a live snapshot of it is taken and written: its converter QEMU (converter.py), owned by
  the snapshot's ``RamWrite``, and ended by the sandbox's destroy at the latest;
- with ``network="allow"``: the egress proxy (a thread, its socket in the run
  dir) and the bridge thread that carries the guest's connections from the
  VM's egress port to it (``egress_bridge.py``);
- with ``network="open"``: the open mode's namespace, veth pair, nftables
  table and NFLOG listener (``OpenNetwork``), plus a tap bridged to the veth
  inside that namespace, whose fd QEMU's virtio-net device gets.

The image is not the sandbox's: it is a read-only disk shared by every VM of
that image (rootdisk), already mounted under the root overlay in the
template the VM is restored from.

Inside the guest, commands run in leaves of a guest cgroup carrying the
memory and pids limits: OOM is read from the leaf's ``memory.events`` and a
timeout writes the leaf's ``cgroup.kill``, both through the agent's file
operations (the agent itself lives outside that cgroup).  That kill is the guest
agent's doing, and a command run as guest root could stop the agent: so the
host is the backstop, as gVisor's is -- a command not seen to end within
``KILL_GRACE`` seconds (of the VM's running time) after its kill stops the whole
VM (QEMU killed with the sandbox's host cgroup).  The command's result then says
it timed out and the sandbox stopped; every later call raises SandboxClosed.  A command
carried into this VM over a live snapshot (a fork, a snapshot's sandbox, a resume from disk) has
the same backstop at its kill: the leaf not seen empty within ``KILL_GRACE`` stops the VM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import socket
import struct
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...egress.network import PROXY_PORT
from ...errors import SandboxClosed, SandboxError
from ...host import cgroups, mounts
from ...host.mounts import disk_held_in_memory
from ...host.ws_copy import WorkspaceCopy
from ...images import resolve
from ...spec import Limits, MiB, SandboxSpec
from ..base import ExecRequest, OutputCallback, Process
from ..linux.agent import USER_IDS, AgentChannel
from ..linux.agent_build import agent_binary
from ..linux.agent_process import AgentProcess
from ..linux.frames import T_AS_AGENT, T_FMKDIR, T_FWRITE
from ..linux.pause import backstop_kill
from ..linux.sandbox import LinuxSandbox
from . import converter, live, livefork, qemu, rootdisk, template, vmm
from .egress_bridge import EgressBridge
from .leaves import Carried, CommandDeadlines, LeafEnded, LeftLeaves, leaf_events

if TYPE_CHECKING:
    from .tier import MicroVMTier

#: where port forwards' connector (a copy of the agent) goes in the guest
CONNECTOR_IN_GUEST = "/.corral-connect"
#: host memory on top of guest RAM: QEMU itself and TCG's translation cache
VMM_OVERHEAD = 384 * MiB


def host_limits(limits: Limits, ram_mb: int) -> Limits:
    """The limits of a VM's host cgroup: guest RAM, QEMU's own, and the disk tmpfs whose pages
    QEMU's 9p server writes (:func:`~corral.host.mounts.disk_held_in_memory`)."""
    memory = ram_mb * MiB + VMM_OVERHEAD + disk_held_in_memory(limits)
    return dataclasses.replace(limits, memory=memory, pids=VMM_PIDS)
VMM_PIDS = 64
START_TIMEOUT = 60.0
#: seconds of the VM's running time a killed command has to be seen to end (its agent reports
#: the exit) before the host stops the VM: the agent writes the kill, and a guest root can stop it
KILL_GRACE = 5.0
GUEST_CGROUP = "/sys/fs/cgroup/sandbox"
#: seconds a destroyed VM's snapshot still being written has to finish before its converter is
#: killed (a kill right after a snapshot waited 1.3 s for a 256M VM's, 1.2 s for a 1G one's under
#: TCG: the converter saves the state and quits in 0.1-0.3 s, then its memfd is copied out)
CONVERTER_GRACE = 30.0


class MicroVMSandbox(LinuxSandbox):
    #: guest RAM and the image's disk (what a live snapshot of it records)
    ram_mb: int
    image_disk: rootdisk.ImageDisk
    source_template: template.Template

    def __init__(self, tier: MicroVMTier, spec: SandboxSpec, sandbox_id: str, run_dir: Path,
                 seed: tuple[Path, str] | None = None, fork: livefork.ForkSource | None = None) -> None:
        self._tier = tier
        #: a live snapshot to restore (its files directory, its manifest's sha256)
        self._live_seed = seed
        #: or a running VM's migration stream to load (a fork)
        self._fork_source = fork
        if seed is not None or fork is not None:
            self.hostname = sandbox_id
        self._exec_count = 0
        self._left_leaves = LeftLeaves()
        self._deadlines = CommandDeadlines(self._kill_carried)
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._bridge: EgressBridge | None = None
        #: why the host stopped the VM under the sandbox (its agent did not obey a kill)
        self._stopped_why = ""
        self._snapshot_lock = threading.Lock()
        #: the memory image of its last live snapshot, perhaps still being written
        self._ram_write: live.RamWrite | None = None
        #: the CPU weight last set (share_cpu), and the host groups of helpers working for the VM
        #: (a snapshot's converter): each weighs what the sandbox does (it had the default 100, 8x
        #: the part of a server's tenant of 8 sandboxes)
        self._cpu_weight: float | None = None
        self._helper_groups: set[cgroups.SandboxCgroup] = set()
        #: seconds spent in each start-up phase (bench and debugging)
        self.timings: dict[str, float] = {}
        #: CORRAL_MICROVM_TRACE: record where a restore's time goes (bench/microvm.py --trace)
        self._trace = bool(os.environ.get("CORRAL_MICROVM_TRACE"))
        self.trace_wall0 = 0.0
        super().__init__(tier.state_dir, spec, sandbox_id, run_dir)

    # -- creation --------------------------------------------------------
    def _agent_connector(self) -> str | None:
        """Port forwards run ``agent --connect PORT`` in the guest (it has no network device to
        enter); the guest's commands do not see the agent, so a copy goes to the guest's root once."""
        if self._connector_path is None:
            self._channel_or_raise().write_file(CONNECTOR_IN_GUEST, agent_binary().read_bytes(), 0o755, as_agent=True)
            self._connector_path = CONNECTOR_IN_GUEST
        return self._connector_path

    def _setup(self) -> None:
        if self._live_seed is not None:
            live.setup_restored(self, *self._live_seed)
            return
        if self._fork_source is not None:
            livefork.setup_forked(self, self._fork_source)
            return
        spec, run, uid = self.spec, self._run_dir, self.uid
        t0 = time.monotonic()
        # QEMU's user namespace (the uid range mapped): its helper starts while the rest is made
        self._start_userns(agent_binary(self._tier.state_dir))
        image = resolve(spec.image, self._tier.state_dir)
        image_disk = self.image_disk = rootdisk.image_disk(image)
        ram_mb = self.ram_mb = self._tier.ram_mb(spec.limits.memory)
        tmpl = self.source_template = template.get_template(
            self._tier.assets, self._tier.accel, ram_mb, image_disk, self._tier.state_dir)
        self.timings["template"] = time.monotonic() - t0
        disk_size = disk_held_in_memory(spec.limits)
        self._make_cgroup(host_limits(spec.limits, ram_mb), self._tier._layout)
        disk = run / "disk"
        disk.mkdir()
        mounts.mount_tmpfs(disk, disk_size, uid, uid, 0o700)
        ws = disk / "ws"
        if spec.workspace is not None:
            self.workspace = WorkspaceCopy.create(spec.workspace.path, ws, uid, uid, disk_size, charge=self._charge)
        else:
            ws.mkdir(mode=0o755)
            os.chown(ws, uid, uid)
        config = {
            "seed": secrets.token_hex(64),
            "time_ns": str(time.time_ns()),
            "hostname": "sandbox",
            "machine_id": uuid.uuid4().hex,
            "disk": str(spec.limits.disk),
            "memory": str(spec.limits.memory),
            "pids": str(spec.limits.pids),
            "workspace": spec.workspace.mode if spec.workspace and spec.workspace.mode == "ro" else "rw",
            "user": spec.user,  # the agent's default user (guestinit tells it at "go")
        }
        if spec.network == "allow":
            # the proxy on the host; the guest's relay listens on this port (guestinit)
            self._make_network(host_namespace=False)
            config["egress"] = str(PROXY_PORT)
        elif spec.network == "open":
            # the open mode's namespace with a tap for the guest; the guest takes the
            # sandbox's address on eth0 after the restore (guestinit's start_net)
            link = self._make_network(guest_tap=True).open_net
            assert link is not None
            config.update(net_addr=link.sandbox_addr, net_prefix=str(link.prefix), net_gw=link.host_addr)
        if self._trace:
            config["trace"] = "1"  # guestinit writes its step timestamps to console.log
        self._launch(tmpl, image_disk, ws, config)
        self._place_network_files()
        self.timings["total"] = time.monotonic() - t0

    def _place_network_files(self) -> None:
        """The proxy's files (Node preload, the sandbox CA in the trust bundle) into the
        guest's root, through the agent: the other tiers build them into the root they mount."""
        if self.network is None:
            return
        channel = self._channel_or_raise()
        for path, data in self.network.files.items():
            channel.write_file(path, data, 0o644, as_agent=True)

    def _launch(self, tmpl: template.Template, disk: rootdisk.ImageDisk, ws: Path,
                config: dict[str, str] | None, incoming: socket.socket | None = None) -> None:
        """Start QEMU restoring the template and queue the configuration for the guest;
        ``incoming``: a fork's end of its parent's migration stream instead (livefork.py): its
        RAM is then QEMU's own (anonymous, charged to this sandbox's host cgroup), loaded whole
        from the stream.

        Nothing here polls: the agent and QMP sockets are created (listening)
        before QEMU starts, so the configuration frame is written at once and
        waits in the socket until the restored guest reads it; the snapshot's
        device state comes from an inherited fd, and the VM runs as soon as it
        is loaded (the template was saved without its run state)."""
        assert self.cgroup is not None
        run = self._run_dir
        paths = qemu.VMPaths(run / "agent.sock", run / "qmp.sock", self.console_log)
        readonly = bool(self.spec.workspace and self.spec.workspace.mode == "ro")
        listeners = []
        sockets = [paths.agent_socket, paths.qmp_socket]
        if self.spec.network == "allow":
            sockets.append(run / "egress.sock")  # the egress port's chardev: connected to the bridge
        for path in sockets:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listeners.append(listener)
            listener.bind(str(path))
            listener.listen(1)
        userns = self._userns()
        try:
            files = vmm.open_files(ram=tmpl.ram if incoming is None else None, disk=disk.path, workspace=ws, console=paths.console_log,
                                   userns=userns, owner=self.uid_range.base)
        except BaseException:
            for listener in listeners:
                listener.close()
            raise
        state = os.open(tmpl.state, os.O_RDONLY) if incoming is None else os.dup(incoming.fileno())
        fds = (listeners[0].fileno(), listeners[1].fileno())
        link = self.network.open_net if self.network is not None else None
        # QEMU gets its own copy; ours is closed below, so the tap goes when QEMU does
        tap = link.take_tap() if link is not None else None
        inherited = [state, *(listener.fileno() for listener in listeners), *([tap] if tap is not None else []),
                     *files.values(), userns]
        argv = qemu.command_line(
            accel=tmpl.accel, ram_mb=tmpl.ram_mb, mem_path=vmm.fd_path(files["ram"]) if "ram" in files else None,
            share=False,
            assets=self._tier.assets, paths=dataclasses.replace(paths, console_log=vmm.fd_path(files["console"])),
            disk=vmm.fd_path(files["disk"]), workspace=vmm.fd_path(files["ws"]), workspace_readonly=readonly,
            incoming=True,
            listen_fds=fds, confined=True, egress_fd=listeners[2].fileno() if len(listeners) > 2 else None,
            tap_fd=tap,
        )
        argv += ["-name", self.id]  # its files are descriptors now: the name says whose it is (ps, leak checks)
        procs_files = [str(path) for path in self.cgroup.procs_files(self.cgroup.leaf("vmm"))]
        argv = vmm.joining(procs_files, [
            *vmm.launcher(agent_binary(self._tier.state_dir), userns, tmpl.accel, self._tier.seccomp), *argv])
        if self._trace:
            argv += qemu.TRACE_ARGS
            self.trace_wall0 = time.time()
        t0 = time.monotonic()
        qmp: qemu.QMP | None = None
        try:
            with open(self.qemu_log, "wb") as log:
                self._proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/",
                    pass_fds=inherited,
                )
            self.timings["qemu_spawned"] = time.monotonic() - t0
            # QEMU holds the listening sockets now; with ours closed, a QEMU that dies before it
            # accepts resets our connections at once instead of leaving them queued for 60 s
            for listener in listeners:
                listener.close()
            # both connects complete at once (the listen backlog): QEMU accepts later
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            self._sock.connect(str(paths.agent_socket))
            if config is not None:  # (a live snapshot's guest is past its configuration: live.py)
                payload = b"".join(f"{k}={v}".encode() + b"\0" for k, v in config.items())
                self._sock.sendall(struct.pack("<I", len(payload)) + payload)
            if len(sockets) > 2:
                self._start_bridge(sockets[2])
            qmp_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            qmp_sock.connect(str(paths.qmp_socket))
            qmp = qemu.QMP(qmp_sock, timeout=START_TIMEOUT)  # returns once QEMU is up
            self.timings["qemu_start"] = time.monotonic() - t0
            # a template's or snapshot's RAM is the file mapped, not in the stream; a fork's all is
            qmp.command("migrate-set-capabilities",
                        capabilities=[{"capability": "x-ignore-shared", "state": incoming is None}])
            qmp.command("migrate-incoming", uri=f"fd:{state}")
            self.timings["migrate_incoming"] = time.monotonic() - t0  # restoring, not booting
        except (OSError, SandboxError) as exc:
            if qmp is not None:
                qmp.close()
            raise SandboxError(f"restoring the VM snapshot failed ({exc}): {self._log_tail()}") from None
        finally:
            os.close(state)
            if tap is not None:
                os.close(tap)
            for fd in files.values():
                os.close(fd)
            self._drop_userns()  # QEMU holds the namespace now
            for listener in listeners:
                listener.close()  # again, if QEMU never started (closing twice is harmless)
        if self._trace:
            threading.Thread(target=self._trace_restore, args=(qmp, t0), daemon=True).start()
        else:
            qmp.close()
        if config is None:
            return  # its agent is past "ready": live.setup_restored finds its answer in the stream
        self._channel = AgentChannel(os.dup(self._sock.fileno()), os.dup(self._sock.fileno()))
        # a command's own user= is honoured; without one it runs as the agent's default user, told
        # at "go" (uid 1000 with no capability, or guest root for a sandbox created with user="root")
        self._channel.user_ids = USER_IDS
        try:
            # a failed load makes QEMU exit, which closes the channel: no need to watch it
            self._channel.wait_ready(START_TIMEOUT)
        except SandboxClosed:
            raise SandboxError(f"the restored guest did not start its agent: {self._log_tail()}") from None
        self.timings["ready"] = time.monotonic() - t0

    def _start_bridge(self, path: Path) -> None:
        """Connect to the egress port's chardev (QEMU accepts it later, before the guest
        runs) and carry its connections to the proxy from a thread of our own."""
        assert self.network is not None and self.network.proxy_socket is not None
        port = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            port.connect(str(path))
        except OSError:
            port.close()
            raise
        self._bridge = EgressBridge(self.id, port, self.network.proxy_socket, self.network.audit_log)

    def _trace_restore(self, qmp: qemu.QMP, t0: float) -> None:
        """When tracing (bench/microvm.py): when the restored VM started running.
        Off the normal path: there the agent answering says the VM is up."""
        try:
            qmp.wait_resumed()
            self.timings["restore"] = time.monotonic() - t0
        except (OSError, SandboxError):
            pass
        finally:
            qmp.close()

    @property
    def console_log(self) -> Path:
        """Where QEMU writes the guest's serial console: on the sandbox's disk tmpfs, so what the
        guest writes there counts against its disk limit (and its host cgroup's memory).  A guest
        root writing to ``/dev/ttyS0`` grew a file in the host's state directory without bound."""
        return self._run_dir / "disk" / "console.log"

    @property
    def qemu_log(self) -> Path:
        """Where QEMU's own output goes, on the disk tmpfs too: a guest root driving a virtio
        device wrongly has QEMU print an error per notify, and a loop of them (a module of its
        own) wrote 168 MB to the host's state directory in 63 s (helper 91)."""
        return self._run_dir / "disk" / "qemu.log"

    def _log_tail(self) -> str:
        return qemu.log_tail(self.qemu_log, self.console_log)

    # -- live snapshots (live.py) --------------------------------------------
    def qmp(self) -> qemu.QMP:
        """A new QMP connection to the running QEMU (its listener takes one client at a time)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(str(self._run_dir / "qmp.sock"))
            return qemu.QMP(sock, timeout=converter.MIGRATE_TIMEOUT)
        except BaseException:
            sock.close()
            raise

    def snapshot(self, dest: Path, shared: Path | None = None) -> int:
        """A live snapshot (memory, devices, processes, workspace) into ``dest``, whole; the VM
        runs on."""
        written, rest = self.snapshot_begin(dest, shared)
        try:
            return written + rest.finish(dest)
        finally:
            rest.abandon()

    def snapshot_begin(self, dest: Path, shared: Path | None = None) -> tuple[int, live.RamWrite]:
        """A live snapshot into ``dest`` but for its memory image, held in memory until
        ``finish`` writes it (the VM runs on meanwhile).  A paused VM is let run for the snapshot
        (its commands stay frozen) and paused again.  One image of a VM is held at a time: a
        second snapshot waits for the first one's to be written."""
        with self._snapshot_lock:
            if self._ram_write is not None:
                self._ram_write.done.wait()
            was_paused = self.paused
            if was_paused:
                self.resume()
            try:
                written, rest = live.capture(self, self._channel_or_raise(), dest, shared)
            except BaseException:
                if was_paused:
                    self.pause()
                raise
            try:
                if was_paused:
                    self.pause()
            except BaseException:
                rest.abandon()  # the caller never sees it: its converter is closed here
                raise
            self._ram_write = rest
            return written, rest

    def _end_converters(self) -> None:
        """No snapshot converter of this VM outlives it: each runs as the sandbox's uids (released
        next, and handed to a new sandbox) and holds a copy of the guest's RAM.  One whose image is
        being written (the store's background write) has :data:`CONVERTER_GRACE` to finish it; any
        left then -- its owner lost it, or it hangs -- is killed with its group.  Before the
        sandbox's own group goes: the janitor reaps a converter's group whose sandbox has none."""
        pending = self._ram_write
        if pending is not None:
            pending.done.wait(CONVERTER_GRACE)
        with self._lock:
            left = list(self._helper_groups)
        if not left:
            return
        converter.kill_converters(self.id)  # (each is in its group: by name too, as the janitor does)
        for group in left:
            self.forget_helper_group(group)
            group.destroy()

    # -- CPU weight ----------------------------------------------------------
    def share_cpu(self, weight: float) -> None:
        super().share_cpu(weight)
        with self._lock:  # (a helper group weighed meanwhile gets this weight here)
            self._cpu_weight = weight
            for group in self._helper_groups:
                group.share_cpu(weight)

    def weigh_helper_group(self, group: cgroups.SandboxCgroup) -> None:
        """Give ``group`` (a helper's, made for this VM) the sandbox's CPU weight, now and as it
        changes, until :meth:`forget_helper_group`."""
        with self._lock:
            if self._cpu_weight is not None:
                group.share_cpu(self._cpu_weight)
            self._helper_groups.add(group)

    def forget_helper_group(self, group: cgroups.SandboxCgroup) -> None:
        with self._lock:
            self._helper_groups.discard(group)

    # -- commands ----------------------------------------------------------
    def _fire(self, kind: int, payload: bytes) -> None:
        """Send a request whose answer nobody waits for (safe from the reader thread).
        The agent handles requests in order, so it is done before any later one."""
        channel = self._channel_or_raise()
        channel.send(kind, channel.new_id(), payload)

    def start(self, request: ExecRequest, on_output: OutputCallback | None = None) -> Process:
        channel = self._channel_or_raise()
        request = self.with_network_env(request)
        with self._lock:
            self._exec_count += 1
            leaf = f"{GUEST_CGROUP}/e{self._exec_count}"
        # not waited for here: the agent handles requests in order, so its answer
        # arrives before the command's "started", where place() checks it
        made = channel.begin(T_FMKDIR | T_AS_AGENT, struct.pack("<I", 0o755) + leaf.encode() + b"\0")

        def place(nspid: int) -> None:
            # runs on the reader thread before the agent lets the command exec;
            # no leaf (an error here) refuses the command, as a failed make_dir did
            made(0)
            # the channel itself, not _fire: a pause landing as the command starts must not refuse
            # its placement (the frame waits in the socket until the VM runs again)
            channel.send(T_FWRITE | T_AS_AGENT, channel.new_id(), struct.pack("<II", 0o644, 0)
                         + f"{leaf}/cgroup.procs".encode() + b"\0" + str(nspid).encode())

        started: list[AgentProcess] = []

        def kill() -> None:
            try:
                self._kill_leaf(leaf)
                if started:
                    self._backstop_kill(started[0])
            except SandboxClosed:
                pass

        def finish(proc: AgentProcess) -> None:
            self._deadlines.ended(leaf)
            try:
                made(0)  # forgets the request if the command failed before it started
            except (SandboxClosed, SandboxError):
                pass
            try:
                events = channel.read_file(f"{leaf}/memory.events", 4096, as_agent=True).decode()
                counts = dict(line.split() for line in events.splitlines() if len(line.split()) == 2)
                proc.oom_killed = int(counts.get("oom_kill", "0")) > 0
                if proc.oom_killed:
                    kill()  # the OOM killer takes one task; finish the tree
                # an emptied leaf goes; one a background child lives in goes later (.leaves)
                self._left_leaves.remove(channel, leaf, self._exec_count)
            except (SandboxClosed, SandboxError, ValueError):
                pass
            self.sync()

        proc = channel.start(request, on_output, place, kill, finish)
        started.append(proc)
        self._deadlines.started(leaf, proc)
        return proc

    def _backstop_kill(self, proc: AgentProcess) -> None:
        """After a command's kill: wait up to KILL_GRACE of the VM's running time for its end,
        then stop the VM (``pause.backstop_kill``, as gVisor's)."""
        why = f"its agent did not confirm a command's kill within {KILL_GRACE:.0f} s"

        def stop() -> None:
            proc.stopped_by_host(why)
            self._stop_vm(why)

        backstop_kill(proc, self._channel_even_paused().pause_clock, KILL_GRACE, lambda: self._closed, stop,
                      f"corral-vm-kill-{self.id}")

    def _stop_vm(self, why: str) -> None:
        """Kill QEMU (and all of the sandbox's host cgroup): its agent's channel closes, so every
        command running ends as stopped and every later call raises SandboxClosed at once."""
        self._stopped_why = why
        if self.cgroup is not None:
            self.cgroup.kill_all()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    def _channel_even_paused(self) -> AgentChannel:
        if self._stopped_why and not self._closed:
            raise SandboxClosed(f"sandbox {self.id} was stopped: {self._stopped_why}", sandbox_id=self.id)
        return super()._channel_even_paused()

    def _kill_leaf(self, leaf: str) -> None:
        # the channel even if paused: the kill waits in the socket until the VM runs again (through
        # _fire it raised SandboxPaused, and the kill was done at the resume all the same)
        channel = self._channel_even_paused()
        channel.send(T_FWRITE | T_AS_AGENT, channel.new_id(),
                     struct.pack("<II", 0o644, 0) + f"{leaf}/cgroup.kill".encode() + b"\0" + b"1")

    def _kill_carried(self, leaf: str) -> None:
        """Kill a command carried over a live snapshot (its deadline, or ``commands.kill``), with the
        backstop a command of this VM's own has: a copy of the command is as able to stop the copy's
        agent, which writes the kill, and the copy then ran on past its timeout with nothing to stop
        it.  Not seen to end within KILL_GRACE of the VM's running time, the VM stops."""
        self._kill_leaf(leaf)
        channel = self._channel_even_paused()
        ended = LeafEnded(channel, leaf, lambda: self._closed, KILL_GRACE)
        why = f"its agent did not confirm the kill of a command copied into it within {KILL_GRACE:.0f} s"

        def watch() -> None:
            try:
                backstop_kill(ended, channel.pause_clock, KILL_GRACE, lambda: self._closed, lambda: self._stop_vm(why),
                              f"corral-vm-kill-{self.id}")
            finally:
                ended.stop()

        # from its own thread: the deadline's timer, or a caller of commands.kill, returns at once
        threading.Thread(target=watch, name=f"corral-vm-kill-{self.id}", daemon=True).start()

    def command_deadlines(self) -> list[Carried]:
        """Each command running, with its time left: what a live snapshot or a fork keeps (.leaves)."""
        return self._deadlines.left()

    def carry_commands(self, commands: list[Carried]) -> None:
        """This sandbox was restored from a live state (back from disk, a fork, a snapshot's copy):
        the commands running in it then end when their time is up."""
        self._deadlines.restored(commands)

    def carried_commands(self) -> list[tuple[int, list[str], str]]:
        carried = self._deadlines.carried()
        if not carried or self.paused:  # (a paused agent answers nothing: those not yet seen to end)
            return [(command.pid, list(command.argv), command.cwd) for command in carried]
        running = []
        channel = self._channel_or_raise()
        for command in carried:
            if "populated 1" in leaf_events(channel, command.leaf):
                running.append((command.pid, list(command.argv), command.cwd))
            else:  # exited on its own: its leaf goes as an ended command's does
                self._deadlines.forget(command.leaf)
                with contextlib.suppress(SandboxClosed, SandboxError):
                    self._left_leaves.remove(channel, command.leaf, self._exec_count)
        return running

    def kill_carried(self, pid: int) -> bool:
        return self._deadlines.kill(pid)

    # -- lifecycle ---------------------------------------------------------
    def alive(self) -> bool:  # the VM process too, not only the channel
        return (not self._closed and self._channel is not None and not self._channel.closed.is_set()
                and self._proc is not None and self._proc.poll() is None)

    def reap_record(self) -> dict[str, Any]:
        return {"uid": self.uid, "qemu_pid": self._proc.pid if self._proc else None, "network": self.spec.network}

    @property
    def kernel_release(self) -> str:
        return self._tier.assets.kernel_release

    def qemu_pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _stop(self) -> None:
        # the guest's state is thrown away, so there is nothing to shut down
        # gracefully: the workspace is already on the host (9p, no cache)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        if self._proc is not None:
            self._proc.wait(timeout=10)
        self._end_converters()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._channel is not None:
            self._channel.close()
        if self._sock is not None:
            self._sock.close()
        try:
            self.sync()
        except (OSError, SandboxError):
            pass

    def _release(self) -> None:
        self._deadlines.close()
        # after QEMU: no guest connection can arrive any more; before the proxy it feeds closes
        if self._bridge is not None:
            self._bridge.close()

