"""Run build-time commands inside a sandbox over an image being built.

The process tier's primitives, arranged for a build: bubblewrap with every
namespace (no network), the project's seccomp filter, no capabilities, a
cgroup with memory/pids/CPU limits and a kill tree, started as a freshly
allocated unprivileged host uid.  Unlike a sandbox the root is the image's own
directory, bound read-write, and the command runs as uid 0 *of the user
namespace*: to let it write what root owns in the image, the image's
root-owned files are handed to the build uid for the duration of the build
(:func:`shift_owner`) and handed back afterwards.  Nothing in the build is
ever host root, so a hostile recipe command can harm only its own image -- as long
as host code that later reads the image's files (dpkg's status, the identity files
every create merges) reads them without following its links or blocking on its
fifos (:func:`corral.host.openat2.read_in_tree`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..host import cgroups
from ..host.bwrap import check_host
from ..host.openat2 import open_dir_in_tree
from ..host.seccomp import bpf_path
from ..host.uids import allocate_uid, process_owner, release_uid
from ..spec import Limits, parse_size

RECORD_NAME = "buildbox.json"
BUILD_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}


def fake_chown_bpf(state_dir: Path) -> Path:
    """A seccomp program (added to the project's filter) making chown a successful no-op, and
    fallocate unsupported.

    A build step's user namespace maps one uid, so a package that gives a file to
    a system group (``chown root:staff``) would fail with EINVAL; like fakeroot, the
    build pretends it worked and the file stays root's.
    """
    path = state_dir / "seccomp-build-fake-chown-v2.bpf"
    if path.exists():
        return path
    import pyseccomp as sc

    filt = sc.SyscallFilter(sc.ALLOW)
    for name in ("chown", "fchown", "lchown", "fchownat"):
        filt.add_rule(sc.ERRNO(0), name)
    # a step's disk use is watched (disk_short), and fallocate took 900 MiB in 0.3 ms, the whole
    # disk before a look (helper 96): without it, posix_fallocate writes, at a rate a look keeps up with
    filt.add_rule(sc.ERRNO(errno.EOPNOTSUPP), "fallocate")
    fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=".seccomp-build-")
    try:
        with os.fdopen(fd, "wb") as f:
            filt.export_bpf(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


#: a build step's output kept in its log: its first STEP_LOG_MOST bytes and its last STEP_LOG_TAIL
#: (a step writing 1 GB filled the host's disk with its log, and a failed one's was read whole:
#: 500 MB of output took the builder to 4.9 GB; helper 91)
STEP_LOG_MOST = 32 << 20
STEP_LOG_TAIL = 64 << 10
#: how often a running step's host filesystem is looked at (writes here: ~3 GiB/s, less than the
#: reserve between two looks)
DISK_CHECK_EVERY = 0.25


def _copy_bounded(read_end: int, out: BinaryIO) -> None:
    """Copy a step's output from ``read_end`` (closed here) to ``out``, bounded; the rest is read
    and dropped (the step never blocks on its output), and its last bytes are added at the end."""
    kept = dropped = 0
    tail = bytearray()
    try:
        while chunk := os.read(read_end, 1 << 16):
            if kept < STEP_LOG_MOST:
                part = chunk[:STEP_LOG_MOST - kept]
                out.write(part)
                kept += len(part)
                chunk = chunk[len(part):]
            if chunk:
                dropped += len(chunk)
                tail += chunk
                del tail[:-STEP_LOG_TAIL]
        if dropped:
            last = bytes(tail)
            out.write(f"\n[{dropped - len(last):,} bytes of output dropped: a step's log keeps its first "
                      f"{STEP_LOG_MOST >> 20} MiB and last {STEP_LOG_TAIL >> 10} KiB]\n".encode() + last)
        out.flush()
    except OSError:
        pass  # the log's own disk: the step is judged by its exit, its log is what could be kept
    finally:
        os.close(read_end)


def disk_reserve(total: int) -> int:
    """Free space a build leaves on its filesystem: 1 GiB, or a tenth of a smaller one."""
    return min(1 << 30, total // 10)


def inode_reserve(total: int) -> int:
    """Free inodes a build leaves on its filesystem: a million, or a tenth of fewer."""
    return min(1_000_000, total // 10)


def disk_short(path: Path) -> str | None:
    """Why a build writing under ``path`` must stop (its filesystem is down to its reserve of
    space or of inodes), or None.  A step's files are the host's disk (the image's root is a host
    directory): 1.5 GB written in seconds, and nothing but its timeout (30 min) stopped it (helper
    91); 308,000 empty files in 8 s took inodes and hardly a byte (helper 94: the host's 16 million
    would have gone in 7 minutes)."""
    fs = os.statvfs(path)
    free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    if free < disk_reserve(total):
        return (f"was stopped: the host's disk under {path} is down to {free >> 20} MiB free, below the "
                f"{disk_reserve(total) >> 20} MiB a build leaves")
    if fs.f_files and fs.f_favail < inode_reserve(fs.f_files):  # (0: a filesystem without a count)
        return (f"was stopped: the host's disk under {path} is down to {fs.f_favail:,} free inodes, below the "
                f"{inode_reserve(fs.f_files):,} a build leaves")
    return None


@dataclass(frozen=True)
class SetIdFile:
    """A set-id file of the image as it was handed to the build uid.

    chown clears set-id bits, so they are put back when the image is handed back to root, but only
    onto this very file, unchanged: the same inode, size, times, mode and content. ``identity`` is
    taken after the chown that cleared the bits: any later write, chmod, link or utime moves the
    ctime, which nothing can set back, and the content hash covers a write within the clock's
    granularity (or an overlay copy-up that keeps the inode number)."""

    mode: int  # the mode to restore, set-id bits included
    identity: tuple[int, ...]  # (dev, ino, size, mtime_ns, ctime_ns, mode) after the chown
    sha256: str


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _open_regular(path: str) -> int | None:
    """An fd of the regular file at ``path`` itself (a link is not followed), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def shift_owner(root: Path, old: int, new: int,
                setid: dict[str, SetIdFile] | None = None) -> tuple[dict[str, SetIdFile], list[str]]:
    """chown every file owned by uid/gid ``old`` to ``new`` (lchown, no symlink followed).

    chown clears the set-id bits of regular files. Handing the image over (``setid`` None), its
    set-id files are recorded by path (:class:`SetIdFile`) and returned first. Handing it back
    (``setid`` that record), a recorded path gets its set-id mode back only if the file there is
    still the recorded one, unchanged (checked and chmodded through an fd of that file); the paths
    inside the image of the build uid's files at recorded paths that do not are returned second:
    their set-id bits stay cleared. (Restoring by path alone gave a build step that wrote its own
    bytes over ``/usr/bin/su`` a setuid-root binary in the image.) Directories keep their set-id
    bits through chown and are not recorded.
    """
    saved: dict[str, SetIdFile] = {}
    dropped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, ""]:
            path = os.path.join(dirpath, name) if name else dirpath
            if not name and dirpath != str(root):
                continue  # each directory is visited as an entry of its parent
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            uid = new if st.st_uid == old else -1
            gid = new if st.st_gid == old else -1
            if uid == -1 and gid == -1:
                continue
            if setid is None and stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                record = _record_and_chown(path, uid, gid)
                if record is not None:
                    saved[path] = record
                    continue
            elif setid is not None and path in setid:
                if stat.S_ISREG(st.st_mode) and _restore(path, uid, gid, setid[path]):
                    continue
                dropped.append("/" + os.path.relpath(path, root))
            os.lchown(path, uid, gid)
    return saved, sorted(dropped)


