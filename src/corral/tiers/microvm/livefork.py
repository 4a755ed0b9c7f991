"""``fork(n)`` of a running microVM: its migration stream straight into n new VMs.

No snapshot is stored and nothing goes to disk or through a converter (live.py): a fork's
memory is loaded from the stream into QEMU's own anonymous RAM, so it is the fork's alone,
charged to the fork's own host cgroup and gone with its QEMU -- nothing else to own or reap.
The price: n forks hold n copies of what the parent's memory holds, and the parent stays stopped
until the slowest has loaded: so only up to ``MicroVMTier.direct_forks`` at once; more forks go
through a stored snapshot (live.py), whose memory image they share copy-on-write.

1. each fork is started as a new VM is (host cgroup, tmpfs, user namespace, QEMU), its QEMU
   waiting for a migration on its end of a socket pair (:func:`setup_forked`, on a thread per
   fork); meanwhile the parent's commands are frozen and its workspace unmounted, as for a live
   snapshot, and the workspace copy is captured into the parent's run dir;
2. once every fork's QEMU is up, the parent is stopped and migrated: into the one fork's
   socket, or through a thread copying the stream to each (:func:`migrate_into`); then it runs
   on, remounts its workspace and thaws -- unchanged;
3. each fork, loaded, runs with the parent's processes still frozen: its own copy of the
   workspace, a fresh identity (live.awaken: RNG reseeded, boot id, hostname, machine id), its
   workspace mounted, and then its processes thaw; the parent's commands among them end when
   the time their timeouts had left is up (leaves.CommandDeadlines), as in the parent.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import SandboxError
from ...spec import SandboxSpec
from ..linux import fs_snapshot
from ..linux.agent import AgentChannel
from ..linux.agent_build import agent_binary
from . import live, template
from .converter import MIGRATE_TIMEOUT
from .leaves import Carried
from .rootdisk import ImageDisk

if TYPE_CHECKING:
    from .sandbox import MicroVMSandbox
    from .tier import MicroVMTier

#: bytes per read of the stream copied to more than one fork
FAN_OUT_CHUNK = 1 << 20


@dataclass
class ForkSource:
    """What one fork is made from: its parent's description and its end of the stream."""

    ram_mb: int
    disk: ImageDisk
    #: the guest cgroup leaves the parent's commands used: the fork's start after them
    leaves: int
    readonly_workspace: bool
    #: the fork's end of the migration stream (its QEMU gets a copy)
    incoming: socket.socket
    #: set by the fork once its QEMU waits for the stream, or it failed (``failed``)
    up: threading.Event = field(default_factory=threading.Event)
    failed: bool = False
    #: set by the parent once the stream starts (or the fork is abandoned: ``files`` stays None)
    migrating: threading.Event = field(default_factory=threading.Event)
    #: the parent's workspace copy, and the last agent request id its host side sent
    files: Path | None = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    last_id: int = 0
    #: the parent's commands running as it was migrated, each with its time left: the fork ends them
    commands: list[Carried] = field(default_factory=list)


def setup_forked(vm: MicroVMSandbox, source: ForkSource) -> None:
    """Start ``vm`` as a fork: its host side as a new VM's, QEMU waiting for the parent's stream;
    then, loaded, its own workspace copy and a fresh identity before its processes thaw."""
    run = vm._run_dir
    t0 = time.monotonic()
    try:
        disk = source.disk
        with contextlib.suppress(OSError):  # its own link: the parent's may be in a run dir that goes first
            os.link(disk.path, run / "image.erofs")
            disk = ImageDisk(run / "image.erofs", disk.key)
        ws = live.host_side(vm, source.ram_mb, disk, source.leaves)
        vm._start_userns(agent_binary(vm._tier.state_dir))
        vm._launch(template.Template(run, source.ram_mb, vm._tier.accel, 0.0), disk, ws, None,
                   incoming=source.incoming)
        vm.timings["qemu_up"] = time.monotonic() - t0
    except BaseException:
        source.failed = True
        raise
    finally:
        source.up.set()
    if not source.migrating.wait(MIGRATE_TIMEOUT) or source.files is None:
        raise SandboxError(f"sandbox {vm.id}: its parent's fork was abandoned")
    ids, files, entries = vm._id_map(), source.files, source.entries
    vm._charge(lambda: fs_snapshot.restore(files, entries, "ws", ws, ids))
    vm.timings["files"] = time.monotonic() - t0
    wake = live.identity(vm.hostname, uuid.uuid4().hex, str(uuid.uuid4()), os.urandom(64).hex())
    live.awaken(vm, source.last_id + live.ID_MARGIN, wake, source.readonly_workspace, t0)
    vm.carry_commands(source.commands)  # copied with the parent's memory: each ends when its time is up


