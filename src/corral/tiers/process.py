"""The process tier: Linux namespaces + cgroups + seccomp, launched by bubblewrap.

Layout of one sandbox (all below its ``run_dir``, root-only)::

    disk/           tmpfs, size = disk limit, owned by the sandbox's host uid
      root-upper/ root-work/   overlay upper for "/"
      L1-upper/ ...            one upper per extra image layer (e.g. /usr)
      ws/                      the sandbox's copy of the workspace
    root/           the merged root (overlay), other layers mounted below it

The agent (``corral-agent``) is bwrap's pid 1 in a new pid namespace.  Every
command gets its own kill-tree cgroup leaf, joined before it may exec, so a
timeout kills daemonized children too.  bwrap is started as a per-sandbox
unprivileged host uid: nothing in the sandbox is host root, not even for file
access.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

from ..egress import network as egress_network
from ..egress.network import SandboxNetwork
from ..errors import HostNotSupported, SandboxClosed
from ..host import cgroups, mounts
from ..host.netns import enter_netns
from ..host.seccomp import bpf_path
from ..host.workspace import WorkspaceCopy
from ..images import SANDBOX_HOME, SANDBOX_UID, identity_files, resolve
from ..spec import WORKSPACE_PATH, SandboxSpec
from .agent import AgentChannel, AgentProcess, agent_binary
from .base import Availability, ExecRequest, FileEntry, OutputCallback, Process, Tier, TierSandbox

#: host uids handed to sandboxes: far above any real or subordinate range
UID_BASE = 2_100_000_000
UID_RANGE = 1_000_000
AGENT_PATH = "/.corral/agent"
START_TIMEOUT = 10.0


def allocate_uid(state_dir: Path, owner: str) -> int:
    """Reserve a host uid no other live sandbox uses (a file per uid, O_EXCL)."""
    uid_dir = state_dir / "uids"
    uid_dir.mkdir(mode=0o700, exist_ok=True)
    rng = random.SystemRandom()
    for _ in range(100):
        uid = UID_BASE + rng.randrange(UID_RANGE)
        try:
            fd = os.open(uid_dir / str(uid), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            continue
        try:
            os.write(fd, owner.encode())
        finally:
            os.close(fd)
        return uid
    raise HostNotSupported("could not reserve a free host uid for the sandbox")


def release_uid(state_dir: Path, uid: int) -> None:
    try:
        (state_dir / "uids" / str(uid)).unlink()
    except FileNotFoundError:
        pass


def _check_host() -> str:
    """Path of bwrap, or HostNotSupported saying what to change."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise HostNotSupported("bubblewrap is not installed: apt-get install bubblewrap (or run `make install`)")
    if os.geteuid() != 0:
        raise HostNotSupported("the process tier needs root on the host (for cgroups and mounts); run as root")
    try:
        max_ns = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        max_ns = 1
    if max_ns == 0:
        raise HostNotSupported("user namespaces are disabled: sysctl -w user.max_user_namespaces=15000")
    apparmor = Path("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")
    if apparmor.exists() and apparmor.read_text().strip() == "1":
        raise HostNotSupported(
            "AppArmor restricts unprivileged user namespaces (Ubuntu 24.04+): "
            "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or add an AppArmor profile for bwrap"
        )
    return bwrap