def _record_and_chown(path: str, uid: int, gid: int) -> SetIdFile | None:
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        mode = os.fstat(fd).st_mode
        if not mode & (stat.S_ISUID | stat.S_ISGID):
            return None
        sha256 = _sha256(fd)
        os.fchown(fd, uid, gid)
        return SetIdFile(stat.S_IMODE(mode), _identity(os.fstat(fd)), sha256)
    finally:
        os.close(fd)


def _restore(path: str, uid: int, gid: int, record: SetIdFile) -> bool:
    """chown the file at ``path`` and give it its set-id mode back, if it is ``record``'s, unchanged."""
    fd = _open_regular(path)
    if fd is None:
        return False
    try:
        if _identity(os.fstat(fd)) != record.identity or _sha256(fd) != record.sha256:
            return False
        os.fchown(fd, uid, gid)
        os.fchmod(fd, record.mode)
        return True
    finally:
        os.close(fd)


class BuildBox:
    """One build's sandbox: owns a host uid and a cgroup until :meth:`close`."""

    def __init__(self, rootfs: Path, state_dir: Path, memory: str, binds: dict[str, Path] | None = None) -> None:
        self.rootfs = rootfs
        self._bwrap = check_host()
        self._seccomp = bpf_path(state_dir)
        self._fake_chown = fake_chown_bpf(state_dir)
        self._state_dir = state_dir
        self._binds = binds or {}
        # a process's own name: gc frees it once the build is gone, even if killed before its record
        self._owner = process_owner("image-build")
        self.uid = allocate_uid(state_dir, self._owner)
        self._setid: dict[str, SetIdFile] = {}
        self._last_log: Path | None = None
        #: the image's set-id files a build step changed, left without their set-id bits (after close)
        self.setid_dropped: list[str] = []
        self._shifted = False
        self.cgroup: cgroups.SandboxCgroup | None = None
        self._record = rootfs.parent / RECORD_NAME
        try:
            limits = Limits(memory=parse_size(memory, "build_memory"), pids=4096, cpus=2.0)
            name = f"build-{secrets.token_hex(6)}"
            # what a janitor needs if this process is killed outright (see reap_leftover)
            self._record.write_text(json.dumps({"cgroup": name, "cgroup_parent": cgroups.PARENT, "uid": self.uid,
                                                "owner": self._owner, "state_dir": str(state_dir)}))
            self.cgroup = cgroups.SandboxCgroup(name, limits)
            for point in self._binds:
                _make_bind_point(rootfs, point)
            self._shifted = True  # before the walk: an interrupted walk is still walked back
            self._setid, _ = shift_owner(rootfs, 0, self.uid)
        except BaseException:
            self.close()
            raise

    def run(self, command: str, log: Path, timeout: float) -> tuple[int, str | None]:
        """Run ``/bin/sh -c command``; output goes to ``log`` (bounded: :func:`_copy_bounded`).
        Returns its exit code and why it was stopped, if it was: its timeout, or the host's disk
        (:func:`disk_short`)."""
        assert self.cgroup is not None
        leaf = self.cgroup.leaf(f"c{time.monotonic_ns()}")
        argv = [
            self._bwrap,
            "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
            "--unshare-cgroup", "--uid", "0", "--gid", "0", "--hostname", "build",
            "--bind", str(self.rootfs), "/",
        ]
        for point, host in self._binds.items():
            argv += ["--ro-bind", str(host), point]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                 "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--chdir", "/", "--clearenv"]
        for key, value in BUILD_ENV.items():
            argv += ["--setenv", key, value]
        seccomp_fd = os.open(self._seccomp, os.O_RDONLY | os.O_CLOEXEC)
        chown_fd = os.open(self._fake_chown, os.O_RDONLY | os.O_CLOEXEC)
        argv += ["--add-seccomp-fd", str(seccomp_fd), "--add-seccomp-fd", str(chown_fd), "/bin/sh", "-c", command]
        procs_files = self.cgroup.procs_files(leaf)
        uid = self.uid

        def join_and_drop() -> None:
            cgroups.join(procs_files, os.getpid())
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)

        self._last_log = log
        with open(log, "ab") as out:
            out.write(f"$ {command}\n".encode())
            out.flush()
            read_end, write_end = os.pipe2(os.O_CLOEXEC)
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=write_end, stderr=subprocess.STDOUT,
                                        env={"PATH": "/usr/bin:/bin"}, preexec_fn=join_and_drop,
                                        pass_fds=(seccomp_fd, chown_fd), close_fds=True, cwd="/")
            except BaseException:
                os.close(read_end)
                raise
            finally:
                os.close(write_end)
                os.close(seccomp_fd)
                os.close(chown_fd)
            copier = threading.Thread(target=_copy_bounded, args=(read_end, out), name="build-log", daemon=True)
            copier.start()
            stopped: str | None = None
            try:
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        code = proc.wait(timeout=max(0.0, min(DISK_CHECK_EVERY, deadline - time.monotonic())))
                        break
                    except subprocess.TimeoutExpired:
                        if time.monotonic() >= deadline:
                            stopped = f"timed out after {timeout:.0f} s"
                        elif (short := disk_short(self.rootfs)) is not None:
                            stopped = short
                        if stopped is not None:
                            self.cgroup.kill_leaf(leaf)
                            proc.kill()
                            code = proc.wait()
                            break
            except BaseException:
                self.cgroup.kill_leaf(leaf)
                proc.kill()
                proc.wait()
                raise
            finally:
                self.cgroup.kill_leaf(leaf)  # daemons a build step left behind (and the log's pipe with them)
                self.cgroup.remove_leaf(leaf)
                copier.join(10)
            out.write(f"\n[exit {code}{', ' + stopped if stopped else ''}]\n".encode())
        return code, stopped

    def close(self) -> None:
        """Kill what is left, give the image back to root, release the uid and cgroup. Idempotent."""
        try:
            if self.cgroup is not None:
                self.cgroup.destroy()
                self.cgroup = None
        finally:
            try:
                if self._shifted:
                    _, self.setid_dropped = shift_owner(self.rootfs, self.uid, 0, self._setid)
                    self._shifted = False
                    if self.setid_dropped and self._last_log is not None:
                        with open(self._last_log, "a") as out:
                            out.write("[set-id bits not restored: changed by the build: "
                                      + " ".join(self.setid_dropped) + "]\n")
                    for point in self._binds:
                        _remove_bind_point(self.rootfs, point)
            finally:
                release_uid(self._state_dir, self.uid, owner=self._owner)
                self._record.unlink(missing_ok=True)


