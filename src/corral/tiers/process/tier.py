"""The process tier: Linux namespaces + cgroups + seccomp, launched by bubblewrap.

The sandbox's root (overlay on a size-limited tmpfs, workspace overlay) is
built by :mod:`corral.tiers.linux.rootfs`, shared with the gVisor tier.

The agent (``corral-agent``) is bwrap's pid 1 in a new pid namespace.  Every
command gets its own kill-tree cgroup leaf, joined before it may exec, so a
timeout kills daemonized children too.  bwrap is started as a per-sandbox
unprivileged host uid: nothing in the sandbox is host root, not even for file
access.

Mounts: the sandbox's disk tmpfs and overlay root are made in a mount namespace of its own
(:mod:`corral.host.mountns`), by the helper that then execs bwrap there: the host's mount
table, which bwrap copies into every new sandbox, stays the same size however many live.

Users: the sandbox's user namespace maps its whole host uid range to 0-65535
(made by the host, :mod:`corral.host.userns`, joined by bwrap with
``--userns``).  The agent is root of that namespace holding only ROOT_CAPS;
each command becomes the sandbox user (uid 1000, every capability dropped) or,
with ``user="root"``, stays uid 0 with ROOT_CAPS -- capabilities over the
sandbox's own namespaces and the files of its own uid range, none on the host.
The seccomp filter is the same for both (see ``docs/root.md``).
"""

from __future__ import annotations

import os
import resource
import subprocess
import threading
from pathlib import Path
from typing import Any

from ...errors import HostNotSupported, ResourceLimit, SandboxClosed
from ...host import cgroups
from ...host.bwrap import check_host
from ...host.grace import expedited_move
from ...host.mountns import MountNamespace
from ...host.mounts import disk_held_in_memory
from ...host.netns import NETNS_DIR
from ...host.procs import children, descendants, exited_within
from ...host.seccomp import bpf_path
from ...host.shared_tables import PTYS_PER_SANDBOX
from ...spec import NETWORK_MODES, WORKSPACE_PATH, SandboxSpec
from ..base import Availability, Capabilities, ExecRequest, OutputCallback, Process, Tier, TierSandbox
from ..linux.agent import ROOT_CAPS, USER_IDS, AgentChannel
from ..linux.agent_build import agent_binary
from ..linux.agent_process import AgentProcess
from ..linux.frames import T_GO
from ..linux.rootfs import (
    AGENT_PATH,
    BOOT_ID_PATH,
    boot_id_file,
    proc_masks,
    reap_host_side,
    sandbox_dev,
    shm_dir,
)
from ..linux.sandbox import LinuxSandbox
from .launcher import LAUNCHER
from .spares import PLACER, SETTLE

#: seconds a command waits for the spare the placer thread is placing before it is forked instead
PLACING_WAIT = 0.01

START_TIMEOUT = 10.0


class ProcessTier(Tier):
    name = "process"
    capabilities = Capabilities(
        network_modes=NETWORK_MODES, pty=True, images=None,
        users="uid 1000 with no capabilities, or root of its own user namespace (user='root'), "
              "its 65,536 host uids its own",
        guarantees=(
            "host files, processes and environment are invisible (mount, pid namespaces; clean env)",
            "no host root: an unprivileged host uid per sandbox, no capabilities, no_new_privs",
            "seccomp cuts the kernel's attack surface",
            "every process is under the memory, pids, CPU and disk limits for its whole life",
            "a timeout kills the command's whole tree; nothing survives the sandbox or its owner",
        ),
        pause=True,
        snapshot="filesystem",
        root=True,
    )

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._bwrap = check_host()
        self._layout = cgroups.detect()
        self._seccomp = bpf_path(state_dir)
        # exec-only: a sandbox watching its /.corral/agent (inotify) saw every other sandbox start
        self._agent = agent_binary(state_dir, exec_only=True)

    @classmethod
    def probe(cls, state_dir: Path) -> Availability:
        try:
            check_host()
            layout = cgroups.detect()
        except HostNotSupported as exc:
            return Availability(cls.name, False, str(exc), "see the message")
        return Availability(cls.name, True, f"bubblewrap, {layout.describe()}")

    def create(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path) -> TierSandbox:
        return ProcessSandbox(self, spec, sandbox_id, run_dir)

    def create_from_snapshot(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path, snapshot: Path,
                             digest: str) -> TierSandbox:
        return ProcessSandbox(self, spec, sandbox_id, run_dir, seed=(snapshot, digest))

    def reap(self, sandbox_id: str, run_dir: Path, record: dict[str, Any]) -> None:
        reap_host_side(self.state_dir, sandbox_id, run_dir, record)


