"""The writable root every Linux-userland tier on the host builds for a sandbox.

Shared by the process tier (bubblewrap) and the gVisor tier (runsc): both run
the sandbox on an overlay of the image's read-only layers, with the writable
layers and the workspace (overlay or copy) on a size-limited tmpfs the sandbox owns, and an
unprivileged host uid per sandbox.  Layout below ``run_dir`` (root-only)::

    disk/           tmpfs, size = disk limit, owned by the sandbox's host uid
      L0-upper/ L0-work/       overlay upper for "/"
      L1-upper/ ...            one upper per extra image layer (e.g. /usr)
      ws/                      the workspace: an overlay on the host directory
                               (:mod:`corral.host.ws_overlay`), or the sandbox's copy of it
      ws-upper/ ws-work/       that overlay's upper layer and work directory
    root/           the merged root (overlay), other layers mounted below it

Given the sandbox's user namespace (``userns_fd``, its whole uid range mapped),
each image layer is first mounted idmapped (:mod:`corral.host.idmap`): inside,
the image's files show their real owners (``root:root``, not ``nobody``), and
root of the sandbox may change any of them -- in the overlay's upper layer on
the disk tmpfs, never in the image; what Corral itself puts in the upper
layers belongs to root of the sandbox too (``root_uid`` on the host).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...egress import network as egress_network
from ...errors import InvalidSpec
from ...host import cgroups, mounts
from ...host.mountns import HostMounts, MountNamespace
from ...host.openat2 import UnsafeFile
from ...host.uids import release_uid
from ...host.ws_copy import WorkspaceCopy
from ...host.ws_overlay import WorkspaceOverlay, make_workspace
from ...images import SANDBOX_HOME, identity_files, image_id_files, image_mark, resolve
from ...spec import WORKSPACE_PATH, SandboxSpec

#: where the agent binary is bound inside every sandbox
AGENT_PATH = "/.corral/agent"

MiB = 1 << 20


def reap_host_side(state_dir: Path, sandbox_id: str, run_dir: Path, record: dict[str, object]) -> None:
    """The janitor's teardown of a sandbox whose owner died, for the tiers whose every process
    lives in the sandbox's host cgroup (process, gVisor, microVM): kill it, remove what the
    network mode made outside the run dir (by name), unmount and remove the run dir, release
    the sandbox's uids (``uid``, and gVisor's ``root_uid``, from its reap record) if they are
    still ``sandbox_id``'s (an owner killed mid-destroy may have released them, and another
    sandbox may hold them now)."""
    cgroups.reap(sandbox_id, record.get("cgroup_parent"))
    egress_network.reap(sandbox_id, record)
    mounts.unmount_all(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    for key in ("uid", "root_uid"):
        value = record.get(key)
        if value is not None:
            release_uid(state_dir, int(str(value)), owner=sandbox_id)


log = logging.getLogger(__name__)


@dataclass
class SandboxRoot:
    """What :func:`build_root` made: the merged root, the workspace dir and its copy, its mounts."""

    root: Path
    workspace_dir: Path
    workspace: WorkspaceCopy | WorkspaceOverlay | None
    #: in the order they were made (teardown: ``mounts.unmount_all(run_dir, known=mounts)``)
    mounts: list[Path]


def build_root(
    spec: SandboxSpec,
    state_dir: Path,
    run_dir: Path,
    uid: int,
    files: Mapping[str, bytes] | None = None,
    mount_points: Sequence[str] = (),
    fill: Callable[[str, Path], None] | None = None,
    userns: Callable[[], int] | None = None,
    root_uid: int | None = None,
    mounter: HostMounts | None = None,
    workspace_userns: Callable[[tuple[str, str]], int] | None = None,
    disk_size: int | None = None,
    charge: Callable[[Callable[[], None]], None] | None = None,
) -> SandboxRoot:
    """Mount the disk tmpfs and the overlay root, and copy the workspace in.

    ``files`` (absolute in-sandbox path -> content, world-readable) are added to
    the root; ``mount_points`` are created as empty files for later bind mounts.

    ``fill(key, directory)``, if given, writes into each upper (key ``L0``, ``L1``, ...) before
    it is mounted and into the workspace directory (key ``ws``, no host workspace): a snapshot's files (.fs_snapshot).

    ``uid`` is the host uid that owns the sandbox's files (its disk, home and
    workspace).  With ``userns`` (gives the sandbox's user namespace; asked as
    late as possible, after everything but the overlays is ready, so that its
    making overlaps this) the image's layers are idmapped into it and the upper
    layers belong to ``root_uid`` (root inside).  The caller unmounts on
    teardown: :func:`mounts.unmount_all` of ``run_dir`` with ``known=`` the
    returned ``mounts``.

    ``mounter`` makes the mounts: in the host's namespace (the default), or in the sandbox's own
    (:class:`corral.host.mountns.MountNamespace`: then nothing is left for the caller to unmount,
    ``mounts`` is empty, and the files on them are written through ``mounter.view``).

    ``workspace_userns(maps)`` (a user namespace with those uid and gid maps, see
    :func:`corral.host.ws_overlay.owner_maps`), if given, makes the workspace an overlay on the
    host directory instead of a copy: nothing is copied, and write-back walks only what changed.

    ``disk_size`` is the disk tmpfs's size (default: the spec's ``disk``; see
    :func:`disk_held_in_memory`).

    ``charge(work)``, if given, runs ``work`` where the pages it writes are charged to the sandbox
    (:meth:`.sandbox.LinuxSandbox._charge`): the workspace copy and the snapshot's files are
    written in one such call, whatever their number of layers and files.

    Mounted in the host's namespace (``mounter`` the default), the root, the workspace and
    ``/dev/shm`` (1777) are reachable under ``run_dir``: it is then 0710 with ``root_uid``'s group
    (the range's root, which the tier's host processes run as), where 0711 let any user of the host
    who read the sandbox id in ``ps`` read its files and write into its ``/tmp``.
    """
    visible_on_host = mounter is None
    mounter = mounter or HostMounts()
    size = disk_size if disk_size is not None else spec.limits.disk
    image = resolve(spec.image, state_dir)
    # before anything is made: an image whose identity files are refused leaves nothing to undo
    image_ids = _image_id_files(image.layers[0][1], image.name) if image.own_etc else None
    if visible_on_host and root_uid is not None:
        os.chown(run_dir, 0, root_uid)
        os.chmod(run_dir, 0o710)
    else:
        os.chmod(run_dir, 0o711)  # the sandbox runs as ``uid`` and must reach root/
    disk, root = run_dir / "disk", run_dir / "root"
    disk.mkdir()
    root.mkdir()
    mounter.mount_tmpfs(disk, size, uid, uid, 0o711)
    made = [disk]
    on_disk = mounter.view(disk)  # the tmpfs as this process reaches it
    mapped = userns is not None and root_uid is not None
    layers = []
    #: what is written onto the disk for the sandbox by the megabyte (a snapshot's files), in one
    #: charged call below; what Corral writes of its own (a few kB) is not worth a child
    fills: list[Callable[[], None]] = []
    for index, (point, lower) in enumerate(image.layers):
        upper, work = disk / f"L{index}-upper", disk / f"L{index}-work"
        files_upper = on_disk / upper.name
        files_upper.mkdir()
        (on_disk / work.name).mkdir()
        if point == "/":
            _prepare_root_upper(files_upper, uid, own_etc=image.own_etc, image_ids=image_ids)
            _add_files(files_upper, files or {}, mount_points)
        if mapped:
            assert root_uid is not None
            _give_to(files_upper, root_uid)
        if fill is not None:  # after _give_to: a restored snapshot's files carry their own owners
            fills.append(functools.partial(fill, f"L{index}", files_upper))
        layers.append((root / point.lstrip("/") if point != "/" else root, lower, upper, work))
    ws = disk / "ws"
    workspace: WorkspaceCopy | WorkspaceOverlay | None = None
    overlay_ws = spec.workspace is not None and workspace_userns is not None

    def write_all(copy_in: Callable[[], None] | None = None) -> None:
        def work() -> None:
            for each in fills:
                each()
            if copy_in is not None:
                copy_in()

        if charge is None:
            work()
        else:
            charge(work)

    if spec.workspace is not None and not overlay_ws:
        workspace = WorkspaceCopy.create(spec.workspace.path, on_disk / "ws", uid, uid, size, charge=write_all)
    else:
        (on_disk / "ws").mkdir(mode=0o755)
        os.chown(on_disk / "ws", uid, uid)
        if fill is not None and spec.workspace is None:
            fills.append(functools.partial(fill, "ws", on_disk / "ws"))
        if fills:
            write_all()
    userns_fd = userns() if mapped and userns is not None else None
    for index, (target, lower, upper, work) in enumerate(layers):
        if userns_fd is not None:
            view = run_dir / "lower" / f"{image_mark(image.digest)}-L{index}"
            _mount_mapped_overlay(mounter, target, lower, upper, work, userns_fd, view)
        else:
            mounter.mount_overlay(target, [lower], upper, work)
        made.append(target)
    if spec.workspace is not None and workspace_userns is not None:
        workspace, mounted = make_workspace(spec.workspace.path, spec.workspace.mode, disk, uid, size,
                                            workspace_userns, mounter, charge)
        if mounted:
            made.append(ws)
    return SandboxRoot(root, ws, workspace, [] if mounter.private else made)


#: why this host cannot idmap image layers (None: it can, or has not been asked yet)
IDMAP_UNSUPPORTED: str | None = None


def _mount_mapped_overlay(mounter: HostMounts, target: Path, lower: Path, upper: Path, work: Path,
                          userns_fd: int, view: Path) -> None:
    """The overlay at ``target`` on an idmapped view of ``lower``, mounted at ``view`` while the
    overlay is made (the overlay keeps its own clone of it) and detached right after.

    ``view``'s name carries the image's digest: the overlay's ``lowerdir=`` in
    ``/proc/self/mountinfo`` is how the image store sees that a sandbox still uses an image
    (``images.store.in_use``), on every state directory of the host.

    A kernel or file system that cannot idmap (Linux < 5.12; a layer on tmpfs before 6.3;
    overlayfs on idmapped layers before 5.19) gets the plain layer: everything works but the
    image's files show as ``nobody`` inside and root inside cannot change them."""
    global IDMAP_UNSUPPORTED
    if IDMAP_UNSUPPORTED is None:
        try:
            view.mkdir(parents=True)
            try:
                mounter.mapped_overlay(target, lower, upper, work, userns_fd, view)
            finally:
                view.rmdir()
            return
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
                raise
            IDMAP_UNSUPPORTED = str(exc)
            log.warning("image layers are not idmapped on this host (%s): image files show as nobody", exc)
    mounter.mount_overlay(target, [lower], upper, work)


