"""The gVisor tier: the sandbox's userland runs on gVisor's user-space kernel (``runsc``).

Every syscall of the sandbox is answered by gVisor's Sentry, not the host
kernel; the Sentry itself runs under a tight seccomp filter on the host.  The
rest is shared with the process tier (:mod:`corral.tiers.linux.rootfs`): the OCI
bundle's rootfs is the sandbox's overlay on a size-limited tmpfs, the
workspace is a bind-mounted copy, and ``corral-agent`` is the container's only
process, speaking the agent protocol over runsc's stdin/stdout pipes (runsc
donates its stdio to the container).

Resources: runsc is started inside the sandbox's host cgroups (``--ignore-cgroups``
so it does not make its own), so the Sentry, the gofer and the platform's stub
processes all count against the sandbox's memory, pids and CPU limits.

Commands inside gVisor are not host processes, so a per-command host cgroup
leaf is impossible.  A command's tree is killed by SIGKILL to its session and
process group through the agent (commands run with ``setsid``); if the command
has not ended two seconds later the whole sandbox is killed through its host
cgroup (the backstop: an agent that does not obey cannot keep a command alive).
A child that leaves the command's process group (``setsid``/``setpgid``)
survives a per-command kill and lives until the sandbox is destroyed.

State: runsc's ``--root`` is inside the sandbox's ``run_dir``; teardown kills the
sandbox's cgroup (Sentry, gofer, runsc) and removes the directory, which is
what ``runsc delete --force`` would do, without its ~1.5 s of waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import HostNotSupported, InvalidSpec, SandboxClosed, SandboxError
from ...host import cgroups
from ...host.grace import expedited_move
from ...spec import NETWORK_MODES, WORKSPACE_PATH, Limits, SandboxSpec
from ..base import Availability, Capabilities, ExecRequest, OutputCallback, Process, Tier, TierSandbox
from ..linux.agent import ROOT_CAPS, USER_IDS, AgentChannel
from ..linux.agent_build import agent_binary
from ..linux.agent_process import AgentProcess
from ..linux.fs_snapshot import IdMap, id_map
from ..linux.pause import backstop_kill
from ..linux.rootfs import AGENT_PATH, reap_host_side, shm_dir
from ..linux.sandbox import LinuxSandbox
from .memory import MemoryGuard
from .net import HideRootTest, oci_namespace, root_test_misfires, runsc_args
from .platform import Platform, choose_platform, runsc_binary
from .seccomp import oci_seccomp

START_TIMEOUT = 15.0
#: how long a command may outlive the SIGKILL sent through the agent before the sandbox is killed
KILL_GRACE = 2.0
#: gVisor's Sentry and gofer are charged ~15 MiB of the sandbox's memory when idle
MIN_MEMORY = 32 << 20
HOST_TASKS_PER_TASK = 3
HOST_TASKS_OVERHEAD = 64
#: gVisor's own `pids` hierarchy inside the sandbox, where the agent makes a cgroup per command: a
#: kill reaches what left the command's process group (`setsid`), as the process tier's leaf does
COMMAND_GROUPS = "/sys/fs/cgroup/pids"


def _check_host() -> Path:
    if os.geteuid() != 0:
        raise HostNotSupported("the gVisor tier needs root on the host (for cgroups, mounts and runsc); run as root")
    return runsc_binary()


@dataclasses.dataclass(frozen=True)
class _Host:
    runsc: Path
    layout: cgroups.Layout
    platform: Platform
    agent: Path


class GVisorTier(Tier):
    name = "gvisor"
    capabilities = Capabilities(
        network_modes=NETWORK_MODES, pty=True, images=None,
        users="uid 1000 on gVisor's kernel, or root of its own user namespace there (user='root'), "
              "its 65,536 host uids its own",
        guarantees=(
            "every syscall is answered by gVisor's user-space kernel, not the host's",
            "runsc, the Sentry and the gofer are under the sandbox's host cgroups",
            "memory overruns are per-command OOM kills (the memory guard)",
            "nothing survives the sandbox or its owner",
        ),
        pause=True,
        snapshot="filesystem",
        root=True,
    )

    def __init__(self, state_dir: Path) -> None:
        # checked on first create, not here: `corral gc` must be able to reap
        # gVisor sandboxes even if runsc has been removed since
        self.state_dir = state_dir
        self._host: _Host | None = None

    def host(self) -> _Host:
        if self._host is None:
            runsc = _check_host()
            # the agent's copy under the state dir: the gofer, an unprivileged uid, must read it
            agent = agent_binary(self.state_dir)
            self._host = _Host(runsc, cgroups.detect(), choose_platform(runsc, self.state_dir), agent)
        return self._host

    @classmethod
    def probe(cls, state_dir: Path) -> Availability:
        try:
            runsc = _check_host()
            layout = cgroups.detect()
            platform = choose_platform(runsc, state_dir)
        except HostNotSupported as exc:
            return Availability(cls.name, False, str(exc), _fix_for(str(exc)))
        return Availability(
            cls.name, True, f"runsc {platform.version}, platform {platform.name} ({platform.why}), {layout.describe()}",
            details={"platform": platform.name, "why": platform.why, "runsc": str(runsc)},
        )

    def create(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path) -> TierSandbox:
        if spec.limits.memory < MIN_MEMORY:
            raise InvalidSpec(
                f"memory: the gvisor tier needs at least {MIN_MEMORY >> 20}M "
                "(gVisor's own kernel uses ~15M of the sandbox's memory)"
            )
        return GVisorSandbox(self, self.host(), spec, sandbox_id, run_dir)

    def create_from_snapshot(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path, snapshot: Path,
                             digest: str) -> TierSandbox:
        if spec.limits.memory < MIN_MEMORY:
            return self.create(spec, sandbox_id, run_dir)  # refused there
        return GVisorSandbox(self, self.host(), spec, sandbox_id, run_dir, seed=(snapshot, digest))

    def reap(self, sandbox_id: str, run_dir: Path, record: dict[str, Any]) -> None:
        # the cgroup holds runsc, the Sentry, the gofer and their stubs; runsc's state is in run_dir
        reap_host_side(self.state_dir, sandbox_id, run_dir, record)


def host_limits(limits: Limits) -> Limits:
    """The host cgroup's limits for a sandbox with ``limits``.

    Tasks: each process inside gVisor costs ~2.5 host tasks (a systrap stub
    process and its threads) and the Sentry has ~25 threads of its own; the
    sandbox's own limit is RLIMIT_NPROC inside gVisor, reached first, so a fork
    bomb gets EAGAIN instead of the host limit crashing the Sentry.  Memory is
    set by :class:`MemoryGuard`.
    """
    return dataclasses.replace(limits, pids=min(1_000_000, limits.pids * HOST_TASKS_PER_TASK + HOST_TASKS_OVERHEAD))


def _fix_for(reason: str) -> str:
    if "runsc" in reason and ("install" in reason or "too old" in reason):
        return "run `make install` (installs runsc from bookworm-backports)"
    return "see the message"


def bundle_config(
    root: Path, workspace_dir: Path, agent: Path, workspace_ro: bool, base_uid: int, pids: int,
    binds: Sequence[tuple[Path, str]] = (), agent_args: Sequence[str] = (), netns_name: str | None = None,
    shm: Path | None = None, hostname: str = "sandbox", user: str = "user",
) -> dict[str, Any]:
    """The OCI runtime config: the agent as the only process.

    The user namespace maps the sandbox's 65,536 host ids from ``base_uid`` to
    0-65535 (the sandbox user, 1000, is ``base_uid + 1000`` and owns its files
    on the host); runsc then runs the Sentry and the gofer as ``base_uid``, so
    no part of the sandbox is host root, not even for file access.  The agent
    is root of gVisor's user namespace holding only ROOT_CAPS, and makes each
    command its user (``--user``: uid 1000 with no capability unless a command
    asks for root), as in the process tier.  The seccomp policy is the process tier's
    (:mod:`.seccomp`), loaded by runsc into gVisor's kernel (``--oci-seccomp``).
    """
    ids = [{"containerID": 0, "hostID": base_uid, "size": 65536}]
    caps = list(ROOT_CAPS)
    return {
        "ociVersion": "1.0.0",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": [AGENT_PATH, "--user", str(USER_IDS[user]), "--command-groups", COMMAND_GROUPS, *agent_args],
            "env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "inheritable": [], "permitted": caps,
                             "ambient": []},
            "noNewPrivileges": True,
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096},
                # gVisor enforces this on fork/clone, per uid: the sandbox's own task limit. The
                # agent (root) no longer counts among the user's processes: one fewer for them
                {"type": "RLIMIT_NPROC", "hard": max(1, pids - 1), "soft": max(1, pids - 1)},
            ],
        },
        "root": {"path": str(root), "readonly": False},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            # gVisor's own cgroups (runsc mounts each of its hierarchies on a tmpfs here, whatever the
            # host has: the agent's command groups); the tmpfs would be 1777, writable by any command
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["nosuid", "noexec", "nodev", "mode=755"]},
            # without a /tmp mount runsc puts a tmpfs of its own there, in the Sentry's
            # memory and outside the disk limit: keep /tmp on the sandbox's disk
            {"destination": "/tmp", "type": "bind", "source": str(root / "tmp"), "options": ["rbind", "rw"]},
            # /dev/shm (1777) on the sandbox's disk too: Chromium needs a writable one, and without it
            # the Sentry's /dev tmpfs holds it, outside the disk limit
            *({"destination": "/dev/shm", "type": "bind", "source": str(shm), "options": ["rbind", "rw"]}
              for _ in (() if shm is None else (shm,))),
            {"destination": AGENT_PATH, "type": "bind", "source": str(agent), "options": ["rbind", "ro"]},
            {
                "destination": WORKSPACE_PATH, "type": "bind", "source": str(workspace_dir),
                "options": ["rbind", "ro" if workspace_ro else "rw"],
            },
            # the egress proxy's socket (network="allow"): reached with --host-uds=open
            *({"destination": inside, "type": "bind", "source": str(host_path), "options": ["bind", "rw"]}
              for host_path, inside in binds),
        ],
        "linux": {
            # network: a new empty one (none, allow), or the open mode's by path
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "user")] + [oci_namespace(netns_name)],
            "uidMappings": ids,
            "gidMappings": ids,
            "seccomp": oci_seccomp(),
        },
    }


class GVisorSandbox(LinuxSandbox):
    _connector_path = AGENT_PATH  # forwards through the agent: the loopback is the Sentry's (see linux/ports.py)
    _filesystem_snapshots = True

    def __init__(self, tier: GVisorTier, host: _Host, spec: SandboxSpec, sandbox_id: str, run_dir: Path,
                 seed: tuple[Path, str] | None = None) -> None:
        self._host = host
        self._tier = tier
        self.root_uid: int | None = None
        self._guard: MemoryGuard | None = None
        self._running: set[AgentProcess] = set()
        self._proc: subprocess.Popen[bytes] | None = None
        super().__init__(tier.state_dir, spec, sandbox_id, run_dir, seed)

    # -- creation --------------------------------------------------------
    def _setup(self) -> None:
        self.root_uid = self.uid_range.base
        self._start_userns(self._host.agent)
        self._host_agent = self._host.agent
        cgroup = self._make_cgroup(host_limits(self.spec.limits), self._host.layout)
        self._guard = MemoryGuard(cgroup, self.spec.limits.memory, self._kill_running, self._kill_sandbox)
        # the proxy socket is connected to by the gofer (root_uid on the host) on behalf of the
        # agent (uid 1000 inside, user_uid on the host): owner user_uid, group root_uid, 0660
        network = self._make_network(host_namespace=False, socket_gid=self.root_uid)
        try:  # the image's layers idmapped into the range's namespace: real owners inside
            built = self._build_root()
        finally:
            self._drop_userns()  # runsc makes its own namespace with the same map
        (built.root / "dev" / "shm").mkdir(exist_ok=True)  # runsc makes mount points in the root: not its to write
        bundle = self._run_dir / "bundle"
        bundle.mkdir(mode=0o700)
        ws_ro = self.spec.workspace is not None and self.spec.workspace.mode == "ro"
        config = bundle_config(
            built.root, built.workspace_dir, self._host.agent, ws_ro, self.root_uid, self.spec.limits.pids,
            binds=network.binds, agent_args=network.agent_args, netns_name=network.netns,
            shm=shm_dir(self._run_dir, self.uid), hostname=self.hostname, user=self.spec.user,
        )
        (bundle / "config.json").write_text(json.dumps(config))
        self._launch(bundle)

    def _launch(self, bundle: Path) -> None:
        assert self.cgroup is not None
        state = self._run_dir / "runsc"
        state.mkdir(mode=0o700)
        log = self._run_dir / "runsc.log"
        argv = [
            str(self._host.runsc),
            "--root", str(state),
            "--platform", self._host.platform.name,
            *runsc_args(self.network.netns if self.network is not None else None),
            "--ignore-cgroups",
            "--overlay2", "none",  # the rootfs already is an overlay on the sandbox's own tmpfs
            "--oci-seccomp",  # the bundle's linux.seccomp (without it runsc ignores the section)
            # only the proxy socket is ever bound in; "open" lets the gofer connect to it, not create
            *(("--host-uds", "open") if self.network is not None and self.network.binds else ()),
            "--log", str(log),
            "run", "--detach", "--bundle", str(bundle), self.id,
        ]
        to_agent_r, to_agent_w = os.pipe2(os.O_CLOEXEC)
        from_agent_r, from_agent_w = os.pipe2(os.O_CLOEXEC)
        procs_files = self.cgroup.procs_files(self.cgroup.leaf("runsc"))
        netns_name = self.network.netns if self.network is not None else None
        # open mode with a runsc that would take our namespace for the root one (see .net)
        hide = HideRootTest(netns_name) if netns_name and root_test_misfires(netns_name) else None

        def prepare() -> None:
            # between fork and exec: everything runsc starts inherits these groups
            cgroups.join(procs_files, os.getpid())
            if hide is not None:
                hide()

        try:
            # Popen returns once the child exec'd: its join (prepare) is within the window
            with expedited_move():
                self._proc = subprocess.Popen(
                    argv,
                    stdin=to_agent_r,
                    stdout=from_agent_w,
                    stderr=subprocess.DEVNULL,
                    env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                    preexec_fn=prepare,
                    close_fds=True,
                    cwd="/",
                    start_new_session=True,
                )
        except subprocess.SubprocessError as exc:  # prepare() failed in the child
            raise SandboxClosed(f"gVisor sandbox did not start: runsc's launcher: {exc}") from None
        finally:
            os.close(to_agent_r)
            os.close(from_agent_w)
            if hide is not None:
                hide.close()
        self._channel = AgentChannel(from_agent_r, to_agent_w)
        self._channel.user_ids = USER_IDS
        # The agent's READY comes ~50-100 ms before `run --detach` exits (runsc
        # still saves its state): wait for READY, or for runsc failing first.
        deadline = time.monotonic() + START_TIMEOUT
        while not self._channel.ready.wait(0.005):
            code = self._proc.poll()
            if (code is not None and code != 0) or self._channel.closed.is_set() or time.monotonic() > deadline:
                raise SandboxClosed(f"gVisor sandbox did not start: {_log_tail(log)}")
        # reap the launcher when it exits rather than keep a zombie for the sandbox's life
        threading.Thread(target=self._proc.wait, name="corral-runsc-reaper", daemon=True).start()

    # -- snapshot ----------------------------------------------------------
    def _id_map(self) -> IdMap:
        return id_map(self.uid, self.root_uid, (self.uid_range.base, self.uid_range.size))

    def _before_snapshot(self) -> None:
        # the Sentry may hold written file data in its own page cache: sync(2) writes it through
        # the gofer to the upper layers the snapshot copies (best effort: an image without sync)
        with contextlib.suppress(SandboxError):
            self.exec(ExecRequest(["sync"], {"PATH": "/usr/bin:/bin"}, "/", 30.0, 4096))

    # -- commands ----------------------------------------------------------
    def start(self, request: ExecRequest, on_output: OutputCallback | None = None) -> Process:
        channel, cgroup = self._live()
        request = self.with_network_env(request)
        guard = self._guard
        assert guard is not None
        guard.wait_calm()  # (an overrun being handled would kill this command with the others)
        oom_before = cgroup.oom_kills(), guard.overruns
        started: list[AgentProcess] = []

        def place(nspid: int) -> bool:
            # gVisor's processes are not host processes: the whole sandbox (Sentry,
            # gofer, stubs) already is in the sandbox's cgroups; nothing to place
            return True

        def kill_tree() -> None:
            if not started:
                return
            proc = started[0]
            try:
                proc.deliver_signal(signal.SIGKILL)  # the agent signals the command's session and group
            except SandboxClosed:
                return
            backstop_kill(proc, channel.pause_clock, KILL_GRACE, lambda: self._closed, self._kill_sandbox,
                          "corral-gvisor-kill")

        def finish(proc: AgentProcess) -> None:
            with self._lock:
                self._running.discard(proc)
            proc.oom_killed = (cgroup.oom_kills(), guard.overruns) != oom_before
            self.sync()

        with self._lock:
            proc = channel.start(request, on_output, place, kill_tree, finish)
            started.append(proc)
            self._running.add(proc)
        return proc

    def _kill_running(self) -> None:
        """The memory guard's action: SIGKILL every running command (their groups) through the agent."""
        with self._lock:
            running = [proc for proc in self._running if not proc.done]
        for proc in running:
            try:
                proc.deliver_signal(signal.SIGKILL)
            except SandboxClosed:
                return

    def _kill_sandbox(self) -> None:
        if self.cgroup is not None:
            self.cgroup.kill_all()

    # -- lifecycle ---------------------------------------------------------
    def reap_record(self) -> dict[str, Any]:
        return {"uid": self.uid, "root_uid": self.root_uid}

    def _stop(self) -> None:
        # Killing the cgroup ends runsc, the Sentry, the gofer and every stub at
        # once; `runsc delete` would only do the same, slower.
        if self._guard is not None:
            self._guard.close()
        if self.cgroup is not None:
            self.cgroup.kill_all()
        if self._channel is not None:
            self._channel.close()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            self._wait_killed(proc, "runsc")


def _log_tail(log: Path, limit: int = 800) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "no runsc log"
    lines = [line for line in text.splitlines() if re.search(r"\b(W|E|F)\d{4}|error|fail", line, re.I)]
    return ("\n".join(lines[-8:]) or text[-limit:])[-limit:]