class ProcessTier(Tier):
    name = "process"

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._bwrap = _check_host()
        self._layout = cgroups.detect()
        self._seccomp = bpf_path(state_dir)
        self._agent = agent_binary()

    @classmethod
    def probe(cls, state_dir: Path) -> Availability:
        try:
            _check_host()
            layout = cgroups.detect()
        except HostNotSupported as exc:
            return Availability(cls.name, False, str(exc), "see the message")
        return Availability(cls.name, True, f"bubblewrap, {layout.describe()}")

    def create(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path) -> TierSandbox:
        return ProcessSandbox(self, spec, sandbox_id, run_dir)

    def reap(self, sandbox_id: str, run_dir: Path, record: dict[str, Any]) -> None:
        cgroups.reap(sandbox_id)
        egress_network.reap(sandbox_id, record)
        mounts.unmount_all(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        if "uid" in record:
            release_uid(self.state_dir, int(record["uid"]))


class ProcessSandbox(TierSandbox):
    def __init__(self, tier: ProcessTier, spec: SandboxSpec, sandbox_id: str, run_dir: Path) -> None:
        self.id = sandbox_id
        self.spec = spec
        self._tier = tier
        self._run_dir = run_dir
        self._closed = False
        self._lock = threading.Lock()
        self._exec_count = 0
        self._leaves: list[Path] = []
        self._agent_pid: int | None = None
        self.workspace: WorkspaceCopy | None = None
        self.uid = allocate_uid(tier.state_dir, sandbox_id)
        self.cgroup: cgroups.SandboxCgroup | None = None
        self.network: SandboxNetwork | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: AgentChannel | None = None
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # -- creation --------------------------------------------------------
    def _setup(self) -> None:
        spec, run, uid = self.spec, self._run_dir, self.uid
        image = resolve(spec.image, self._tier.state_dir)
        self.cgroup = cgroups.SandboxCgroup(self.id, spec.limits, self._tier._layout)
        os.chmod(run, 0o711)  # bwrap runs as the sandbox uid and must reach root/
        self.network = SandboxNetwork(spec, self.id, run, uid)
        disk, root = run / "disk", run / "root"
        disk.mkdir()
        root.mkdir()
        mounts.mount_tmpfs(disk, spec.limits.disk, uid, uid, 0o711)
        for index, (point, lower) in enumerate(image.layers):
            upper, work = disk / f"L{index}-upper", disk / f"L{index}-work"
            upper.mkdir()
            work.mkdir()
            if point == "/":
                self._prepare_root_upper(upper, own_etc=image.own_etc)
            mounts.mount_overlay(root / point.lstrip("/") if point != "/" else root, [lower], upper, work)
        ws = disk / "ws"
        if spec.workspace is not None:
            self.workspace = WorkspaceCopy.create(spec.workspace.path, ws, uid, uid, spec.limits.disk)
        else:
            ws.mkdir(mode=0o755)
            os.chown(ws, uid, uid)
        self._launch(root, ws)

    def _prepare_root_upper(self, upper: Path, own_etc: bool) -> None:
        # mount points and the home directory must exist before bwrap runs: inside
        # the user namespace, host-root-owned directories cannot be written to
        (upper / ".corral").mkdir()
        (upper / ".corral" / "agent").touch()
        (upper / WORKSPACE_PATH.lstrip("/")).mkdir()
        home = upper / SANDBOX_HOME.lstrip("/")
        home.mkdir(parents=True)
        os.chmod(home.parent, 0o755)
        os.chown(home, self.uid, self.uid)
        os.chmod(home, 0o750)
        for d in ("tmp", "proc", "dev"):
            (upper / d).mkdir(exist_ok=True)
        os.chmod(upper / "tmp", 0o1777)
        if own_etc:
            (upper / "etc").mkdir(exist_ok=True)
            os.chmod(upper / "etc", 0o755)
            for rel, content in identity_files().items():
                (upper / rel).write_text(content)
        assert self.network is not None
        for _, inside in self.network.binds:
            (upper / inside.lstrip("/")).touch()
        for inside, data in self.network.files.items():
            target = upper / inside.lstrip("/")
            for parent in reversed(target.relative_to(upper).parents[:-1]):
                (upper / parent).mkdir(mode=0o755, exist_ok=True)
            target.write_bytes(data)
            os.chmod(target, 0o644)

    def _launch(self, root: Path, ws: Path) -> None:
        assert self.cgroup is not None
        spec = self.spec
        ws_mode = spec.workspace.mode if spec.workspace else "rw"
        argv = [
            self._tier._bwrap,
            "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            *(() if self.network and self.network.netns else ("--unshare-net",)),
            "--unshare-cgroup",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
            "--bind", str(root), "/",
            "--ro-bind", str(self._tier._agent), AGENT_PATH,
            "--ro-bind" if ws_mode == "ro" else "--bind", str(ws), WORKSPACE_PATH,
            "--proc", "/proc", "--dev", "/dev",
            "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL",
            "--chdir", "/", "--clearenv",
        ]
        to_agent_r, to_agent_w = os.pipe2(os.O_CLOEXEC)
        from_agent_r, from_agent_w = os.pipe2(os.O_CLOEXEC)
        assert self.network is not None
        for host_path, inside in self.network.binds:
            argv += ["--bind", str(host_path), inside]
        seccomp_fd = os.open(self._tier._seccomp, os.O_RDONLY | os.O_CLOEXEC)
        argv += ["--seccomp", str(seccomp_fd), AGENT_PATH, *self.network.agent_args]
        leaf = self.cgroup.leaf("agent")
        procs_files = self.cgroup.procs_files(leaf)
        uid = self.uid
        netns_name = self.network.netns

        def join_and_drop() -> None:
            # runs in the child between fork and exec: join the cgroups while
            # still root, then become the sandbox's unprivileged host uid
            pid = str(os.getpid())
            for path in procs_files:
                with open(path, "w") as f:
                    f.write(pid)
            if netns_name is not None:  # network "open": the sandbox's own namespace
                enter_netns(netns_name)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)

        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=to_agent_r,
                stdout=from_agent_w,
                stderr=subprocess.DEVNULL,
                env={"PATH": "/usr/bin:/bin"},
                preexec_fn=join_and_drop,
                pass_fds=(seccomp_fd,),
                close_fds=True,
                cwd="/",
            )
        finally:
            os.close(to_agent_r)
            os.close(from_agent_w)
            os.close(seccomp_fd)
        self._channel = AgentChannel(from_agent_r, to_agent_w)
        self._channel.wait_ready(START_TIMEOUT)

    # -- commands ----------------------------------------------------------
    def _agent_host_pid(self) -> int:
        if self._agent_pid is None:
            assert self._proc is not None
            children = Path(f"/proc/{self._proc.pid}/task/{self._proc.pid}/children").read_text().split()
            if not children:
                raise SandboxClosed("the sandbox's init process is gone")
            self._agent_pid = int(children[0])
        return self._agent_pid

    def _host_pid(self, nspid: int) -> int | None:
        agent = self._agent_host_pid()
        try:
            children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
        except FileNotFoundError:
            return None
        for child in children:
            try:
                for line in Path(f"/proc/{child}/status").read_text().splitlines():
                    if line.startswith("NSpid:"):
                        if int(line.split()[-1]) == nspid:
                            return int(child)
                        break
            except (FileNotFoundError, ProcessLookupError):
                continue
        return None

    def start(self, request: ExecRequest, on_output: OutputCallback | None = None) -> Process:
        channel, cgroup = self._live()
        if self.network is not None and self.network.env:
            request = dataclasses.replace(request, env={**self.network.env, **request.env})
        with self._lock:
            self._exec_count += 1
            leaf = cgroup.leaf(f"e{self._exec_count}")
            self._leaves.append(leaf)
        oom_before = cgroup.oom_kills()

        def place(nspid: int) -> None:
            host_pid = self._host_pid(nspid)
            if host_pid is not None:
                cgroup.attach(host_pid, leaf)

        def finish(proc: AgentProcess) -> None:
            proc.oom_killed = cgroup.oom_kills() > oom_before
            if proc.oom_killed:
                cgroup.kill_leaf(leaf)  # v1 kills only the biggest task; finish the job
            self._reap_leaves()
            if self.workspace is not None and self.spec.workspace and self.spec.workspace.mode == "rw":
                self.workspace.sync_back()

        return channel.start(request, on_output, place, lambda: cgroup.kill_leaf(leaf), finish)

    def _reap_leaves(self) -> None:
        assert self.cgroup is not None
        with self._lock:
            self._leaves = [leaf for leaf in self._leaves if not self.cgroup.remove_leaf(leaf)]

    def _live(self) -> tuple[AgentChannel, cgroups.SandboxCgroup]:
        if self._closed or self._channel is None or self.cgroup is None:
            raise SandboxClosed(f"sandbox {self.id} is closed")
        if self._channel.closed.is_set():
            raise SandboxClosed(f"sandbox {self.id} stopped (its init process died)")
        return self._channel, self.cgroup

    # -- files -------------------------------------------------------------
    def read_file(self, path: str, max_bytes: int) -> bytes:
        return self._live()[0].read_file(path, max_bytes)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._live()[0].write_file(path, data, mode)
        self.sync()

    def list_dir(self, path: str) -> list[FileEntry]:
        return self._live()[0].list_dir(path)

    def stat(self, path: str) -> FileEntry:
        return self._live()[0].stat(path)

    def remove(self, path: str, recursive: bool = False) -> None:
        self._live()[0].remove(path, recursive)
        self.sync()

    def make_dir(self, path: str, mode: int = 0o755) -> None:
        self._live()[0].make_dir(path, mode)
        self.sync()

    def sync(self) -> None:
        if self.workspace is not None and self.spec.workspace and self.spec.workspace.mode == "rw":
            self.workspace.sync_back()

    # -- lifecycle ---------------------------------------------------------
    def alive(self) -> bool:
        return not self._closed and self._channel is not None and not self._channel.closed.is_set()

    def reap_record(self) -> dict[str, Any]:
        return {"uid": self.uid, "bwrap_pid": self._proc.pid if self._proc else None, "network": self.spec.network}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self.cgroup is not None:
                self.cgroup.kill_all()
            if self._channel is not None:
                self._channel.close()
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=5)
            if self.cgroup is not None:
                self.cgroup.destroy()
        finally:
            if self.network is not None:
                self.network.close()
            mounts.unmount_all(self._run_dir)
            shutil.rmtree(self._run_dir, ignore_errors=True)
            release_uid(self._tier.state_dir, self.uid)