def _give_to(upper: Path, root_uid: int) -> None:
    """Hand what Corral made as host root in an upper layer to root of the sandbox (``root_uid``):
    inside, host root is nobody, and a directory of nobody's would shadow the image's own."""
    for dirpath, dirnames, filenames in os.walk(upper):
        for path in (dirpath, *(os.path.join(dirpath, n) for n in (*dirnames, *filenames))):
            st = os.lstat(path)
            if st.st_uid == 0 or st.st_gid == 0:
                os.lchown(path, root_uid if st.st_uid == 0 else -1, root_uid if st.st_gid == 0 else -1)


def _add_files(upper: Path, files: Mapping[str, bytes], mount_points: Sequence[str]) -> None:
    for inside in mount_points:
        (upper / inside.lstrip("/")).touch()
    for inside, data in files.items():
        target = upper / inside.lstrip("/")
        for parent in reversed(target.relative_to(upper).parents[:-1]):
            (upper / parent).mkdir(mode=0o755, exist_ok=True)
        target.write_bytes(data)
        os.chmod(target, 0o644)


def _prepare_root_upper(upper: Path, uid: int, own_etc: bool,
                        image_ids: Mapping[str, str | None] | None = None) -> None:
    # mount points and the home directory must exist before the sandbox starts:
    # inside it, host-root-owned directories cannot be written to
    (upper / ".corral").mkdir()
    (upper / ".corral" / "agent").touch()
    (upper / WORKSPACE_PATH.lstrip("/")).mkdir()
    home = upper / SANDBOX_HOME.lstrip("/")
    home.mkdir(parents=True)
    os.chmod(home.parent, 0o755)
    os.chown(home, uid, uid)
    os.chmod(home, 0o750)
    for d in ("tmp", "proc", "dev"):
        (upper / d).mkdir(exist_ok=True)
    os.chmod(upper / "tmp", 0o1777)
    if own_etc:
        (upper / "etc").mkdir(exist_ok=True)
        os.chmod(upper / "etc", 0o755)
        for rel, content in identity_files().items():
            if image_ids is not None and rel in ("etc/passwd", "etc/group"):
                if rel == "etc/passwd" and image_ids["etc/shadow"] is None:
                    content = content.replace(":x:", ":*:")  # no shadow to look the password up in
                content = _merged_ids(image_ids[rel], content)
            _write_id_file(upper / rel, content)
        if image_ids is not None and image_ids["etc/shadow"] is not None:
            _add_shadow(upper / "etc", image_ids["etc/shadow"], identity_files()["etc/passwd"])


