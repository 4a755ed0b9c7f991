"""Run build-time commands inside a sandbox over an image being built.

The process tier's primitives, arranged for a build: bubblewrap with every
namespace (no network), the project's seccomp filter, no capabilities, a
cgroup with memory/pids/CPU limits and a kill tree, started as a freshly
allocated unprivileged host uid.  Unlike a sandbox the root is the image's own
directory, bound read-write, and the command runs as uid 0 *of the user
namespace*: to let it write what root owns in the image, the image's
root-owned files are handed to the build uid for the duration of the build
(:func:`shift_owner`) and handed back afterwards.  Nothing in the build is
ever host root, so a hostile recipe command can harm only its own image.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from ..host import cgroups
from ..host.bwrap import check_host
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
    """A seccomp program (added to the project's filter) making chown a successful no-op.

    A build step's user namespace maps one uid, so a package that gives a file to
    a system group (``chown root:staff``) would fail with EINVAL; like fakeroot, the
    build pretends it worked and the file stays root's.
    """
    path = state_dir / "seccomp-build-fake-chown-v1.bpf"
    if path.exists():
        return path
    import pyseccomp as sc

    filt = sc.SyscallFilter(sc.ALLOW)
    for name in ("chown", "fchown", "lchown", "fchownat"):
        filt.add_rule(sc.ERRNO(0), name)
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


def shift_owner(root: Path, old: int, new: int, modes: dict[str, int] | None = None) -> dict[str, int]:
    """chown every file owned by uid/gid ``old`` to ``new`` (lchown, no symlink followed).

    chown clears set-id bits; the modes of set-id files are returned (first
    pass) and restored when given (second pass).
    """
    saved: dict[str, int] = {}
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
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                saved[path] = stat.S_IMODE(st.st_mode)
            os.lchown(path, uid, gid)
    for path, mode in (modes or {}).items():
        try:
            if not stat.S_ISLNK(os.lstat(path).st_mode):
                os.chmod(path, mode)
        except FileNotFoundError:
            pass
    return saved


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
        self.uid = allocate_uid(state_dir, process_owner("image-build"))
        self._setid_modes: dict[str, int] = {}
        self._shifted = False
        self.cgroup: cgroups.SandboxCgroup | None = None
        self._record = rootfs.parent / RECORD_NAME
        try:
            limits = Limits(memory=parse_size(memory, "build_memory"), pids=4096, cpus=2.0)
            name = f"build-{secrets.token_hex(6)}"
            # what a janitor needs if this process is killed outright (see reap_leftover)
            self._record.write_text(json.dumps({"cgroup": name, "cgroup_parent": cgroups.PARENT, "uid": self.uid,
                                                "state_dir": str(state_dir)}))
            self.cgroup = cgroups.SandboxCgroup(name, limits)
            for point in self._binds:
                (rootfs / point.lstrip("/")).mkdir(parents=True, exist_ok=True)
            self._shifted = True  # before the walk: an interrupted walk is still walked back
            self._setid_modes = shift_owner(rootfs, 0, self.uid)
        except BaseException:
            self.close()
            raise

    def run(self, command: str, log: Path, timeout: float) -> tuple[int, bool]:
        """Run ``/bin/sh -c command``; output goes to ``log``. Returns (exit code, timed out)."""
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

        with open(log, "ab") as out:
            out.write(f"$ {command}\n".encode())
            out.flush()
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        env={"PATH": "/usr/bin:/bin"}, preexec_fn=join_and_drop,
                                        pass_fds=(seccomp_fd, chown_fd), close_fds=True, cwd="/")
            finally:
                os.close(seccomp_fd)
                os.close(chown_fd)
            timed_out = False
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                self.cgroup.kill_leaf(leaf)
                proc.kill()
                code = proc.wait()
            except BaseException:
                self.cgroup.kill_leaf(leaf)
                proc.kill()
                proc.wait()
                raise
            finally:
                self.cgroup.kill_leaf(leaf)  # daemons a build step left behind
                self.cgroup.remove_leaf(leaf)
            out.write(f"\n[exit {code}{', timed out' if timed_out else ''}]\n".encode())
        return code, timed_out

    def close(self) -> None:
        """Kill what is left, give the image back to root, release the uid and cgroup. Idempotent."""
        try:
            if self.cgroup is not None:
                self.cgroup.destroy()
                self.cgroup = None
        finally:
            try:
                if self._shifted:
                    shift_owner(self.rootfs, self.uid, 0, self._setid_modes)
                    self._shifted = False
                    for point in self._binds:
                        try:
                            (self.rootfs / point.lstrip("/")).rmdir()
                        except OSError:
                            pass
            finally:
                release_uid(self._state_dir, self.uid)
                self._record.unlink(missing_ok=True)


def reap_leftover(staging: Path) -> None:
    """Release the cgroup and uid of a build whose process died without closing its BuildBox."""
    try:
        record = json.loads((staging / RECORD_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return
    cgroups.reap(str(record["cgroup"]), record.get("cgroup_parent"))
    release_uid(Path(record["state_dir"]), int(record["uid"]))
    (staging / RECORD_NAME).unlink(missing_ok=True)
