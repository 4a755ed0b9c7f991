"""The base of every sandbox that runs Linux userland with ``corral-agent`` in it
(process, gVisor, microVM): it owns the host-side resources they all have, so
each tier writes only how it launches its guest.

Resources and their one owner (this class; :meth:`LinuxSandbox.close` releases
each, and runs for a sandbox whose ``__init__`` failed half way too):

- host uid ranges: reserved with :meth:`_reserve_range` (``self.uid_range`` first; ``self.uid``
  is its sandbox user's host uid), released last;
- the run directory (given by the caller, empty): unmounted and removed;
- the cgroup (:meth:`_make_cgroup`): killed and removed once the tier's own
  processes are stopped (:meth:`_stop`);
- the network side (:meth:`_make_network`): closed;
- the user namespace that maps the whole uid range (:meth:`_start_userns`, :meth:`_userns`): its descriptor closed
  (:meth:`_drop_userns` once the guest holds the namespace, else at close); likewise the workspace's (its
  owner mapped to the sandbox user, for the idmapped view under the workspace overlay);
- the root overlay and the workspace (overlay or copy) (:meth:`_build_root`): its mounts go with the run
  directory, or, made in the sandbox's own mount namespace (``_mountns``, the process tier's), with that
  namespace: its holder is closed here, or became the tier's launcher and ends with the sandbox.

A subclass sets its own attributes, then calls ``super().__init__``, which
reserves the uid and calls :meth:`_setup` (the tier's launch); it implements
:meth:`_stop` (end its processes, before the cgroup goes) and may extend
:meth:`_release` (its own extra resources, before the network closes).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path

from ...egress.network import SandboxNetwork
from ...errors import HostError, InvalidSpec, InvalidState, SandboxClosed, SandboxError, SandboxPaused, SnapshotCorrupt
from ...host import cgroups, charged, mounts, ws_overlay
from ...host.mountns import MountNamespace
from ...host.owner_watch import OwnerWatch
from ...host.portfwd import Connect, NetnsConnector, PortForward
from ...host.procs import exited_within
from ...host.uids import UidRange, allocate_range, release_range
from ...host.userns import PendingUserns, UsernsMaking, start_userns
from ...host.ws_copy import WorkspaceCopy
from ...host.ws_overlay import WorkspaceOverlay
from ...spec import Limits, SandboxSpec
from ..base import FileEntry, TierSandbox
from . import fs_snapshot
from .agent import RELAY_UID, AgentChannel
from .ports import agent_connect
from .rootfs import AGENT_PATH, SandboxRoot, build_root

log = logging.getLogger(__name__)


class LinuxSandbox(TierSandbox):
    #: the sandbox's 65,536 host ids (root inside is its base)
    uid_range: UidRange
    #: the host uid of the sandbox user (uid 1000 inside): it owns the sandbox's files on the host
    uid: int
    cgroup: cgroups.SandboxCgroup | None = None
    workspace: WorkspaceCopy | WorkspaceOverlay | None = None
    _channel: AgentChannel | None = None
    #: the run directory's mounts when known (None: search for them at close)
    _mounts: list[Path] | None = None
    #: whether the tier's root is the overlay of .rootfs, whose files :meth:`snapshot` copies
    _filesystem_snapshots = False
    hostname = "sandbox"
    #: the sandbox's user namespace (whole range mapped), while the host holds it
    _userns_fd: int | None = None
    _userns_pending: UsernsMaking | None = None
    #: the workspace's user namespace (its owner mapped to the sandbox user), while being made
    _ws_userns_pending: PendingUserns | None = None
    _ws_userns_fd: int | None = None
    _userns_helper: Path | None = None
    #: the agent binary as the host runs it, for the watch kept over the sandbox while it is frozen
    #: (:mod:`corral.host.owner_watch`); None: no watch
    _host_agent: Path | None = None
    _owner_watch: OwnerWatch | None = None
    #: the sandbox's own mount namespace, where :meth:`_build_root` mounts (None: the host's)
    _mountns: MountNamespace | None = None

    def __init__(self, state_dir: Path, spec: SandboxSpec, sandbox_id: str, run_dir: Path,
                 seed: tuple[Path, str] | None = None) -> None:
        #: a snapshot to start from: (its directory, its manifest's sha256); a fresh identity then
        self._seed = seed
        if seed is not None:
            self.hostname = sandbox_id
        self.id = sandbox_id
        self.spec = spec
        self._state_dir = state_dir
        self._run_dir = run_dir
        self._closed = False
        self._lock = threading.Lock()
        #: held by a snapshot from its freeze to its thaw: another snapshot, a pause or a resume
        #: waits for it (a resume in the middle thawed the sandbox while its files were copied,
        #: and what it then changed under the copy was copied)
        self._snapshotting = threading.Lock()
        self._uids: list[int] = []
        #: the open forwards (a closed one is dropped at the next expose: 10000 expose/close kept 10000)
        self._forwards: list[PortForward] = []
        #: forwards made so far: names each one's Unix socket (a count of the open ones named a new
        #: socket after a live one once closed ones are dropped)
        self._forwards_made = 0
        self._ports_connector: NetnsConnector | None = None
        try:
            self.uid_range = self._reserve_range()
            self.uid = self.uid_range.user
            self._setup()
        except BaseException:
            self.close()
            raise

    # -- what a tier writes ------------------------------------------------
    @abstractmethod
    def _setup(self) -> None:
        """Make the sandbox's resources (with the helpers below) and launch its guest."""

    @abstractmethod
    def _stop(self) -> None:
        """End the tier's own processes (the cgroup is killed and removed right after)."""

    def _release(self) -> None:
        """Release what the tier owns beyond the base's resources (runs even if :meth:`_stop` failed)."""

    # -- resources, each released by close() -------------------------------
    def _reserve_range(self) -> UidRange:
        """A range of 65,536 host ids of the sandbox's own (recorded before anything uses it)."""
        reserved = allocate_range(self._state_dir, self.id)
        self._uids.append(reserved.base)
        return reserved

    def _reserve_uid(self) -> int:
        """One more host uid of the sandbox's own (a range's sandbox-user uid)."""
        return self._reserve_range().user

    def _start_userns(self, helper: Path) -> None:
        """Start making the sandbox's user namespace (``helper``: the agent binary, run as
        ``--userns``); other set-up may run meanwhile, then :meth:`_userns`."""
        self._userns_pending = start_userns(helper, self.uid_range)
        self._userns_helper = helper

    def _userns(self) -> int:
        """The sandbox's user namespace (its uid range mapped to 0-65535 inside), started by
        :meth:`_start_userns`: :meth:`_build_root` asks for it once the rest of the root is ready."""
        if self._userns_fd is None:
            assert self._userns_pending is not None, "_start_userns first"
            self._userns_fd = self._userns_pending.finish()
        return self._userns_fd

    def _workspace_userns(self, maps: tuple[str, str]) -> int:
        """The workspace's user namespace with ``maps`` (:func:`corral.host.ws_overlay.owner_maps`)."""
        if self._ws_userns_fd is None:
            assert self._ws_userns_pending is not None
            self._ws_userns_fd = self._ws_userns_pending.finish(maps)
        return self._ws_userns_fd

    def _drop_userns(self) -> None:
        fds = (self._userns_fd, self._ws_userns_fd)
        pendings = (self._userns_pending, self._ws_userns_pending)
        self._userns_fd = self._ws_userns_fd = None
        self._userns_pending = self._ws_userns_pending = None
        for fd in fds:
            if fd is not None:
                os.close(fd)
        for pending in pendings:
            if pending is not None:
                pending.close()

    def _make_cgroup(self, limits: Limits, layout: cgroups.Layout) -> cgroups.SandboxCgroup:
        self.cgroup = cgroups.SandboxCgroup(self.id, limits, layout)
        return self.cgroup

    def _charge(self, work: Callable[[], None]) -> None:
        """Run ``work``, which writes onto the sandbox's disk tmpfs from the host (a workspace
        copied in, a snapshot's files restored), in one child placed in the sandbox's memory group
        (``host/charged.py``): a tmpfs page is charged to its writer, and the owner's group, which
        has no limit, paid for them (a 100 MiB copy-in: the owner +208 MiB, the sandbox's group
        and the sandboxes' parent +1).  Needs the cgroup made (:meth:`_make_cgroup`) first."""
        assert self.cgroup is not None, "_make_cgroup first: the pages are charged to it"
        charged.run_in_memory_group(self.cgroup, work)

    def _make_network(self, *, host_namespace: bool = True, socket_gid: int | None = None,
                      guest_tap: bool = False) -> SandboxNetwork:
        # the proxy's socket is the relay's (its own uid inside), not the default user's
        relay_uid = self.uid_range.base + RELAY_UID
        self.network = SandboxNetwork(self.spec, self.id, self._run_dir, relay_uid, host_namespace=host_namespace,
                                      socket_gid=socket_gid, guest_tap=guest_tap)
        return self.network

    def _disk_size(self) -> int:
        """The size of the sandbox's disk tmpfs (what its files may hold): ``disk``, unless the
        tier says otherwise (:func:`.rootfs.disk_held_in_memory`)."""
        return self.spec.limits.disk

    def _build_root(self) -> SandboxRoot:
        """The overlay root on a disk-limited tmpfs in the run directory, with the network's files;
        a host workspace is an overlay on it (:mod:`corral.host.ws_overlay`) where the tier maps a
        uid range (:meth:`_start_userns`), else a copy."""
        if (self.spec.workspace is not None and self._seed is None and ws_overlay.ENABLED
                and self._userns_helper is not None):
            # its helper starts while the image's layers are mounted
            self._ws_userns_pending = start_userns(self._userns_helper, self.uid_range)
        network = self.network
        fill = None
        if self._seed is not None:
            fill = fs_snapshot.filler(*self._seed, self._id_map(), self.hostname, self._disk_size())
        built = build_root(
            self.spec, self._state_dir, self._run_dir, self.uid,
            files=network.files if network is not None else {},
            mount_points=[inside for _, inside in network.binds] if network is not None else [],
            fill=fill,
            userns=self._userns if self._userns_pending is not None else None, root_uid=self.uid_range.base,
            workspace_userns=self._workspace_userns if self._ws_userns_pending is not None else None,
            mounter=self._mountns, disk_size=self._disk_size(), charge=self._charge,
        )
        self.workspace = built.workspace
        self._mounts = built.mounts
        return built

    # -- use ---------------------------------------------------------------
    def _channel_even_paused(self) -> AgentChannel:
        """The agent's channel for a frame that may wait in it while the sandbox is paused (a kill)."""
        if self._closed or self._channel is None:
            raise SandboxClosed(f"sandbox {self.id} is closed", sandbox_id=self.id)
        if self._channel.closed.is_set():
            raise SandboxClosed(f"sandbox {self.id} stopped (its init process died)", sandbox_id=self.id)
        return self._channel

    def _channel_or_raise(self) -> AgentChannel:
        channel = self._channel_even_paused()
        if channel.pause_clock.paused:
            # its agent is frozen: a call would hang until resume() instead of failing
            raise SandboxPaused(f"sandbox {self.id} is paused: resume() it first", sandbox_id=self.id)
        return channel

    # -- pause -------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self._channel is not None and self._channel.pause_clock.paused

    def pause(self) -> None:
        with self._snapshotting:
            self._pause()

    def _pause(self) -> None:
        with self._lock:
            channel, cgroup = self._live()  # refuses a closed or already paused sandbox
            # the clock first: a command's wait must not count frozen time, however short
            channel.pause_clock.pause()
            try:
                # before the freeze: never a moment frozen that the owner's death would not end.
                # Kept until close (whether frozen or not, the sandbox dies with its owner): only
                # the first pause pays its start (~0.5 ms), not every pause and resume
                if self._owner_watch is None and self._host_agent is not None:
                    self._owner_watch = OwnerWatch(self._host_agent, cgroup)
                cgroup.freeze(True)
            except BaseException:
                channel.pause_clock.resume()
                raise

    def resume(self) -> None:
        with self._snapshotting:
            self._resume()

    def _resume(self) -> None:
        with self._lock:
            if self._closed or self._channel is None or self.cgroup is None:
                raise SandboxClosed(f"sandbox {self.id} is closed", sandbox_id=self.id)
            if not self._channel.pause_clock.paused:
                raise InvalidState(f"sandbox {self.id} is not paused", sandbox_id=self.id)
            self.cgroup.freeze(False)
            self._channel.pause_clock.resume()

    def share_cpu(self, weight: float) -> None:
        with self._lock:
            if not self._closed and self.cgroup is not None:
                self.cgroup.share_cpu(weight)

    # -- snapshot --------------------------------------------------------------
    def _on_disk(self) -> Path:
        """The sandbox's disk tmpfs (uppers, workspace copy) as this process reaches it."""
        disk = self._run_dir / "disk"
        return self._mountns.view(disk) if self._mountns is not None else disk

    def _id_map(self) -> fs_snapshot.IdMap:
        return fs_snapshot.id_map(self.uid, id_range=(self.uid_range.base, self.uid_range.size))

    def _before_snapshot(self) -> None:
        """What the tier does before its sandbox is paused for a snapshot (flush caches)."""

    def snapshot(self, dest: Path, shared: Path | None = None) -> int:
        if not self._filesystem_snapshots:
            return super().snapshot(dest, shared)
        with self._snapshotting:
            return self._snapshot(dest, shared)

    def _snapshot(self, dest: Path, shared: Path | None) -> int:
        if self._closed or self._channel is None or self._channel.closed.is_set():
            raise SandboxClosed(f"sandbox {self.id} is closed", sandbox_id=self.id)
        was_paused = self.paused
        if not was_paused:
            self._before_snapshot()
            self._pause()
        try:
            disk = self._on_disk()
            uppers = sorted(disk.glob("L*-upper"), key=lambda p: int(p.name[1:].partition("-")[0]))
            network = self.network
            own = {AGENT_PATH, "/etc/hostname", "/etc/hosts", "/etc/machine-id",
                   *(network.files if network is not None else ()),
                   *(inside for _, inside in (network.binds if network is not None else ()))}
            layers = [(p.name.partition("-")[0], p) for p in uppers] + [("ws", disk / "ws")]
            return fs_snapshot.capture(layers, dest, self._id_map(), {"L0": {p.lstrip("/") for p in own}},
                                       self._disk_size(), shared)
        except (OSError, SnapshotCorrupt) as exc:
            if self._closed or self._channel is None or self._channel.closed.is_set():
                # killed meanwhile: its disk went under the copy ("No such file or directory")
                raise SandboxClosed(f"sandbox {self.id} was closed during its snapshot", sandbox_id=self.id) from exc
            raise
        finally:
            if not was_paused:
                with contextlib.suppress(SandboxClosed):  # closed meanwhile
                    self._resume()

    def _live(self) -> tuple[AgentChannel, cgroups.SandboxCgroup]:
        channel = self._channel_or_raise()
        if self.cgroup is None:
            raise SandboxClosed(f"sandbox {self.id} is closed", sandbox_id=self.id)
        return channel, self.cgroup

    def read_file(self, path: str, max_bytes: int) -> bytes:
        return self._channel_or_raise().read_file(path, max_bytes)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._channel_or_raise().write_file(path, data, mode)
        self.sync()

    def list_dir(self, path: str) -> list[FileEntry]:
        return self._channel_or_raise().list_dir(path)

    def stat(self, path: str) -> FileEntry:
        return self._channel_or_raise().stat(path)

    def remove(self, path: str, recursive: bool = False) -> None:
        self._channel_or_raise().remove(path, recursive)
        self.sync()

    def make_dir(self, path: str, mode: int = 0o755) -> None:
        self._channel_or_raise().make_dir(path, mode)
        self.sync()

    # -- ports ---------------------------------------------------------------
    #: the agent's path inside the sandbox, for tiers whose forwards run ``agent --connect PORT``
    #: commands (their loopback is not the host kernel's: see .ports); None: a host thread connects
    #: from inside the sandbox's network namespace (:meth:`_port_netns_pid`)
    _connector_path: str | None = None

    def _agent_connector(self) -> str | None:
        """The agent's path inside the sandbox for ``--connect`` commands (or None: use a netns)."""
        return self._connector_path

    def _port_netns_pid(self) -> int | None:
        """A host pid in the sandbox's own network namespace, if the sandbox's loopback is the
        kernel's (then a forward connects from a host thread inside it); None otherwise."""
        return None

    def expose_port(self, port: int, unix: bool = False, other_users: Sequence[int] = ()) -> PortForward:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise InvalidSpec(f"port {port!r} must be a TCP port number (1-65535)")
        if unix and other_users:
            raise InvalidSpec("local_users: a Unix socket forward is its owner's alone (0600); "
                              "let other users in through a TCP forward")
        self._channel_or_raise()
        with self._lock:
            if self._closed:
                raise SandboxClosed(f"sandbox {self.id} is closed", sandbox_id=self.id)
            connect: Connect
            path = self._agent_connector()
            if path is not None:
                connect = lambda port, _timeout: agent_connect(self.start, path, port)  # noqa: E731
            else:
                if self._ports_connector is None:
                    pid = self._port_netns_pid()
                    if pid is None:
                        raise InvalidSpec(f"sandbox {self.id}: the {self.spec.tier} tier cannot forward ports")
                    self._ports_connector = NetnsConnector(pid, self.id)
                connect = self._ports_connector.connect
            unix_path = None
            if unix:
                (self._run_dir / "ports").mkdir(mode=0o700, exist_ok=True)
                unix_path = self._run_dir / "ports" / f"{port}-{self._forwards_made}.sock"
            forward = PortForward(port, connect, unix_path, other_users=other_users)
            self._forwards_made += 1
            self._forwards = [f for f in self._forwards if not f.closed]
            self._forwards.append(forward)
            return forward

    def _close_ports(self) -> None:
        with self._lock:
            forwards, self._forwards = self._forwards, []
            connector, self._ports_connector = self._ports_connector, None
        for forward in forwards:
            forward.close()
        if connector is not None:
            connector.close()

    def sync(self) -> None:
        if self.workspace is not None and self.spec.workspace and self.spec.workspace.mode == "rw":
            self.workspace.sync_back()

    def _last_write_back(self) -> None:
        """At destroy, once nothing runs in the sandbox: write back what no command's write-back
        saw (a background process's writes, a write through a shared mapping) -- an overlay
        workspace walks its upper layer whole (:meth:`WorkspaceOverlay.close`)."""
        if not isinstance(self.workspace, WorkspaceOverlay):
            return
        try:
            self.workspace.close(write_back=bool(self.spec.workspace and self.spec.workspace.mode == "rw"))
        except (OSError, SandboxError) as exc:  # the host directory went away...: destroy goes on
            log.warning("sandbox %s: the last write-back of its workspace failed: %s", self.id, exc)

    def alive(self) -> bool:
        return not self._closed and self._channel is not None and not self._channel.closed.is_set()

    # -- teardown ----------------------------------------------------------
    def _wait_killed(self, proc: subprocess.Popen[bytes], what: str) -> None:
        """After ``proc`` and the sandbox's tasks were killed: wait for it for as long as the tasks
        keep ending (:meth:`SandboxCgroup.wait_drained`); ``HostError`` if they stop."""
        drained = (self.cgroup.wait_drained(lambda: proc.poll() is not None) if self.cgroup is not None
                   else exited_within(proc, 5))
        if not drained:
            raise HostError(f"sandbox {self.id}: {what} did not end after a kill "
                            f"(the janitor removes what is left)", sandbox_id=self.id)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.paused and self.cgroup is not None:
                # the tiers stop their guest by asking it to exit, which a frozen one cannot do
                with contextlib.suppress(OSError, SandboxError):
                    self.cgroup.freeze(False)
                if self._channel is not None:
                    self._channel.pause_clock.resume()
            watch, self._owner_watch = self._owner_watch, None
        try:
            if watch is not None:  # its owner kills the sandbox now, itself
                watch.stop()
            self._close_ports()  # before the processes go: a relayed connection is cut, not reset
            self._stop()
            if self.cgroup is not None:
                self.cgroup.destroy()
            self._last_write_back()
        finally:
            if self.workspace is not None:  # its descriptors (an overlay's last write-back is done already)
                self.workspace.close(write_back=False)
            self._drop_userns()
            self._release()
            if self._mountns is not None:
                self._mountns.close()  # a holder that never launched: it exits, its mounts with it
            if self.network is not None:
                self.network.close()
            mounts.unmount_all(self._run_dir, known=self._mounts)  # None: a half-built root, search
            shutil.rmtree(self._run_dir, ignore_errors=True)
            for uid in self._uids:
                release_range(self._state_dir, uid, owner=self.id)
