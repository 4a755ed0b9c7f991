"""Live snapshots of a microVM: its memory, devices and processes, and its workspace.

Taking one (:func:`capture`), the VM runs on afterwards:

1. the guest's commands are frozen (its ``sandbox`` cgroup, by the agent: ``T_GUEST``), and the
   agent unmounts the 9p workspace: QEMU 7.2 refuses to migrate a VM while a 9p export is
   attached (the blocker goes when the guest clunks the export's root fid).  A process whose
   working directory or open file is under ``/workspace`` keeps it busy:
   :class:`~corral.errors.InvalidState` naming it, and nothing changes;
2. the workspace copy is written (content-addressed, as the other tiers' snapshots): nothing in
   the VM can write it now;
3. a *converter* QEMU is started with the same devices, confined as the VM's own (its user
   namespace), its RAM a preallocated memfd, ``-S`` (it never runs the guest) and
   ``migrate-incoming`` on one end of a socket pair; the agent channel is quiesced (no request
   half-sent), the VM is stopped and migrated into the other end (its RAM is a private
   copy-on-write mapping of its template's, so all of it goes: zero pages compactly), then it
   runs on, remounts its workspace and thaws;
4. :func:`capture` returns, and :class:`RamWrite` (run by the store in the background:
   corral.snapshots) has the converter save its device state with ``x-ignore-shared``, opens
   its memfd, lets it quit and copies the memfd out, sparse and hashed on the way: the snapshot
   becomes a pair like a template's -- ``vm/ram`` (the memory image) and ``vm/state`` (~70 KB)
   -- so each VM made from it maps the RAM ``share=off`` (copy-on-write, nothing read up front)
   and restores as fast as from a template.

A VM restored from it (:func:`setup_restored`) has the snapshot's processes, frozen (the commands
among them keep the time their timeouts had left: leaves.CommandDeadlines); its first
request (sent straight on the socket: :func:`_first_answer` drops what the guest was still
sending when the snapshot was taken) gives it a fresh identity (RNG reseeded from 64 host
bytes, wall clock, hostname = its sandbox id, machine id, boot id bind-mounted over
``/proc/sys/kernel/random/boot_id``) -- or, restored under the id it was taken of (a resume
from ``pause(to_disk=True)``), only a reseed and the clock; then its own copy of the workspace
is mounted, and only then are its processes thawed.

The snapshot's description (RAM size, the image disk, QEMU and guest versions, the state's and
the RAM's sha256) is part of its manifest, whose sha256 the store records: a changed file is
:class:`~corral.errors.SnapshotCorrupt` before any VM starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import FileError, InvalidSpec, InvalidState, SandboxError, SnapshotCorrupt, SnapshotNotFound
from ...host import mounts
from ..base import SNAPSHOT_IN_USE, PendingWrite
from ..linux import fs_snapshot
from ..linux.agent import USER_IDS, AgentChannel
from ..linux.agent_build import agent_binary
from ..linux.frames import HEADER, T_ERR, T_GUEST, T_OK
from . import converter, memimage, qemu, template
from .converter import MIGRATE_TIMEOUT
from .leaves import Carried
from .rootdisk import ImageDisk

if TYPE_CHECKING:
    from .sandbox import MicroVMSandbox

VM_DIR = "vm"
WORKSPACE = "/workspace"
#: the 9p workspace as guest_root.c mounts it (the same options after every restore)
WS_OPTIONS = "trans=virtio,version=9p2000.L,cache=none,msize=262144"
#: bytes per second: unlimited, in effect
MAX_BANDWIDTH = 1 << 40
SOCKET_BUFFER = 4 << 20
#: requests the agent of a restored VM may still hold from the VM it was taken of: the new
#: host side numbers its own above the last one sent plus this margin
ID_MARGIN = 1 << 16


@dataclass(frozen=True)
class VMImage:
    """What the ``vm`` part of a live snapshot is and needs."""

    ram_mb: int
    accel: str
    qemu: str
    assets: str
    disk_key: str
    #: the image disk: the snapshot's own hard link to it if the store shares the cache's file
    #: system, else the cache's file (which must still be the same build)
    disk_path: str
    state_sha256: str
    ram_sha256: str
    #: the last agent request id of the VM it was taken of
    last_id: int
    #: the guest cgroup leaves its commands used (e1 ... eN): a restored VM's start after them
    leaves: int
    readonly_workspace: bool
    #: the sandbox it was taken of and its hostname: restored into the same sandbox id (a resume
    #: from pause(to_disk=True)) it keeps its identity
    sandbox_id: str = ""
    hostname: str = ""
    #: each command running when it was taken (guest leaf, seconds left, pid, argv, cwd): every
    #: VM restored from it ends each when its time is up (leaves.CommandDeadlines)
    commands: list[Carried] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VMImage:
        commands = [Carried.from_json(command) for command in data.get("commands") or []]
        return cls(int(data["ram_mb"]), str(data["accel"]), str(data["qemu"]), str(data["assets"]),
                   str(data["disk_key"]), str(data["disk_path"]), str(data["state_sha256"]),
                   str(data["ram_sha256"]), int(data["last_id"]), int(data["leaves"]),
                   bool(data["readonly_workspace"]), str(data.get("sandbox_id", "")), str(data.get("hostname", "")),
                   commands)


def freeze(channel: AgentChannel, frozen: bool) -> None:
    """Freeze (the agent waits until the kernel says frozen) or thaw the guest's commands; the
    agent lives outside their cgroup."""
    channel.guest("freeze", "1" if frozen else "0")


def _attach(readonly: bool) -> list[str]:
    return ["attach", "ws", WORKSPACE, "9p", ("ro," if readonly else "") + WS_OPTIONS]


def _strings(args: list[str]) -> bytes:
    return b"".join(arg.encode() + b"\0" for arg in args)


def attach_workspace(channel: AgentChannel, readonly: bool) -> None:
    channel.guest(*_attach(readonly))


def capture(vm: MicroVMSandbox, channel: AgentChannel, dest: Path, shared: Path | None) -> tuple[int, RamWrite]:
    """Write a live snapshot of ``vm`` into the new directory ``dest`` but for its memory image:
    returns bytes written and the image still to write (:class:`RamWrite`), once the VM runs on."""
    readonly = readonly_workspace(vm)
    rest: RamWrite | None = None
    try:
        with frozen_and_detached(vm, channel, "snapshot"):
            written, rest = _capture_detached(vm, channel, dest, shared, readonly)
    except BaseException:
        # the workspace's re-attach or the thaw failed after the converter took the VM (a guest
        # root can make the attach fail): nobody else holds the converter, which would run on,
        # its memfd a copy of the guest's RAM, past the sandbox and its uid range
        if rest is not None:
            rest.abandon()
        raise
    return written, rest


def readonly_workspace(vm: MicroVMSandbox) -> bool:
    return bool(vm.spec.workspace and vm.spec.workspace.mode == "ro")


@contextlib.contextmanager
def frozen_and_detached(vm: MicroVMSandbox, channel: AgentChannel, what: str) -> Iterator[None]:
    """The guest's commands frozen and its workspace unmounted (QEMU 7.2 migrates no VM with a
    9p export attached) while the caller migrates it; remounted and thawed afterwards."""
    t0 = time.monotonic()
    freeze(channel, True)
    try:
        try:
            channel.guest("detach", WORKSPACE)
            vm.timings[f"{what}_quiesce"] = time.monotonic() - t0  # frozen, workspace unmounted
        except FileError as exc:
            raise InvalidState(f"sandbox {vm.id}: a live {what} needs /workspace unmounted for a moment, "
                               f"and a process holds it ({exc}); run long-lived processes with another "
                               f"working directory (cwd='/tmp')", sandbox_id=vm.id) from None
        try:
            yield
        finally:
            attach_workspace(channel, readonly_workspace(vm))
    finally:
        freeze(channel, False)


def migrate_out(vm: MicroVMSandbox, fd: int, what: str) -> None:
    """Stop the VM, migrate all of it (its RAM is a private copy-on-write mapping of its
    template's, or QEMU's own: none of it is shared) into ``fd``, and let it run on."""
    qmp = vm.qmp()
    stopped = False
    try:
        qmp.command("stop")
        stopped = True
        t0 = time.monotonic()
        qmp.command("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": False}])
        # the VM is stopped: no reason to pace the stream (QEMU's default is 128 MiB/s)
        qmp.command("migrate-set-parameters", **{"max-bandwidth": MAX_BANDWIDTH})
        qmp.send_fd("out", fd)
        qmp.command("migrate", uri="fd:out")
        qmp.wait_migration(time.monotonic() + MIGRATE_TIMEOUT)
    finally:
        if stopped:
            qmp.command("cont")
            vm.timings[f"{what}_stopped"] = time.monotonic() - t0  # migrated
        qmp.close()


def _capture_detached(vm: MicroVMSandbox, channel: AgentChannel, dest: Path, shared: Path | None,
                      readonly: bool) -> tuple[int, RamWrite]:
    with channel.quiesced():  # no request half-sent to the guest while it is saved
        return _capture_quiesced(vm, channel, dest, shared, readonly)


def _capture_quiesced(vm: MicroVMSandbox, channel: AgentChannel, dest: Path, shared: Path | None,
                      readonly: bool) -> tuple[int, RamWrite]:
    last_id = channel.last_id
    ws = vm._run_dir / "disk" / "ws"
    # ``dest`` is the snapshot's ``files`` (the workspace's manifest and blobs): the VM goes beside it
    vm_dir = dest.parent / VM_DIR
    vm_dir.mkdir(mode=0o700)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end in (ours, theirs):  # fewer wake-ups of the two QEMUs for the same bytes
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    conv: converter.Converter | None = None
    try:
        # the workspace as the frozen guest left it (unmounted there: nothing in the VM writes it)
        t0 = time.monotonic()
        written = fs_snapshot.capture([("ws", ws)], dest, vm._id_map(), {}, vm.spec.limits.disk, shared)
        t1 = time.monotonic()
        conv = converter.start(vm, vm_dir, theirs)
        vm.timings["snapshot_workspace"], vm.timings["snapshot_converter"] = t1 - t0, time.monotonic() - t1
        theirs.close()
        migrate_out(vm, ours.fileno(), "snapshot")
        ours.close()
        disk_path = vm.image_disk.path
        with contextlib.suppress(OSError):  # another file system: the cache's disk is named instead
            os.link(disk_path, vm_dir / "disk")
            disk_path = vm_dir / "disk"
        image = VMImage(
            ram_mb=vm.ram_mb, accel=vm._tier.accel, qemu=qemu.qemu_version(), assets=vm._tier.assets.digest,
            disk_key=vm.image_disk.key, disk_path="disk" if disk_path == vm_dir / "disk" else str(disk_path),
            state_sha256="", ram_sha256="", last_id=last_id, leaves=vm._exec_count, readonly_workspace=readonly,
            sandbox_id=vm.id, hostname=vm.hostname, commands=vm.command_deadlines(),
        )
        rest = RamWrite(conv, image, vm.timings)
        conv = None  # the rest's now
        return written, rest
    finally:
        ours.close()
        theirs.close()
        if conv is not None:
            conv.close()


class RamWrite(PendingWrite):
    """What is left of a live snapshot once the VM runs on: the converter (which has, or will
    have, loaded the whole stream) saves the device state, then its memfd is copied out and
    hashed, and the VM's description joins the manifest.  Owns the converter and its host cgroup
    (closed once the image is written, or if it is abandoned: it also dies with this process,
    and ``gc`` reaps it with its sandbox)."""

    def __init__(self, conv: converter.Converter, image: VMImage, timings: dict[str, float]) -> None:
        self.converter: converter.Converter | None = conv
        self.image = image
        self.timings = timings
        self.bytes_at_most = (image.ram_mb << 20) + (1 << 20)
        #: set once it is written or abandoned (the next snapshot of the same VM waits for it)
        self.done = threading.Event()

    def _save_state(self, vm_dir: Path) -> int:
        """The converter's device state into ``vm_dir/state``; returns its memfd, the converter gone."""
        assert self.converter is not None, "written once"
        proc, conv = self.converter.proc, self.converter.qmp
        t0 = time.monotonic()
        converter.wait_loaded(conv, proc, time.monotonic() + MIGRATE_TIMEOUT)
        conv.command("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}])
        state = os.open(vm_dir / "state", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            conv.send_fd("state", state)
        finally:
            os.close(state)
        conv.command("migrate", uri="fd:state")
        conv.wait_migration(time.monotonic() + MIGRATE_TIMEOUT)
        memory = memimage.memfd_of(proc.pid)  # the RAM outlives the converter while we hold it
        try:
            conv.command("quit")
            proc.wait(timeout=30)
        except BaseException:
            os.close(memory)
            raise
        self.timings["snapshot_convert"] = time.monotonic() - t0
        for name in ("empty", "console.log", "qemu.log"):
            path = vm_dir / name
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
        return memory

    def finish(self, dest: Path) -> int:
        """Save the device state and copy the memory image into ``dest``'s ``vm/``, sparse and
        hashed, and add the VM's description to ``dest``'s manifest; returns bytes written."""
        vm_dir = dest.parent / VM_DIR
        ram = vm_dir / "ram"
        try:
            memory = self._save_state(vm_dir)
            t0 = time.monotonic()
            try:
                ram_sha256 = memimage.write_sparse(memory, self.image.ram_mb << 20, ram)
            finally:
                os.close(memory)
        finally:
            self.abandon()
        self.timings["snapshot_write_ram"] = time.monotonic() - t0
        memimage.remember(ram)
        # the VM's description joins the workspace's manifest: the store's checksum covers both
        state_sha256 = hashlib.sha256((vm_dir / "state").read_bytes()).hexdigest()
        manifest = json.loads((dest / fs_snapshot.MANIFEST).read_bytes())
        manifest["vm"] = asdict(dataclasses.replace(self.image, state_sha256=state_sha256, ram_sha256=ram_sha256))
        data = json.dumps(manifest, separators=(",", ":")).encode()
        (dest / fs_snapshot.MANIFEST).write_bytes(data)
        return sum(min(p.stat().st_size, p.stat().st_blocks * 512) for p in (ram, vm_dir / "state")) + len(data)

    def abandon(self) -> None:
        conv, self.converter = self.converter, None
        try:
            if conv is not None:
                conv.close()  # (after finish closed the memfd: its pages are freed, the group empty)
        finally:
            self.done.set()


def load(files: Path, digest: str) -> tuple[VMImage, list[dict[str, Any]], Path]:
    """A live snapshot's description and workspace entries, checked against ``digest`` (the
    manifest's sha256) and its state and RAM against theirs; returns (image, entries, vm dir)."""
    entries = fs_snapshot.load_manifest(files, digest)
    name = files.parent.name
    try:
        image = VMImage.from_dict(json.loads((files / fs_snapshot.MANIFEST).read_bytes())["vm"])
    except (OSError, ValueError, KeyError, TypeError):
        raise SnapshotCorrupt(f"snapshot {name}: it holds no VM description") from None
    vm_dir = files.parent / VM_DIR
    try:
        state = (vm_dir / "state").read_bytes()
        ram_size = (vm_dir / "ram").stat().st_size
    except OSError as exc:
        raise SnapshotCorrupt(f"snapshot {name}: its VM state is unreadable ({exc.strerror})") from None
    if hashlib.sha256(state).hexdigest() != image.state_sha256:
        raise SnapshotCorrupt(f"snapshot {name}: its VM state does not match its checksum")
    if ram_size != image.ram_mb << 20:
        raise SnapshotCorrupt(f"snapshot {name}: its memory image is {ram_size} bytes, not {image.ram_mb} MiB")
    if not memimage.checked(vm_dir / "ram"):
        if memimage.ram_digest(vm_dir / "ram") != image.ram_sha256:
            raise SnapshotCorrupt(f"snapshot {name}: its memory image does not match its checksum")
        memimage.remember(vm_dir / "ram")
    return image, entries, vm_dir


def check_compatible(image: VMImage, vm: MicroVMSandbox, vm_dir: Path) -> ImageDisk:
    """Refuse a snapshot taken with another QEMU, guest or accelerator; returns its image disk."""
    name = vm_dir.parent.name
    if (image.qemu, image.assets, image.accel) != (qemu.qemu_version(), vm._tier.assets.digest, vm._tier.accel):
        raise InvalidState(f"snapshot {name} was taken with another QEMU, guest kernel or accelerator "
                           f"({image.qemu}, {image.accel}): it loads only into the same one")
    disk = vm_dir / image.disk_path  # its own link, or the cache's file (an absolute path)
    if not disk.is_file():
        raise InvalidState(f"snapshot {name}: the image disk it was taken on ({disk}) is gone")
    return ImageDisk(disk, image.disk_key)


def identity(hostname: str, machine_id: str, boot_id: str, seed: str) -> list[str]:
    """The agent's "identity" request for a restored VM."""
    return ["identity", seed, str(time.time_ns()), hostname, machine_id, boot_id]


def _first_answer(vm: MicroVMSandbox, ident: int, request: list[str]) -> AgentChannel:
    """Send the restored VM's agent its first request straight on the socket and find the
    answer's header in what comes back: the guest may first deliver what it was writing when the
    snapshot was taken (frames of the original's commands, perhaps the tail of one), all of it
    dropped.  Returns the VM's channel, with request ids above ``ident``."""
    sock = vm._sock
    assert sock is not None
    payload = _strings(request)
    sock.sendall(HEADER.pack(T_GUEST, ident, len(payload)) + payload)
    ok, err = HEADER.pack(T_OK, ident, 0), struct.pack("<BI", T_ERR, ident)
    sock.settimeout(MIGRATE_TIMEOUT)
    seen = b""
    try:
        while True:
            if (at := seen.find(ok)) >= 0:
                rest = seen[at + len(ok):]
                break
            if (at := seen.find(err)) >= 0 and len(seen) >= at + HEADER.size:
                length = HEADER.unpack_from(seen, at)[2]
                if len(seen) >= at + HEADER.size + length:
                    message = seen[at + HEADER.size + 4 : at + HEADER.size + length].decode(errors="replace")
                    raise SandboxError(f"the restored VM's agent refused its new identity: {message}")
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise SandboxError(f"the restored VM stopped: {vm._log_tail()}")
            seen = seen[-(1 << 20):] + chunk  # what precedes the answer is bounded: the guest's pending output
    except TimeoutError:
        raise SandboxError(f"the restored VM's agent did not answer: {vm._log_tail()}") from None
    finally:
        sock.settimeout(None)
    channel = vm._channel = AgentChannel(os.dup(sock.fileno()), os.dup(sock.fileno()), initial=rest)
    channel.user_ids = USER_IDS
    channel.skip_ids(ident)
    return channel


def setup_restored(vm: MicroVMSandbox, files: Path, digest: str) -> None:
    """Start ``vm`` from the live snapshot whose files are ``files``: checked first (nothing is
    made for a corrupted or incompatible one), then its host side as a new VM's, QEMU restoring
    the snapshot's RAM and state, and a fresh identity before its processes thaw."""
    spec, run = vm.spec, vm._run_dir
    t0 = time.monotonic()
    name = files.parent.name
    if spec.network != "none":
        raise InvalidSpec(f"network: a microVM made from live snapshot {name} runs without a network "
                          f"(its guest's network state is the snapshot's)")
    image, entries, vm_dir = load(files, digest)
    _mark_in_use(vm_dir, run, name)
    disk = check_compatible(image, vm, vm_dir)
    fs_snapshot.check_fits(entries, mounts.disk_held_in_memory(spec.limits), name)
    if disk.path.parent == vm_dir:  # the snapshot's link to the disk: the VM gets its own (the snapshot may go)
        os.link(disk.path, run / "image.erofs")
        disk = ImageDisk(run / "image.erofs", disk.key)
    ws = host_side(vm, image.ram_mb, disk, image.leaves)
    ids = vm._id_map()
    vm._charge(lambda: fs_snapshot.restore(files, entries, "ws", ws, ids))
    vm.timings["files"] = time.monotonic() - t0
    vm._start_userns(agent_binary(vm._tier.state_dir))  # QEMU's user namespace (vmm.py), as a new VM's
    vm._launch(template.Template(vm_dir, image.ram_mb, image.accel, 0.0), disk, ws, None)
    resumed = image.sandbox_id == vm.id
    if resumed:  # the same sandbox back from disk: reseeded, clock set, identity kept
        vm.hostname = image.hostname
        wake = ["resume", os.urandom(64).hex(), str(time.time_ns())]
    else:
        wake = identity(vm.hostname, uuid.uuid4().hex, str(uuid.uuid4()), os.urandom(64).hex())
    awaken(vm, image.last_id + ID_MARGIN, wake, image.readonly_workspace, t0)
    # the same sandbox or a copy: its commands are in its memory, and end when their time is up
    vm.carry_commands(image.commands)


def _mark_in_use(vm_dir: Path, run: Path, name: str) -> None:
    """Link the snapshot's in-use mark into the VM's run directory before its memory image is
    mapped: a snapshot deleted meanwhile stays counted, its image on disk, until the VM is gone
    (it freed 0 MB of the image's 239 MB held by two VMs, and counted nothing)."""
    mark = vm_dir / SNAPSHOT_IN_USE
    try:
        with contextlib.suppress(FileExistsError):
            os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        os.link(mark, run / f"snapshot-{SNAPSHOT_IN_USE}")
    except FileNotFoundError:  # being removed
        raise SnapshotNotFound(f"no snapshot {name}") from None


def host_side(vm: MicroVMSandbox, ram_mb: int, disk: ImageDisk, leaves: int) -> Path:
    """What a VM made from a live state (a snapshot's, a fork's) holds on the host before its QEMU
    starts: its cgroup, sized for ``ram_mb`` of guest RAM, and its disk tmpfs; returns the
    (empty) directory its workspace copy goes to."""
    from .sandbox import host_limits

    spec, run, uid = vm.spec, vm._run_dir, vm.uid
    vm.ram_mb, vm.image_disk, vm._exec_count = ram_mb, disk, leaves
    vm._make_cgroup(host_limits(spec.limits, ram_mb), vm._tier._layout)
    (run / "disk").mkdir()
    mounts.mount_tmpfs(run / "disk", mounts.disk_held_in_memory(spec.limits), uid, uid, 0o700)
    ws = run / "disk" / "ws"
    ws.mkdir(mode=0o755)
    os.chown(ws, uid, uid)
    return ws


def awaken(vm: MicroVMSandbox, ident: int, wake: list[str], readonly: bool, t0: float) -> None:
    """A restored VM's first request (its identity), then its workspace, then its processes thaw."""
    channel = _first_answer(vm, ident, wake)
    vm.timings["identity"] = time.monotonic() - t0
    # both at once, answered in order: the workspace, then the processes thaw
    answers = [channel.begin(T_GUEST, _strings(_attach(readonly))),
               channel.begin(T_GUEST, _strings(["freeze", "0"]))]
    for name, answer in zip(("workspace", "total"), answers, strict=True):
        answer(MIGRATE_TIMEOUT)
        vm.timings[name] = time.monotonic() - t0
