"""Cgroups v1 and v2 behind one small interface.

Detection is by the filesystem type mounted at ``/sys/fs/cgroup`` (never by
guessing): ``cgroup2`` means a pure v2 host; ``tmpfs`` means v1, possibly a
hybrid with a v2 hierarchy at ``/sys/fs/cgroup/unified``.

A :class:`SandboxCgroup` holds one sandbox's limits (memory with swap off,
pids, cpu quota) and a *kill tree*: leaf groups, one per command plus one for
the in-sandbox agent, that can each be killed as a whole, daemonized children
included.  The kill tree lives in a v2 hierarchy when one with ``cgroup.kill``
exists (pure v2, or the hybrid's ``unified`` mount), else in the v1 freezer.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import ContainmentFailed, HostError, HostNotSupported
from ..spec import Limits, parse_size
from . import mounts
from .cgroup_tree import all_groups, kill_group, read_pids, remove_tree, rmdir_group, write
from .grace import expedited_move
from .procs import exiting, host_memory

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: every group Corral makes lives below a parent of this name
PARENT = os.environ.get("CORRAL_CGROUP_PARENT", "corral")
#: :func:`wait_drained`: a kill that ends no task in this long is stuck; none waits longer
DRAIN_STALL, DRAIN_LIMIT = 5.0, 120.0


@dataclass(frozen=True)
class Layout:
    version: int  # 1 or 2
    #: controller name -> hierarchy root (v1: per controller; v2: all the same)
    controllers: dict[str, Path]
    #: root of the hierarchy used for kill trees, and how it kills
    kill_root: Path
    kill_mode: str  # "cgroup.kill", "freeze" (v2 without cgroup.kill) or "freezer" (v1)

    def describe(self) -> str:
        ctl = ", ".join(sorted(self.controllers))
        return f"cgroup v{self.version} ({ctl}); kill trees via {self.kill_mode} at {self.kill_root}"


def _mount_types() -> dict[str, str]:
    return {point: rest.split()[0] if rest else "" for point, rest in mounts.mountinfo()}


@lru_cache(maxsize=1)
def detect() -> Layout:
    """Find out which cgroup layout this host has. Raises HostNotSupported with a fix."""
    mounts = _mount_types()
    root_type = mounts.get(str(CGROUP_ROOT))
    if root_type == "cgroup2":
        available = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
        missing = {"memory", "pids", "cpu"} - set(available)
        if missing:
            raise HostNotSupported(
                f"cgroup v2 is missing controller(s) {', '.join(sorted(missing))}; "
                "enable them (e.g. cgroup_enable=memory on the kernel command line)"
            )
        mode = "cgroup.kill" if _has_cgroup_kill(CGROUP_ROOT) else "freeze"
        return Layout(2, {c: CGROUP_ROOT for c in ("memory", "pids", "cpu")}, CGROUP_ROOT, mode)
    if root_type == "tmpfs":
        controllers: dict[str, Path] = {}
        for name in ("memory", "pids", "cpu"):
            path = CGROUP_ROOT / name
            if mounts.get(str(path)) != "cgroup" and not (path / "cgroup.procs").exists():
                raise HostNotSupported(
                    f"cgroup v1 controller {name!r} is not mounted at {path}; mount it or boot with cgroup v2"
                )
            controllers[name] = path
        unified = CGROUP_ROOT / "unified"
        if mounts.get(str(unified)) == "cgroup2" and _has_cgroup_kill(unified):
            return Layout(1, controllers, unified, "cgroup.kill")
        freezer = CGROUP_ROOT / "freezer"
        if mounts.get(str(freezer)) == "cgroup":
            return Layout(1, controllers, freezer, "freezer")
        raise HostNotSupported("cgroup v1 without a freezer or unified hierarchy: cannot kill process trees")
    raise HostNotSupported(
        f"no cgroup filesystem at {CGROUP_ROOT} (found {root_type or 'nothing'}); mount cgroup2 there"
    )


def _has_cgroup_kill(root: Path) -> bool:
    # cgroup.kill exists only in non-root groups; probe with our parent group
    parent = root / PARENT
    try:
        parent.mkdir(exist_ok=True)
    except OSError:
        return False
    return (parent / "cgroup.kill").exists()


def _relative(group: Path, root: Path) -> str:
    """A group's path as ``/proc/PID/cgroup`` shows it: relative to its hierarchy's root."""
    path, top = str(group), str(root).rstrip("/")
    if not path.startswith(top + "/"):  # string work: read on every command's placement check
        raise ValueError(f"{group} is not below {root}")
    return path[len(top):]


def _within(path: str, group: str) -> bool:
    return path == group or path.startswith(group + "/")


def tcp_limit(memory: int) -> int:
    """The TCP buffers a sandbox of ``memory`` bytes may hold on cgroup v1, where they have a
    counter of their own (``memory.kmem.tcp``) beside its memory: a quarter of it, at least
    16 MiB (loopback servers, a dozen downloads at full speed)."""
    return max(16 << 20, memory // 4)


def sandboxes_memory() -> int:
    """What all of Corral's sandboxes on this host may use together: their parent group's memory
    limit.  ``CORRAL_SANDBOXES_MEMORY`` (a size) if set; else the host's memory less what it keeps
    for itself, a tenth of it and at least 1 GiB.

    Each sandbox's own limit bounds it, but nothing bounded their sum: sandboxes each within
    their limits could together fill the host, and the kernel's global OOM killer then chose
    among *every* process (the owner or server holding them, sshd).  Past this limit the kernel
    kills within the sandboxes instead."""
    configured = os.environ.get("CORRAL_SANDBOXES_MEMORY")
    if configured:
        return parse_size(configured, "CORRAL_SANDBOXES_MEMORY")
    total = host_memory()
    return total - max(1 << 30, total // 10)


#: parents this process has set the memory limit of (once each: creates stay cheap)
_capped: set[Path] = set()


def _cap_parent_memory(layout: Layout) -> None:
    group = layout.controllers["memory"] / PARENT
    if group in _capped:
        return
    limit_file = group / ("memory.max" if layout.version == 2 else "memory.limit_in_bytes")
    cap = sandboxes_memory()
    current = limit_file.read_text().strip()
    if current == "max" or int(current) > cap:  # an operator's lower limit stays
        try:
            write(limit_file, str(cap))
        except OSError:
            pass  # sandboxes already use more (v1: EBUSY): it is tried again by the next process
        else:
            _capped.add(group)
    else:
        _capped.add(group)


def _ensure_parent(layout: Layout) -> None:
    for root in {*layout.controllers.values(), layout.kill_root}:
        (root / PARENT).mkdir(exist_ok=True)
    if layout.version == 2:
        # controllers must be enabled from the root down to our parent
        wanted = "+memory +pids +cpu"
        for group in (CGROUP_ROOT, CGROUP_ROOT / PARENT):
            current = (group / "cgroup.subtree_control").read_text().split()
            if not {"memory", "pids", "cpu"} <= set(current):
                try:
                    write(group / "cgroup.subtree_control", wanted)
                except OSError as exc:
                    raise HostNotSupported(
                        f"cannot enable memory/pids/cpu controllers in {group}: {exc}. "
                        "Run Corral in a cgroup with delegated controllers and no processes of its own"
                    ) from exc
    _cap_parent_memory(layout)


def join(procs_files: Iterable[str], pid: int) -> None:
    """Write ``pid`` into each of ``procs_files`` (a sandbox's :meth:`SandboxCgroup.procs_files`).

    Only open and write: safe between fork and exec, where the launchers call it with their
    own pid so that everything they start is born inside the groups."""
    value = str(pid)
    for path in procs_files:
        with open(path, "w") as f:
            f.write(value)


class SandboxCgroup:
    """The cgroups of one sandbox: limits, kill tree, OOM counter."""

    def __init__(self, name: str, limits: Limits, layout: Layout | None = None) -> None:
        self.layout = layout or detect()
        self.name = name
        _ensure_parent(self.layout)
        self.limit_groups = sorted({root / PARENT / name for root in self.layout.controllers.values()})
        self.kill_group = self.layout.kill_root / PARENT / name
        self._memory = self.layout.controllers["memory"] / PARENT / name
        self._pids = self.layout.controllers["pids"] / PARENT / name
        self._cpu = self.layout.controllers["cpu"] / PARENT / name
        # what /proc/PID/cgroup shows for a contained process (v2: one hierarchy, the kill tree's)
        self._limit_paths = {
            controller: (group, _relative(group, self.layout.controllers[controller]))
            for controller, group in (("memory", self._memory), ("pids", self._pids), ("cpu", self._cpu))
        } if self.layout.version == 1 else {}
        self._kill_key = "freezer" if self.layout.kill_mode == "freezer" else ""
        self._kill_path = (self.kill_group, _relative(self.kill_group, self.layout.kill_root))
        #: the OOM counter's file, held open once read (read twice a command: a pread, no path walk)
        self._oom_fd: int | None = None
        self._oom_lock = threading.Lock()
        try:
            for group in {*self.limit_groups, self.kill_group}:
                group.mkdir()
            self._apply(limits)
        except BaseException:
            self.destroy()
            raise

    def _apply(self, limits: Limits) -> None:
        # v2 charges socket buffers to memory.max; v1 charges them nowhere unless the group has
        # a TCP limit: one 256 MiB sandbox's 600 loopback connections held 1.98 GB of the
        # host's TCP memory (net.ipv4.tcp_mem, one pool for every socket on the host)
        period = 100_000
        quota = max(1000, int(limits.cpus * period))
        if self.layout.version == 2:
            write(self._memory / "memory.max", str(limits.memory))
            if (self._memory / "memory.swap.max").exists():
                write(self._memory / "memory.swap.max", "0")
            write(self._pids / "pids.max", str(limits.pids))
            write(self._cpu / "cpu.max", f"{quota} {period}")
        else:
            write(self._memory / "memory.limit_in_bytes", str(limits.memory))
            memsw = self._memory / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                write(memsw, str(limits.memory))
            try:
                write(self._memory / "memory.swappiness", "0")
            except OSError:
                pass
            tcp = self._memory / "memory.kmem.tcp.limit_in_bytes"
            if tcp.exists():
                write(tcp, str(tcp_limit(limits.memory)))
            write(self._pids / "pids.max", str(limits.pids))
            write(self._cpu / "cpu.cfs_period_us", str(period))
            write(self._cpu / "cpu.cfs_quota_us", str(quota))

    def share_cpu(self, weight: float) -> None:
        """The group's CPU weight against its siblings when the CPU is contended (cgroup v2's
        ``cpu.weight`` scale: 1-10,000, default 100, whole numbers; v1's ``cpu.shares``, 1,024 for
        100, keeps a finer part: 2 at least)."""
        if self.layout.version == 2:
            write(self._cpu / "cpu.weight", str(min(10_000, max(1, round(weight)))))
        else:
            write(self._cpu / "cpu.shares", str(min(262_144, max(2, round(weight * 1024 / 100)))))

    @property
    def memory_group(self) -> Path:
        """The group holding the memory controller's files (limits, usage, OOM events)."""
        return self._memory

    def leaf(self, leaf: str) -> Path:
        """Create (if needed) a leaf of the kill tree and return its path."""
        path = self.kill_group / leaf
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:  # e.g. cgroup.max.descendants: no leaf, so nothing may run
            raise ContainmentFailed(f"sandbox {self.name}: cannot make cgroup leaf {leaf}: {exc}", sandbox_id=self.name) from exc
        return path

    def procs_files(self, leaf: Path) -> list[str]:
        """Files a new process writes its pid into to join this sandbox (limits + kill leaf)."""
        files = {str(g / "cgroup.procs") for g in self.limit_groups}
        if self.layout.version == 2:
            # on v2 the limit groups and the kill tree are one hierarchy: the leaf is enough
            files = set()
        files.add(str(leaf / "cgroup.procs"))
        return sorted(files)

    def attach(self, pid: int, leaf: Path) -> None:
        """Move ``pid`` into ``leaf`` and make sure it sits in every limit group too.

        On v1 the leaf (kill tree) is another hierarchy than memory, pids and
        cpu: a process forked before its parent joined those would keep the
        host's groups whatever leaf it is moved to.  So every move checks every
        hierarchy and writes the ones that do not hold the process yet; a
        process that cannot be contained raises :class:`ContainmentFailed` (the
        caller must not let it run).
        """
        with expedited_move():
            write(leaf / "cgroup.procs", str(pid))
            self.contain(pid, leaf)

    def contain(self, pid: int, leaf: Path | None = None) -> None:
        """Ensure ``pid`` is in every limit group (and in ``leaf``, or some leaf of the kill tree).

        Reading ``/proc/PID/cgroup`` costs microseconds; a write is only made
        where a hierarchy is wrong, because a cgroup move may wait for an RCU
        grace period (milliseconds).  Raises ``ProcessLookupError`` if the
        process is gone, :class:`ContainmentFailed` if it cannot be contained."""
        try:
            wrong = self.misplaced(pid, leaf)
            if wrong:
                with expedited_move():
                    for group in wrong:
                        write(group / "cgroup.procs", str(pid))
                wrong = self.misplaced(pid, leaf)
        except ProcessLookupError:
            raise  # gone: nothing of it can run, the caller decides (a dead spare is replaced)
        except OSError as exc:
            raise ContainmentFailed(f"process {pid} could not be placed in sandbox {self.name}'s cgroups: {exc}",
                                    sandbox_id=self.name) from exc
        if wrong and exiting(pid):
            # the kernel silently skips a task that is exiting: it will never run again either
            raise ProcessLookupError(pid)
        if wrong:
            raise ContainmentFailed(
                f"process {pid} is not in sandbox {self.name}'s cgroups {', '.join(map(str, wrong))}",
                sandbox_id=self.name,
            )

    def misplaced(self, pid: int, leaf: Path | None = None) -> list[Path]:
        """The groups of this sandbox that should hold ``pid`` and do not (empty: fully contained).

        Raises ``ProcessLookupError`` when the process is gone."""
        try:
            fd = os.open(f"/proc/{pid}/cgroup", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ProcessLookupError(pid) from None
        try:
            text = os.read(fd, 65536).decode()
        except ProcessLookupError:
            raise  # ESRCH: it ended between the open and the read
        finally:
            os.close(fd)
        where: dict[str, str] = {}
        for line in text.splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else ("",):
                where[controller] = path
        wrong = [group for controller, (group, path) in self._limit_paths.items() if where.get(controller) != path]
        kill_group, kill_path = (leaf, _relative(leaf, self.layout.kill_root)) if leaf is not None else self._kill_path
        if not _within(where.get(self._kill_key, ""), kill_path):
            wrong.append(kill_group)
        return wrong

    def kill_leaf(self, leaf: Path) -> None:
        kill_group(leaf, self.layout.kill_mode)

    def remove_leaf(self, leaf: Path) -> bool:
        """rmdir an emptied leaf; False if processes (background ones) still live in it."""
        try:
            leaf.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def oom_kills(self) -> int:
        with self._oom_lock:  # the descriptor is closed under it too (destroy): never a reused number
            try:
                if self._oom_fd is None:
                    name = "memory.events" if self.layout.version == 2 else "memory.oom_control"
                    self._oom_fd = os.open(self._memory / name, os.O_RDONLY | os.O_CLOEXEC)
                text = b"\n" + os.pread(self._oom_fd, 4096, 0)  # a read at offset 0 makes the text anew
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENODEV):  # the group is gone
                    return 0
                raise
        at = text.find(b"\noom_kill ")
        if at < 0:
            return 0
        end = text.find(b"\n", at + 10)
        return int(text[at + 10 : end if end >= 0 else len(text)])

    def memory_usage(self) -> int:
        name = "memory.current" if self.layout.version == 2 else "memory.usage_in_bytes"
        try:
            return int((self._memory / name).read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def freeze(self, frozen: bool, deadline: float = 5.0) -> None:
        """Freeze (or thaw) every process of the sandbox, and return once the kernel reports it
        done.  The kill tree holds every process, so one write covers them all; its leaves, made
        later too, inherit the state.  A freeze that does not complete is undone."""
        if self.layout.kill_mode == "freezer":
            state_file, want = self.kill_group / "freezer.state", "FROZEN" if frozen else "THAWED"
            write(state_file, want)

            def reached() -> bool:
                return state_file.read_text().strip() == want
        else:
            events = self.kill_group / "cgroup.events"
            write(self.kill_group / "cgroup.freeze", "1" if frozen else "0")

            def reached() -> bool:
                return f"frozen {int(frozen)}" in events.read_text().splitlines()
        end = time.monotonic() + deadline
        while not reached():
            if time.monotonic() > end:
                if frozen:
                    self.freeze(False, deadline)
                raise HostError(f"cgroup {self.name}: the kernel did not report it {'frozen' if frozen else 'thawed'} "
                                f"within {deadline:g} s", sandbox_id=self.name)
            time.sleep(0.0005)

    def pids(self) -> list[int]:
        return sorted({pid for g in all_groups(self.kill_group) for pid in read_pids(g)})

    def wait_drained(self, exited: Callable[[], bool], stall: float = DRAIN_STALL,
                     limit: float = DRAIN_LIMIT) -> bool:
        """After a kill: wait until ``exited()`` holds, for as long as the sandbox's task count
        keeps falling (:func:`wait_drained`)."""
        return wait_drained(self._pids, exited, stall, limit)

    def kill_all(self) -> None:
        """Kill every process of the sandbox (it ends: every caller destroys it)."""
        kill_group(self.kill_group, self.layout.kill_mode, signalled=lambda: lift_cpu_limit(self.layout, self._cpu))
        if self.layout.version == 1:
            # belt and braces: a task that escaped the kill tree is still in the limit groups
            for group in self.limit_groups:
                for pid in read_pids(group):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    def destroy(self, leaves: Sequence[Path] = ()) -> None:
        """Kill everything and remove every group. Idempotent.

        ``leaves``: the kill tree's leaves, when the caller knows them all: they and the
        sandbox's groups are removed without walking the directories (~600 stat calls on
        cgroup v1); whatever is left then (an unknown leaf) is removed by the walk."""
        with self._oom_lock:
            if self._oom_fd is not None:
                os.close(self._oom_fd)
                self._oom_fd = None
        self.kill_all()
        if leaves:
            try:
                for group in (*leaves, self.kill_group, *self.limit_groups):
                    rmdir_group(group, tries=200)
            except OSError:
                pass  # e.g. ENOTEMPTY: a leaf we were not told of; the walk below removes it
        for group in {self.kill_group, *self.limit_groups}:
            remove_tree(group)


def reap(name: str, parent: object = None) -> None:
    """Destroy the groups of a sandbox by name (janitor use), below ``parent`` (the sandbox's
    owner's :data:`PARENT`, as its registry row recorded it; this process's when none is)."""
    layout = detect()
    under = parent if isinstance(parent, str) and _is_parent_name(parent) else PARENT
    kill_group(layout.kill_root / under / name, layout.kill_mode,
               signalled=lambda: lift_cpu_limit(layout, layout.controllers["cpu"] / under / name))
    pids_group = layout.controllers["pids"] / under / name
    wait_drained(pids_group, lambda: task_count(pids_group) == 0)
    for root in {*layout.controllers.values(), layout.kill_root}:
        group = root / under / name
        for pid in read_pids(group):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        remove_tree(group)


def task_count(pids_group: Path) -> int:
    """A group's tasks (threads, zombies not yet reaped among them)."""
    try:
        return int((pids_group / "pids.current").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def wait_drained(pids_group: Path, exited: Callable[[], bool], stall: float = DRAIN_STALL,
                 limit: float = DRAIN_LIMIT) -> bool:
    """After a kill: wait until ``exited()`` holds, for as long as the group's task count keeps
    falling (at most ``limit`` s; ``stall`` s without one fewer is a stuck kill); whether it did.
    The kernel ends a killed task table one task at a time: 96,000 threads took 0.2 s on an idle
    2-core VM and over 10 s in a loaded test run, where a fixed 5 s wait gave up on a teardown
    that was still going (and the sandbox's kill raised)."""
    start = time.monotonic()
    lowest, since = task_count(pids_group), start
    while not exited():
        now = time.monotonic()
        count = task_count(pids_group)
        if count < lowest:
            lowest, since = count, now
        elif now - since > stall or now - start > limit:
            return False
        time.sleep(0.01)
    return True


def lift_cpu_limit(layout: Layout, group: Path) -> None:
    """Lift the CPU limit of a sandbox group whose tasks all have their SIGKILL.  They run no code
    of theirs again, only the kernel's exit path, which their limit throttled all the same: a
    sandbox at cpus=0.02 took over two minutes to end 30,000 threads (0.2 s for 96,000
    unthrottled), and its kill and the janitor's gave up before."""
    try:
        if layout.version == 2:
            write(group / "cpu.max", "max")
        else:
            write(group / "cpu.cfs_quota_us", "-1")
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENODEV):  # the group is gone
            raise


def _is_parent_name(name: str) -> bool:
    # a row's value names a group below each hierarchy's root (``CORRAL_CGROUP_PARENT`` may be
    # nested, ``a/b``), and nothing else
    parts = name.split("/")
    return "\0" not in name and all(part not in ("", ".", "..") for part in parts)


def list_sandbox_groups() -> set[str]:
    """Names of every sandbox group that exists in any hierarchy (leak checks)."""
    layout = detect()
    names: set[str] = set()
    for root in {*layout.controllers.values(), layout.kill_root}:
        parent = root / PARENT
        if parent.is_dir():
            names.update(p.name for p in parent.iterdir() if p.is_dir())
    return names