def fork(tier: MicroVMTier, parent: MicroVMSandbox, spec: SandboxSpec,
         children: list[tuple[str, Path]]) -> list[MicroVMSandbox]:
    """``len(children)`` forks of ``parent`` (each a (sandbox id, empty run dir)), all made or
    none: a failure closes those made and raises."""
    from .sandbox import MicroVMSandbox

    readonly = live.readonly_workspace(parent)
    feeds, sources = [], []
    for _ in children:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (ours, theirs):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, live.SOCKET_BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, live.SOCKET_BUFFER)
        feeds.append(ours)
        sources.append(ForkSource(parent.ram_mb, parent.image_disk, parent._exec_count, readonly, theirs))
    made: list[MicroVMSandbox | None] = [None] * len(children)
    errors: list[BaseException | None] = [None] * len(children)

    def build(index: int) -> None:
        sandbox_id, run_dir = children[index]
        try:
            made[index] = MicroVMSandbox(tier, spec, sandbox_id, run_dir, fork=sources[index])
        except BaseException as exc:  # (the fork closed itself)
            errors[index] = exc
            sources[index].incoming.close()  # its stream ends here: the parent's migration fails

    threads = [threading.Thread(target=build, args=(i,), name=f"corral-fork-{children[i][0]}", daemon=True)
               for i in range(len(children))]
    for thread in threads:
        thread.start()
    work = parent._run_dir / f"fork-{secrets.token_hex(4)}"
    try:
        try:
            with parent._snapshot_lock:  # one live snapshot or fork of a VM at a time
                was_paused = parent.paused
                if was_paused:  # let run for it (its commands stay frozen), paused again after
                    parent.resume()
                try:
                    migrate_into(parent, parent._channel_or_raise(), sources, feeds, work)
                finally:
                    if was_paused:
                        parent.pause()
        finally:
            for source in sources:
                source.migrating.set()  # (one not told to load is abandoned)
            for thread in threads:
                thread.join()
    except BaseException:
        _close(made)
        # a fork that failed before its stream (its QEMU did not start) made the migration fail
        for error, source in zip(errors, sources, strict=True):
            if error is not None and source.failed:
                raise error from None
        raise
    finally:
        for end in (*feeds, *(source.incoming for source in sources)):
            end.close()
        shutil.rmtree(work, ignore_errors=True)
    for error in errors:
        if error is not None:
            _close(made)
            raise error
    return [vm for vm in made if vm is not None]


def _close(made: list[MicroVMSandbox | None]) -> None:
    for vm in made:
        if vm is not None:
            vm.close()


def migrate_into(vm: MicroVMSandbox, channel: AgentChannel, sources: list[ForkSource],
                 feeds: list[socket.socket], work: Path) -> None:
    """Migrate the running ``vm`` into every fork of ``sources`` (each fed through ``feeds``),
    its commands frozen and its workspace copied meanwhile; it runs on unchanged."""
    with live.frozen_and_detached(vm, channel, "fork"):
        t0 = time.monotonic()
        work.mkdir(mode=0o700)
        files = work / "files"
        fs_snapshot.capture([("ws", vm._run_dir / "disk" / "ws")], files, vm._id_map(), {}, vm.spec.limits.disk, None)
        entries = fs_snapshot.load_manifest(files, fs_snapshot.manifest_digest(files))
        vm.timings["fork_workspace"] = time.monotonic() - t0
        # the forks' QEMUs up first (started at once, beside the freeze): migrating into a socket
        # whose QEMU is still starting kept the parent stopped longer (207-328 vs 202-248 ms) and
        # made no fork sooner, in alternating runs at load ~4
        for source in sources:
            source.up.wait(MIGRATE_TIMEOUT)
        vm.timings["fork_children_up"] = time.monotonic() - t0
        if any(source.failed or not source.up.is_set() for source in sources):
            return  # all or none: the fork that failed raises its own error
        with channel.quiesced():  # no request half-sent to the guest while it is migrated
            commands = vm.command_deadlines()  # (its commands frozen: their time left holds)
            for source in sources:
                source.files, source.entries, source.last_id = files, entries, channel.last_id
                source.commands = commands
                source.migrating.set()
            if len(feeds) == 1:
                live.migrate_out(vm, feeds[0].fileno(), "fork")
                return
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            copier = threading.Thread(target=_fan_out, args=(theirs, feeds), name=f"corral-fork-{vm.id}", daemon=True)
            copier.start()
            try:
                live.migrate_out(vm, ours.fileno(), "fork")
            finally:
                ours.close()  # (QEMU closes its copy when done): the copier reads to the end
                copier.join(MIGRATE_TIMEOUT)
                theirs.close()


def _fan_out(source: socket.socket, feeds: list[socket.socket]) -> None:
    """Copy the stream from ``source`` to every feed until its end; a fork that went away is
    left out (its own create fails), the others go on."""
    alive = list(feeds)
    while alive:
        try:
            chunk = source.recv(FAN_OUT_CHUNK)
        except OSError:
            break
        if not chunk:
            break
        for feed in list(alive):
            try:
                feed.sendall(chunk)
            except OSError:
                alive.remove(feed)
    for feed in feeds:
        with contextlib.suppress(OSError):
            feed.shutdown(socket.SHUT_WR)