def _image_id_files(image_root: Path, image_name: str) -> dict[str, str | None]:
    """The image's identity files (:func:`corral.images.image_id_files`); one that is a link, not a
    regular file or too big refuses the create: the host's file is never copied in its place."""
    try:
        return image_id_files(image_root)
    except UnsafeFile as exc:
        raise InvalidSpec(f"image {image_name!r}: its /{exc.filename} is {exc.strerror}; no sandbox is made "
                          "from it (rebuild the image with a regular file there)") from None


def _write_id_file(path: Path, content: str) -> None:
    path.write_text(content, encoding="utf-8", errors="surrogateescape")


def _add_shadow(etc: Path, theirs: str, ours: str) -> None:
    """The image's shadow with a locked entry for each of our users it lacks: PAM's account
    check (``su user`` as root) refuses a user with no shadow entry."""
    names = {line.split(":")[0] for line in theirs.splitlines()}
    extra = "".join(f"{line.split(':')[0]}:*:19000:0:99999:7:::\n" for line in ours.splitlines()
                    if line.split(":")[0] not in names)
    _write_id_file(etc / "shadow", theirs.rstrip("\n") + "\n" + extra)
    os.chmod(etc / "shadow", 0o640)


def _merged_ids(theirs: str | None, ours: str) -> str:
    """The image's passwd/group with the sandbox's entries whose name or id it lacks added:
    its system users (``_apt``, ``www-data``...) stay, so package tools find them."""
    if theirs is None:
        return ours
    rows = [line.split(":") for line in theirs.splitlines() if line.count(":") >= 3]
    names, ids = {r[0] for r in rows}, {r[2] for r in rows}
    extra = [line for line in ours.splitlines() if line.split(":")[0] not in names and line.split(":")[2] not in ids]
    return theirs.rstrip("\n") + "\n" + "".join(f"{line}\n" for line in extra)