def _check_task_limit(spec: SandboxSpec) -> None:
    """A sandbox's tasks run as its own host uid, which its owner's ``RLIMIT_NPROC`` also bounds
    (inherited; root's own tasks are exempt, the sandbox's are not): a ``pids`` limit above it
    was cut short in silence (``pids=100100`` gave ~96,000 tasks here, where the limit is half of
    ``kernel.threads-max`` and this VM's root may not raise it)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and spec.limits.pids > soft:
        raise ResourceLimit(f"pids: {spec.limits.pids} is more tasks than this host lets one user run "
                            f"({soft}, the owner's RLIMIT_NPROC, which its sandboxes inherit): ask for at most "
                            "that, or raise the owner's limit (ulimit -u, prlimit --nproc)")


#: finished commands' leaves not removed at once (a leaf whose killed processes are still exiting;
#: a command run in a spare, whose leaf waited for the next spare's placement) are tried again on
#: the placer thread this often, this many times, then at the next command (a full run once found
#: 4 of 40 timed-out commands' leaves left 5 s after them; under load 7 stayed until a command)
LEAF_RETRY_INTERVAL = 0.2
LEAF_RETRIES = 10


class ProcessSandbox(LinuxSandbox):
    _filesystem_snapshots = True

    def __init__(self, tier: ProcessTier, spec: SandboxSpec, sandbox_id: str, run_dir: Path,
                 seed: tuple[Path, str] | None = None) -> None:
        _check_task_limit(spec)
        self._tier = tier
        self._exec_count = 0
        self._leaves: list[Path] = []
        #: a timer that tries the finished leaves again is pending (see LEAF_RETRIES)
        self._leaf_retry = False
        self._agent_pid: int | None = None
        #: (pid inside, pid on the host, leaf) of the agent's spare once it sits in a leaf of its own
        self._spare: tuple[int, int, Path] | None = None
        #: set while a placed spare waits for the next command (tests wait on it, not on sleeps)
        self.spare_placed = threading.Event()
        #: the latest spare the agent announced that nobody has begun to place yet
        self._announced: int | None = None
        #: set once the placement under way (placer thread) is over, placed or not
        self._placing: threading.Event | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        #: the host's ends of the agent's pipes (from it, to it) until its channel takes them
        self._agent_pipes: tuple[int, int] | None = None
        super().__init__(tier.state_dir, spec, sandbox_id, run_dir, seed)

    # -- creation --------------------------------------------------------
    def _setup(self) -> None:
        # the sandbox's own mount namespace: its root is mounted there, never in the host's
        # table (which bwrap would copy, making every create cost more per live sandbox), by
        # the helper that then becomes bwrap's launcher, with the agent's pipes as stdio.
        # It also starts making the sandbox's user namespace at once, while the cgroup,
        # network and root are made (one process started here, not two).
        # Forked from the tier's launcher thread: bwrap dies with the thread that forked it
        # (--die-with-parent), and that one lives as long as we do
        to_agent_r, to_agent_w = os.pipe2(os.O_CLOEXEC)
        from_agent_r, from_agent_w = os.pipe2(os.O_CLOEXEC)
        self._agent_pipes = (from_agent_r, to_agent_w)
        try:
            self._mountns = MountNamespace(self._tier._agent, to_agent_r, from_agent_w, run=LAUNCHER.run,
                                           userns=self.uid_range)
            self._userns_pending = self._mountns.userns()
            self._userns_helper = self._tier._agent  # a workspace's own namespace (ws_overlay) is made by it
            self._host_agent = self._tier._agent
        finally:
            os.close(to_agent_r)
            os.close(from_agent_w)
        self._make_cgroup(self.spec.limits, self._tier._layout)
        self._make_network()
        built = self._build_root()
        self._launch(built.root, built.workspace_dir)

    def _disk_size(self) -> int:
        # its disk's pages are charged to the sandbox's memory cgroup, where the kernel's OOM
        # killer is the only answer to a full one (gVisor's memory guard outlives it)
        return disk_held_in_memory(self.spec.limits)

    def _launch(self, root: Path, ws: Path) -> None:
        assert self.cgroup is not None
        spec = self.spec
        ws_mode = spec.workspace.mode if spec.workspace else "rw"
        assert self._userns_fd is not None
        userns_fd = self._userns_fd
        assert self._mountns is not None
        argv = [
            self._tier._bwrap,
            "--userns", "4", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            *(() if self.network and self.network.netns else ("--unshare-net",)),
            "--unshare-cgroup",
            "--uid", "0", "--gid", "0", "--hostname", self.hostname,
            "--bind", str(root), "/",  # with the agent and the workspace, bound in it below
            "--proc", "/proc",
            # a /dev of the sandbox's own, whole (rootfs.sandbox_dev): its own null, zero, tty...
            # (the host's nodes showed other tenants' use of them), terminals from a devpts of its
            # own, bounded (bwrap's has no bound but the host's shared table:
            # host/shared_tables.py), and POSIX shared memory (Chromium's renderers,
            # multiprocessing) on the disk tmpfs, bounded by `disk`; read-only but for those two
            "--dev-bind", str(sandbox_dev(self._run_dir, self._mountns, self.uid_range.base,
                                          shm_dir(self._run_dir, self.uid, self._mountns), PTYS_PER_SANDBOX)), "/dev",
            "--ro-bind", str(boot_id_file(self._run_dir, self.uid_range.base, self._mountns)), BOOT_ID_PATH,
            # the host's live counters of every tenant's activity, and its kernel's command line
            *proc_masks(self._run_dir, self._mountns),
            "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL",
            *(arg for cap in ROOT_CAPS for arg in ("--cap-add", cap)),
            "--chdir", "/", "--clearenv",
        ]
        # the agent and the workspace are bound in the root by the holder, in one round trip, and
        # come with it: each bind bwrap makes re-reads the sandbox's mount table (~0.1 ms)
        self._mountns.bind_all([(self._tier._agent, root / AGENT_PATH.lstrip("/"), True),
                                (ws, root / WORKSPACE_PATH.lstrip("/"), ws_mode == "ro")])
        assert self.network is not None
        for host_path, inside in self.network.binds:
            argv += ["--bind", str(host_path), inside]
        argv += ["--seccomp", "3", AGENT_PATH, "--spare", "--hold", "--user", str(USER_IDS[spec.user]),
                 *self.network.agent_args]
        leaf = self.cgroup.leaf("agent")
        procs_files = self.cgroup.procs_files(leaf)
        assert self._mountns is not None and self._agent_pipes is not None
        seccomp_fd = os.open(self._tier._seccomp, os.O_RDONLY | os.O_CLOEXEC)
        netns_fd = None
        try:
            if self.network.netns:
                netns_fd = os.open(NETNS_DIR / self.network.netns, os.O_RDONLY | os.O_CLOEXEC)
            # the holder of the sandbox's mount namespace enters its network namespace, drops to
            # the sandbox's root uid (the owner of its user namespace, which bwrap then joins)
            # and execs bwrap (nothing in the sandbox ever runs as host root), with the seccomp
            # filter at fd 3 and the user namespace at fd 4
            # The holder joins the sandbox's cgroups while it idles, before it execs: bwrap and
            # everything it forks are then born inside them.  Moving a process that is busy
            # starting (bwrap just exec'd, cloning) waits on it (1.5-2.5 ms of the create here);
            # moving the idle holder costs ~0.1 ms (bench/cold_trace.py)
            with expedited_move():  # the first move after an idle spell would wait a grace period
                cgroups.join(procs_files, self._mountns.pid)
            self._proc = self._mountns.exec(self.uid_range.base, argv, [seccomp_fd, userns_fd], netns=netns_fd)
        finally:
            os.close(seccomp_fd)
            if netns_fd is not None:
                os.close(netns_fd)
            self._drop_userns()  # bwrap holds it now (and the image's idmapped layers do)
        # bwrap was born in the sandbox's cgroups (the holder joined them above), and so were
        # its children.  The agent (``--hold``) still forks nothing -- no relay, no spare, no
        # command -- until every process of the sandbox has been checked (reads of
        # /proc/PID/cgroup; moved if need be) and GO is sent.
        (from_agent_r, to_agent_w), self._agent_pipes = self._agent_pipes, None
        self._channel = AgentChannel(from_agent_r, to_agent_w)
        self._channel.user_ids = USER_IDS
        self._channel.on_spare = self._spare_forked
        self._channel.wait_ready(START_TIMEOUT)
        for pid in descendants(self._proc.pid):  # bwrap itself joined before its exec, above
            self.cgroup.contain(pid, leaf)
        self._channel.send(T_GO, 0)

    # -- commands ----------------------------------------------------------
    def _agent_host_pid(self) -> int:
        if self._agent_pid is None:
            assert self._proc is not None
            below = children(self._proc.pid)
            if not below:
                raise SandboxClosed("the sandbox's init process is gone")
            self._agent_pid = below[0]
        return self._agent_pid

    def _port_netns_pid(self) -> int | None:
        return self._agent_host_pid()  # the agent is in the sandbox's network namespace, whatever the mode

    def _host_pid(self, nspid: int) -> int | None:
        # /proc/PID/task/TID/children is read by position: a sibling reaped during the read
        # can make it skip a live child (seen with commands finishing on other threads), so a
        # miss is read again, and then looked for among every process of the sandbox's kill
        # tree (cgroup.procs does not skip), before the child counts as gone
        agent = self._agent_host_pid()
        for _ in range(5):
            # newest first: the command just forked is last in the list, its spare (forked
            # after the previous command) before it, and each one tried costs a status read
            found = _with_nspid(children(agent)[::-1], nspid)
            if found is not None:
                return found
        if self.cgroup is not None:
            found = _with_nspid(self.cgroup.pids(), nspid, parent=agent)
            if found is not None:
                return found
        return None

    def _spare_host_pid(self, nspid: int) -> int | None:
        """The host pid of the spare ``nspid`` if it is alive and still a spare (the name guards
        against a reused pid: only a live spare may be moved).  It is the agent's newest child
        as a rule (the agent is single-threaded: its main thread's list has them all), so one
        list and one status read find it; else the search of :meth:`_host_pid`."""
        agent = self._agent_host_pid()
        listing = _read_proc(f"/proc/{agent}/task/{agent}/children")
        for pid in reversed((listing or b"").split()):
            if _is_spare(int(pid), nspid):
                return int(pid)
        host_pid = self._host_pid(nspid)
        return host_pid if host_pid is not None and _is_spare(host_pid, nspid) else None

    def _new_leaf(self, cgroup: cgroups.SandboxCgroup) -> Path:
        """A fresh kill-tree leaf, owned by the command (or spare) it is made for.  It joins
        ``_leaves`` (the ones to remove once empty) only when that command has finished: an
        empty leaf made for a command not placed yet must not be removed by another's finish."""
        with self._lock:
            self._exec_count += 1
            return cgroup.leaf(f"e{self._exec_count}")

    def _spare_forked(self, nspid: int) -> None:
        """The agent announced a new spare (on the reader thread).  The first one, forked as the
        sandbox starts, is placed once the sandbox has been idle a while (``SETTLE``): a sandbox
        destroyed after one command is not worth the move.  Every later one is forked as the
        previous spare's command starts, and placed at once, while that command runs.  A command
        that comes before the placer began places it itself (:meth:`_claim_spare`)."""
        with self._lock:
            self._announced = nspid
        PLACER.schedule(lambda: self._place_spare(nspid), 0.0 if self._exec_count else SETTLE)

    def _place_spare(self, nspid: int) -> None:
        """Move the agent's spare into a leaf of its own (on the placer thread, see .spares),
        unless a command took it first; and remove the leaves of finished commands."""
        with self._lock:
            claimed = not self._closed and self.cgroup is not None and self._announced == nspid
            if claimed:
                self._announced = None
                done = self._placing = threading.Event()
        if claimed:
            try:
                placed = self._move_spare(nspid)
                if placed is not None:
                    with self._lock:
                        if self._spare is not None:
                            self._leaves.append(self._spare[2])  # a spare that died unused: its leaf is done
                        self._spare = (nspid, *placed)
                        self.spare_placed.set()
            finally:
                with self._lock:
                    self._placing = None
                done.set()
        self._retire_leaf(None)  # the leaves of commands run in earlier spares (see start's finish)

    def _move_spare(self, nspid: int) -> tuple[int, Path] | None:
        """Move the spare ``nspid`` into a new leaf: (its host pid, the leaf), or None if it is gone
        (or no longer a spare).  Raises when it could not be placed (the leaf is retired then)."""
        assert self.cgroup is not None
        host_pid = self._spare_host_pid(nspid)
        if host_pid is None:
            return None
        leaf = self._new_leaf(self.cgroup)
        try:
            self.cgroup.attach(host_pid, leaf)
        except ProcessLookupError:
            self._retire_leaf(leaf)
            return None
        except BaseException:
            self._retire_leaf(leaf)
            raise
        return host_pid, leaf

    def _claim_spare(self, cgroup: cgroups.SandboxCgroup) -> tuple[int | None, Path]:
        """The spare a command (not on a terminal) runs in, placed, and the command's leaf: the
        spare waiting placed; else the one announced and not placed yet, placed now (here: a
        command that comes as the previous one ends would otherwise wait for the placer thread,
        or be forked and placed the slow way); else, if the placer is placing one, that one once
        it is done.  (None, a new leaf) when there is none: the agent forks the command."""
        for attempt in range(2):
            with self._lock:
                placed, announced, placing = self._spare, self._announced, self._placing
                self._spare = None
                if placed is None and announced is not None:
                    self._announced = None
                self.spare_placed.clear()
            if placed is not None:
                spare, host_pid, leaf = placed
                # placed ahead of time: check it is still so (a read; a move only if it is not),
                # now, for the agent lets it run the command as soon as it gets it, with no GO.
                # Found in every group and in its own leaf, it is the spare: that leaf was made
                # for it alone and nothing else is ever moved there, nor forked there (a spare
                # forks nothing), so a host pid reused by another process fails this read
                try:
                    if cgroup.misplaced(host_pid, leaf):
                        # not where it was put: gone, and its host pid maybe another process's by
                        # now (a sandbox can churn pids), is never moved into the sandbox's tree
                        # (destroy would kill it); only a spare still known by name and number is
                        if not _is_spare(host_pid, spare):
                            raise ProcessLookupError(host_pid)
                        cgroup.contain(host_pid, leaf)
                except ProcessLookupError:
                    return None, leaf  # it died: the agent forks the command, placed in this leaf
                except BaseException:
                    self._retire_leaf(leaf)
                    raise
                return spare, leaf
            if announced is not None:
                moved = self._move_spare(announced)  # raises (fail closed) when it cannot be placed
                if moved is not None:
                    return announced, moved[1]
                break
            if placing is None or attempt or not placing.wait(PLACING_WAIT):
                break
        return None, self._new_leaf(cgroup)

    def start(self, request: ExecRequest, on_output: OutputCallback | None = None) -> Process:
        channel, cgroup = self._live()
        request = self.with_network_env(request)
        spare: int | None = None
        if request.pty is None:
            spare, leaf = self._claim_spare(cgroup)
        else:
            leaf = self._new_leaf(cgroup)
        oom_before = cgroup.oom_kills()

        def place(nspid: int) -> bool:
            host_pid = self._host_pid(nspid)
            if host_pid is None:
                return False
            cgroup.attach(host_pid, leaf)
            return True

        def finish(proc: AgentProcess) -> None:
            # the OOM count is the sandbox's: it is this command's only if the kernel killed it
            proc.oom_killed = proc.killed_unasked() and cgroup.oom_kills() > oom_before
            if proc.oom_killed:
                cgroup.kill_leaf(leaf)  # v1 kills only the biggest task; finish the job
            # a command run in a spare made the agent fork the next one, whose placement (on the
            # placer thread) removes this leaf, off the command's path; else it goes now
            self._retire_leaf(leaf, remove=spare is None)
            if self.workspace is not None and self.spec.workspace and self.spec.workspace.mode == "rw":
                self.workspace.sync_back()

        return channel.start(request, on_output, place, lambda: cgroup.kill_leaf(leaf), finish, spare)

    def _retire_leaf(self, leaf: Path | None, remove: bool = True, retries: int = LEAF_RETRIES) -> None:
        """``leaf``'s command is over: remove it, and every earlier finished leaf, once empty
        (background processes keep a leaf until they end or the sandbox is destroyed); what is
        not empty yet is tried again ``retries`` times, :data:`LEAF_RETRY_INTERVAL` apart, then at
        the next command.  With ``remove`` False it only joins the finished ones, for the next
        removal: the next spare's placement, or the first try (both on the placer thread)."""
        cgroup = self.cgroup
        if cgroup is None:
            return
        with self._lock:
            if leaf is not None:
                self._leaves.append(leaf)
            if remove:
                self._leaves = [old for old in self._leaves if not cgroup.remove_leaf(old)]
            again = bool(self._leaves) and retries > 0 and not self._leaf_retry
            self._leaf_retry = self._leaf_retry or again
        if again:
            # what is left waited for the next command (or the sandbox's end): a leaf whose killed
            # processes were still exiting, and, off the command's path, those of commands run in a
            # spare that finished after the next spare's placement had removed the finished ones
            PLACER.schedule(lambda: self._retry_leaves(retries - 1), LEAF_RETRY_INTERVAL)

    def _retry_leaves(self, retries: int) -> None:
        with self._lock:
            self._leaf_retry = False
        self._retire_leaf(None, retries=retries)

    # -- lifecycle ---------------------------------------------------------
    def reap_record(self) -> dict[str, Any]:
        return {"uid": self.uid, "bwrap_pid": self._proc.pid if self._proc else None, "network": self.spec.network}

    def _release(self) -> None:
        pipes, self._agent_pipes = self._agent_pipes, None
        for fd in pipes or ():
            os.close(fd)

    def _stop(self) -> None:
        # Hanging up makes the agent (pid 1 of the sandbox) exit, which kills the whole pid
        # namespace and lets bwrap reap it.  Killing the cgroup first would kill bwrap too and
        # orphan the agent to host init.  The kill is the fallback: a namespace of many tasks
        # under a small CPU limit takes long to end (30,000 threads at cpus=0.02: minutes), the
        # kill lifts the limit (SandboxCgroup.kill_all).  The reader is joined last: it has its
        # end of file once the agent is gone, not before.
        channel, proc = self._channel, self._proc
        if channel is not None:
            channel.hang_up()
        try:
            if proc is not None and not exited_within(proc, 2):
                if self.cgroup is not None:
                    self.cgroup.kill_all()
                proc.kill()
                self._wait_killed(proc, "its processes")
        finally:
            if channel is not None:
                channel.close()


def _with_nspid(pids: list[int], nspid: int, parent: int | None = None) -> int | None:
    """The host pid among ``pids`` whose innermost namespace pid is ``nspid`` (and whose
    parent is ``parent``, when given: an nspid is only unique within one pid namespace)."""
    for pid in pids:
        text = _read_proc(f"/proc/{pid}/status")
        if text is None:
            continue
        if int(_status_field(text, b"NSpid:").split()[-1]) == nspid and (
                parent is None or int(_status_field(text, b"PPid:")) == parent):
            return pid
    return None


def _is_spare(host_pid: int, nspid: int) -> bool:
    """Whether host pid ``host_pid`` is still a sandbox's spare ``nspid`` (its name, and its pid in
    the sandbox's namespace: a host process that reused the number has neither)."""
    status = _read_proc(f"/proc/{host_pid}/status")
    if status is None or _status_field(status, b"Name:").strip() != b"corral-spare":
        return False
    nspids = _status_field(status, b"NSpid:").split()
    return len(nspids) > 1 and int(nspids[-1]) == nspid


def _read_proc(path: str) -> bytes | None:
    """A small /proc file's bytes (one read), None when its process is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        return os.read(fd, 16384)
    except ProcessLookupError:
        return None
    finally:
        os.close(fd)


def _status_field(status: bytes, key: bytes) -> bytes:
    """One field's value in the text of ``/proc/PID/status``."""
    at = (0 if status.startswith(key) else status.index(b"\n" + key) + 1) + len(key)
    end = status.find(b"\n", at)
    return status[at : end if end >= 0 else len(status)]
