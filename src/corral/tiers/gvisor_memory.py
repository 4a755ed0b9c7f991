"""Keep one command's memory overrun from killing a whole gVisor sandbox.

gVisor has no OOM killer of its own (google/gvisor#1967): its application
memory lives in the Sentry's memory file, charged to the sandbox's host cgroup,
so when the cgroup hits its limit the host kernel kills the biggest host
process of the group, which is the Sentry, and the sandbox dies.

The guard turns "the sandbox went over ``memory``" into "its running commands
were OOM-killed", like the process tier:

- the host cgroup's hard limit is ``memory + overhead`` (the Sentry, gofer and
  stubs themselves use ~60 MB), and the kernel OOM killer is disabled for it
  (cgroup v1 ``memory.oom_control``), so reaching the limit makes allocations
  wait instead of killing the Sentry;
- an eventfd tells the guard when that happens; it lifts the limit by
  ``headroom`` so the waiting allocation proceeds, kills the running commands
  (through the agent), and puts the limit back once their memory is freed;
- if the sandbox hits the lifted limit before that (a second overrun while the
  first is handled), the OOM killer is re-enabled: the kernel kills the
  Sentry, the sandbox ends and its commands report ``oom_killed``.

cgroup v2 has no way to disable the OOM killer; there ``memory.high`` (the
throttle point) is ``memory`` and ``memory.max`` is ``memory + overhead``; the
guard polls usage and kills the running commands when it passes ``memory``,
while the throttle slows the allocation down.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..host.cgroups import SandboxCgroup

MiB = 1 << 20
#: gVisor's own memory (Sentry ~35 MB, gofer ~20 MB, stubs) on top of the sandbox's budget
OVERHEAD = 96 * MiB
#: the room an allocation gets while its command is being killed
HEADROOM = 256 * MiB
RESTORE_DEADLINE = 10.0


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class MemoryGuard:
    """Watches one sandbox's memory cgroup; calls ``kill_commands()`` on an overrun."""

    def __init__(self, cgroup: SandboxCgroup, budget: int, kill_commands: Callable[[], None]) -> None:
        self._group = cgroup.memory_group
        self._v1 = cgroup.layout.version == 1
        self._budget = budget
        self._limit = budget + OVERHEAD
        self._kill_commands = kill_commands
        #: overruns handled so far (commands finishing compare it before/after)
        self.overruns = 0
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._event_fd = -1
        self._control_fd = -1
        if self._v1:
            self._setup_v1()
        else:
            self._setup_v2()
        self._thread = threading.Thread(target=self._run, name="corral-gvisor-memory", daemon=True)
        self._thread.start()

    # -- setup ---------------------------------------------------------
    def _set_limit_v1(self, limit: int) -> None:
        memsw = self._group / "memory.memsw.limit_in_bytes"
        raising = limit > int((self._group / "memory.limit_in_bytes").read_text())
        # memsw must stay >= the memory limit: raise it first, lower it last
        if raising and memsw.exists():
            _write(memsw, str(limit))
        _write(self._group / "memory.limit_in_bytes", str(limit))
        if not raising and memsw.exists():
            _write(memsw, str(limit))

    def _setup_v1(self) -> None:
        self._set_limit_v1(self._limit)
        _write(self._group / "memory.oom_control", "1")
        self._event_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._control_fd = os.open(self._group / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        _write(self._group / "cgroup.event_control", f"{self._event_fd} {self._control_fd}")

    def _setup_v2(self) -> None:
        _write(self._group / "memory.max", str(self._limit))
        _write(self._group / "memory.high", str(self._budget))

    # -- watching --------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if self._v1:
                    ready, _, _ = select.select([self._event_fd, self._stop_r], [], [])
                    if self._stop_r in ready:
                        return
                    try:
                        os.eventfd_read(self._event_fd)
                    except BlockingIOError:
                        continue
                    if self._under_oom():
                        self._handle_overrun_v1()
                else:
                    ready, _, _ = select.select([self._stop_r], [], [], 0.05)
                    if ready:
                        return
                    if self._usage() > self._budget:
                        self.overruns += 1
                        self._kill_commands()
                        self._wait_below(self._budget, RESTORE_DEADLINE)
        except OSError:
            return  # the cgroup is gone: the sandbox is being destroyed

    def _under_oom(self) -> bool:
        for line in (self._group / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "under_oom":
                return value.strip() == "1"
        return False

    def _usage(self) -> int:
        name = "memory.usage_in_bytes" if self._v1 else "memory.current"
        return int((self._group / name).read_text())

    def _handle_overrun_v1(self) -> None:
        self.overruns += 1
        self._set_limit_v1(self._limit + HEADROOM)  # lets the waiting allocation (and the kill) proceed
        self._kill_commands()
        if not self._wait_below(self._limit, RESTORE_DEADLINE):
            # memory did not come back: let the kernel end the sandbox rather than hang it
            _write(self._group / "memory.oom_control", "0")
            return
        for _ in range(50):
            try:
                self._set_limit_v1(self._limit)
                return
            except OSError:  # EBUSY: usage is still above; let the Sentry release more
                time.sleep(0.02)
        _write(self._group / "memory.oom_control", "0")

    def _wait_below(self, level: int, deadline: float) -> bool:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if self._usage() <= level:
                return True
            if self._v1 and self._under_oom():
                # the lifted limit is exhausted too: give up on keeping the sandbox
                _write(self._group / "memory.oom_control", "0")
                return False
            time.sleep(0.01)
        return False

    def close(self) -> None:
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout=2)
        for fd in (self._stop_r, self._stop_w, self._event_fd, self._control_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