def shm_dir(run_dir: Path, uid: int, mounter: HostMounts | None = None) -> Path:
    """A directory on the sandbox's disk tmpfs for ``/dev/shm`` (1777, the sandbox's): POSIX
    shared memory (Chromium's renderers, multiprocessing) then counts against ``disk`` like any
    write, instead of sitting on ``/dev``'s tmpfs, which has no bound of its own.  Its path
    in the sandbox's mount namespace (made through ``mounter``'s view of it)."""
    shm = run_dir / "disk" / "shm"
    made = mounter.view(shm) if mounter is not None else shm
    made.mkdir(mode=0o700)
    os.chown(made, uid, uid)
    os.chmod(made, 0o1777)
    return shm


#: the character devices a sandbox's ``/dev`` has (those bubblewrap's ``--dev`` binds from the host)
DEVICE_NODES = ("null", "zero", "full", "random", "urandom", "tty")
#: and the links, as bubblewrap's ``--dev`` makes them
DEVICE_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx"), ("core", "/proc/kcore"))


@functools.cache
def _host_devices() -> tuple[tuple[str, int], ...]:
    """(name, device number) of each of :data:`DEVICE_NODES` the host has (as bwrap, only those)."""
    found = []
    for name in DEVICE_NODES:
        try:
            found.append((name, os.stat(f"/dev/{name}").st_rdev))
        except FileNotFoundError:
            continue
    return tuple(found)