def _make_bind_point(rootfs: Path, point: str) -> None:
    """The empty directory a host directory is bound on, made as root in an image an earlier
    build wrote: no link followed (by path, a parent image's ``/.corral-build -> /tmp/x`` had it
    made in the host's ``/tmp/x``)."""
    root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.close(open_dir_in_tree(root_fd, point, links_in_root=False, create=True))
    finally:
        os.close(root_fd)


def _remove_bind_point(rootfs: Path, point: str) -> None:
    parent, _, name = point.strip("/").rpartition("/")
    root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parent_fd = open_dir_in_tree(root_fd, parent, links_in_root=False, create=False)
        try:
            os.rmdir(name, dir_fd=parent_fd)
        finally:
            os.close(parent_fd)
    except OSError:
        pass  # not empty, or not ours to remove: left as it is
    finally:
        os.close(root_fd)


def reap_leftover(staging: Path) -> None:
    """Release the cgroup and uid of a build whose process died without closing its BuildBox."""
    try:
        record = json.loads((staging / RECORD_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return
    cgroups.reap(str(record["cgroup"]), record.get("cgroup_parent"))
    if "owner" in record:  # (an older build's record names none: gc frees its range once its process is gone)
        release_uid(Path(record["state_dir"]), int(record["uid"]), owner=str(record["owner"]))
    (staging / RECORD_NAME).unlink(missing_ok=True)