def sandbox_dev(run_dir: Path, mounter: MountNamespace, root_uid: int, shm: Path, max_ptys: int) -> Path:
    """The sandbox's whole ``/dev``, made in its mount namespace for bwrap to bind at once: a
    tiny read-only tmpfs of nodes of its own for :data:`DEVICE_NODES` (the same devices, other
    inodes), :data:`DEVICE_LINKS`, a ``devpts`` of its own holding at most ``max_ptys`` terminals
    at ``pts``, and ``shm`` (on its disk) at ``shm``.  Its path in the namespace.

    Not bwrap's ``--dev``: on the host's nodes it binds, inotify in a sandbox saw the host's and
    every other sandbox's opens, reads and writes of them (50 writes to ``/dev/null`` on the
    host were 52 ``IN_MODIFY`` inside), a channel between tenants; its devpts has no bound but
    the host's shared table; and its ~14 mounts, each bind re-reading the mount table, cost
    ~1.3 ms of every create where these cost ~0.3."""
    where = run_dir / "dev"
    made = mounter.view(where)
    made.mkdir(mode=0o755)
    mounter.mount_device_nodes(where)
    # by a descriptor of the directory: each path through /proc/PID/root costs a lookup of its own
    dev = os.open(made, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name, device in _host_devices():
            os.mknod(name, stat.S_IFCHR | 0o666, device, dir_fd=dev)
            os.chmod(name, 0o666, dir_fd=dev)  # the umask took some
        for name, target in DEVICE_LINKS:
            os.symlink(target, name, dir_fd=dev)
        for name in ("pts", "shm"):
            os.mkdir(name, 0o755, dir_fd=dev)
        os.fchown(dev, root_uid, root_uid)  # as bwrap's: root's inside (read-only to it all the same)
    finally:
        os.close(dev)
    mounter.sandbox_dev(where, max_ptys, shm)
    return where


#: where the kernel shows its boot's id; the same in every process of a host
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id_file(run_dir: Path, uid: int, mounter: HostMounts | None = None) -> Path:
    """A boot id of the sandbox's own on its disk tmpfs, for bwrap to bind over
    :data:`BOOT_ID_PATH`: the host's would be the same in every sandbox, a mark that tells
    tenants they share a host and follows the host across their sessions (a microVM and
    gVisor each show their own).  Its path in the sandbox's mount namespace."""
    path = run_dir / "disk" / "boot_id"
    made = mounter.view(path) if mounter is not None else path
    made.write_text(f"{uuid.uuid4()}\n")
    os.chown(made, uid, uid)
    os.chmod(made, 0o444)
    return path


#: /proc's files that show the whole host, live and alike to every sandbox: the host kernel's
#: command line, and counters of every tenant's activity (interrupts and softirqs per CPU,
#: pressure stalls to the microsecond, the page allocator's free lists, paging, disk I/O), which
#: are timing channels between tenants.  Left as the host's: ``meminfo``, ``loadavg`` and
#: ``uptime``, which ``top`` and ``free`` read (and sysinfo(2) tells any process the same memory,
#: loads and uptime)
MASKED_PROC_FILES = ("cmdline", "interrupts", "softirqs", "buddyinfo", "zoneinfo", "diskstats")
#: and directories of such files (PSI's ``cpu``, ``io``, ``memory``; each interrupt's counts)
MASKED_PROC_DIRS = ("pressure", "irq")
#: and files tools need the shape of (``ps`` reads ``stat``'s ``btime``, ``vmstat`` fails on an
#: empty ``vmstat``): the host's lines with every count 0 (:func:`quiet_proc_file`)
QUIET_PROC_FILES = ("stat", "vmstat")


def quiet_proc_file(name: str) -> str:
    """``/proc/NAME`` with the host's lines and every count 0 but ``stat``'s ``btime`` (the host's
    boot time, which ``ps`` adds to a process's start) and ``procs_running`` (1).  The host's
    counted every tenant's activity: ``stat``'s ``intr`` per device (a disk write on the host
    was +13 on its IRQ), softirqs, forks (``processes``: +300 for another sandbox's 300) and CPU
    time; ``vmstat``'s page faults, allocations and I/O.  ``btime`` is read again at each call:
    the kernel's moves with the wall clock's corrections (a second on this VM within a run), and
    one kept from a process's first create showed a long-lived owner's sandboxes a stale one."""
    template = _quiet_template(name)
    if "{btime}" not in template:
        return template
    with open(f"/proc/{name}") as host:
        btime = next((line for line in host if line.startswith("btime ")), "btime 0\n").rstrip("\n")
    return template.replace("{btime}", btime)


@functools.cache
def _quiet_template(name: str) -> str:
    lines = []
    for line in Path(f"/proc/{name}").read_text().splitlines():
        key, _, values = line.partition(" ")
        if key == "btime":
            lines.append("{btime}")
        elif key == "procs_running":
            lines.append(f"{key} 1")
        elif key:
            lines.append(" ".join([key + (" " if key == "cpu" else ""), *("0" * len(values.split()))]))
    return "\n".join(lines) + "\n"


@functools.cache
def _on_this_kernel(names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``names`` the host's ``/proc`` has (bwrap fails on a target the kernel has not);
    looked up once, not at every create."""
    return tuple(name for name in names if os.path.exists(f"/proc/{name}"))


def proc_masks(run_dir: Path, mounter: HostMounts | None = None) -> list[str]:
    """bwrap arguments that bind, read-only, after ``--proc``: an empty file (or directory) of
    the sandbox's own over each of :data:`MASKED_PROC_FILES` (:data:`MASKED_PROC_DIRS`), and
    :func:`quiet_proc_file` over each of :data:`QUIET_PROC_FILES`, that the host's kernel has.
    Its own, made on its disk tmpfs by host root: a file every sandbox shared would show by its
    times that some sandbox read it."""
    disk = run_dir / "disk"
    args = []
    # by a descriptor of the directory: each path through /proc/PID/root costs a lookup of its own
    made = os.open(mounter.view(disk) if mounter is not None else disk, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.close(os.open("masked", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444, dir_fd=made))
        os.mkdir("masked.d", 0o555, dir_fd=made)
        for name in _on_this_kernel(QUIET_PROC_FILES):
            fd = os.open(f"proc-{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444, dir_fd=made)
            with open(fd, "w") as file:
                file.write(quiet_proc_file(name))
            args += ["--ro-bind", str(disk / f"proc-{name}"), f"/proc/{name}"]
    finally:
        os.close(made)
    for names, source in ((MASKED_PROC_FILES, disk / "masked"), (MASKED_PROC_DIRS, disk / "masked.d")):
        for name in _on_this_kernel(names):
            args += ["--ro-bind", str(source), f"/proc/{name}"]
    return args
