"""Keep one command's memory overrun from killing a whole gVisor sandbox.

gVisor has no OOM killer of its own (google/gvisor#1967): its application
memory lives in the Sentry's memory file, charged to the sandbox's host cgroup,
so when the cgroup hits its limit the host kernel kills the biggest host
process of the group, which is the Sentry, and the sandbox dies.  Worse, any
allocation the kernel makes for the Sentry in a syscall at the limit fails
with ENOMEM, and the Go runtime dies on that (``newosproc``).

The guard turns "the sandbox went over ``memory``" into "its running commands
were OOM-killed", like the process tier, by acting *before* the hard limit:

- the hard limit is ``memory + OVERHEAD`` (the Sentry, gofer and stubs use
  ~60 MB of their own); crossing ``memory`` is the overrun;
- cgroup v1: a usage-threshold eventfd at ``memory`` wakes the guard at once;
  it SIGKILLs the running commands (through the agent) and, while they have
  not died, keeps the hard limit at least ``MARGIN`` above the usage (in steps
  of ``HEADROOM``, up to ``MAX_LIFT``) so that neither a page fault nor a
  Sentry syscall meets the limit; once usage is back under ``memory`` the
  limit is restored.  The kernel OOM killer is disabled for the group, so an
  allocation that does reach the limit in a page fault waits for the guard
  instead of getting the Sentry killed;
- if the guard cannot win (``MAX_LIFT`` reached, or memory not freed within
  ``RESTORE_DEADLINE``: e.g. a file in ``/dev/shm`` holds it), the OOM killer
  is re-enabled and the limit restored: the next overrun makes the kernel end
  the sandbox and its commands report ``oom_killed`` (re-armed, limit restored
  again, if usage comes back under the budget first).  Where the limit cannot
  be restored (the usage is above it: v1 refuses with EBUSY and kills nothing)
  the guard ends the sandbox itself (``end_sandbox``): before, the lifted limit
  stayed, and a background process of a 256M sandbox held 1.3 GiB for good.
  (Killing every command group at an overrun, background ones too, would keep
  such a sandbox alive: tried, it made the 300-command session's fork spree
  after an OOM use ~220 MiB and be killed, for a reason not found);
- cgroup v2 has no way to disable the OOM killer: ``memory.high = memory``
  throttles allocations past the budget, ``memory.max = memory + OVERHEAD``,
  and the guard polls usage every 20 ms, killing the running commands above
  ``memory``; ``memory.max`` is never lifted.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ...host import fdwait
from ...host.cgroups import SandboxCgroup

MiB = 1 << 20
#: gVisor's own memory (Sentry ~35 MB, gofer ~20 MB, stubs) on top of the sandbox's budget
OVERHEAD = 96 * MiB
#: while commands are being killed the hard limit stays this far above the usage
MARGIN = 128 * MiB
#: step by which the hard limit is lifted, and the most it is lifted in all
HEADROOM = 256 * MiB
MAX_LIFT = 1024 * MiB
RESTORE_DEADLINE = 10.0
POLL = 0.005


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class MemoryGuard:
    """Watches one sandbox's memory cgroup; calls ``kill_commands()`` on an overrun (the running
    ones), ``end_sandbox()`` where it lost and the limit cannot be restored."""

    def __init__(self, cgroup: SandboxCgroup, budget: int, kill_commands: Callable[[], None],
                 end_sandbox: Callable[[], None]) -> None:
        self._group = cgroup.memory_group
        self._v1 = cgroup.layout.version == 1
        self._budget = budget
        self._limit = budget + OVERHEAD
        self._kill_commands = kill_commands
        self._end_sandbox = end_sandbox
        #: overruns handled so far (commands finishing compare it before/after)
        self.overruns = 0
        self._disarmed = False
        #: set while no overrun is being handled: a command started during one was killed with
        #: the overrunning ones ("a command started meanwhile may be the one"), so a caller's
        #: next command right after an OOM result came back empty under load (a CI run)
        self._calm = threading.Event()
        self._calm.set()
        self._fds: list[int] = []
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._events: list[int] = []
        if self._v1:
            self._setup_v1()
        else:
            _write(self._group / "memory.max", str(self._limit))
            _write(self._group / "memory.high", str(self._budget))
        self._thread = threading.Thread(target=self._run, name="corral-gvisor-memory", daemon=True)
        self._thread.start()

    # -- cgroup v1 -------------------------------------------------------
    def _set_limit_v1(self, limit: int) -> None:
        memsw = self._group / "memory.memsw.limit_in_bytes"
        raising = limit > int((self._group / "memory.limit_in_bytes").read_text())
        # memsw must stay >= the memory limit: raise it first, lower it last
        if raising and memsw.exists():
            _write(memsw, str(limit))
        _write(self._group / "memory.limit_in_bytes", str(limit))
        if not raising and memsw.exists():
            _write(memsw, str(limit))

    def _restore_limit_v1(self, within: float = 0.0) -> bool:
        """The configured hard limit back (retried ``within`` seconds: memory is freed a moment
        after its holders die); False if the usage stays above it (EBUSY)."""
        end = time.monotonic() + within
        while True:
            try:
                self._set_limit_v1(self._limit)
                return True
            except OSError:
                if time.monotonic() >= end:
                    return False
            time.sleep(POLL)

    def _register(self, control: str, argument: str = "") -> None:
        event = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        watched = os.open(self._group / control, os.O_RDONLY | os.O_CLOEXEC)
        self._fds += [event, watched]
        self._events.append(event)
        _write(self._group / "cgroup.event_control", f"{event} {watched} {argument}".strip())

    def _setup_v1(self) -> None:
        self._set_limit_v1(self._limit)
        _write(self._group / "memory.oom_control", "1")
        self._register("memory.oom_control")
        self._register("memory.usage_in_bytes", str(self._budget))

    def _under_oom(self) -> bool:
        for line in (self._group / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "under_oom":
                return value.strip() == "1"
        return False

    def wait_calm(self, timeout: float = RESTORE_DEADLINE + 1) -> None:
        """Wait (bounded) until no overrun is being handled: before a command starts."""
        self._calm.wait(timeout)

    @contextlib.contextmanager
    def _handling_an_overrun(self) -> Iterator[None]:
        self._calm.clear()
        try:
            self.overruns += 1
            self._kill_commands()
            yield
        finally:
            self._calm.set()

    def _handle_overrun_v1(self) -> None:
        with self._handling_an_overrun():
            self._recover_v1()

    def _recover_v1(self) -> None:
        lifted = self._limit
        end = time.monotonic() + RESTORE_DEADLINE
        while time.monotonic() < end:
            usage = self._usage()
            if usage <= self._budget:
                try:
                    self._set_limit_v1(self._limit)
                    return
                except OSError:  # EBUSY: the Sentry has not released enough yet
                    pass
            elif usage > lifted - MARGIN or self._under_oom():
                if lifted - self._limit >= MAX_LIFT:
                    break  # the commands do not die or their memory stays
                lifted += HEADROOM
                self._set_limit_v1(lifted)
                self._kill_commands()  # again: a command started meanwhile may be the one
            time.sleep(POLL)
        # the guard lost: let the kernel end the sandbox rather than hang or grow it
        # (re-armed if usage ever comes back under the budget)
        _write(self._group / "memory.oom_control", "0")
        self._disarmed = True
        if not self._restore_limit_v1():
            # more is held than the configured limit, and v1 kills nothing to lower it: a lifted
            # limit left in place let the sandbox keep it for good, its neighbours OOM-killed
            self._end_sandbox()
            self._restore_limit_v1(within=RESTORE_DEADLINE)

    # -- watching --------------------------------------------------------
    def _usage(self) -> int:
        name = "memory.usage_in_bytes" if self._v1 else "memory.current"
        return int((self._group / name).read_text())

    def _run(self) -> None:
        try:
            if self._v1:
                self._run_v1()
            else:
                self._run_v2()
        except OSError:
            return  # the cgroup is gone: the sandbox is being destroyed

    def _run_v1(self) -> None:
        while True:
            ready = fdwait.readable([*self._events, self._stop_r])
            if self._stop_r in ready:
                return
            for event in ready:
                try:
                    os.eventfd_read(event)
                except BlockingIOError:
                    pass
            # a threshold event fires both ways: act only when over the budget
            if self._usage() > self._budget or self._under_oom():
                if not self._disarmed:
                    self._handle_overrun_v1()
            elif self._disarmed and self._restore_limit_v1():
                _write(self._group / "memory.oom_control", "1")
                self._disarmed = False

    def _run_v2(self) -> None:
        while not fdwait.readable([self._stop_r], 0.02):
            if self._usage() > self._budget:
                with self._handling_an_overrun():
                    end = time.monotonic() + RESTORE_DEADLINE
                    while self._usage() > self._budget and time.monotonic() < end:
                        time.sleep(0.01)

    def close(self) -> None:
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout=2)
        for fd in (self._stop_r, self._stop_w, *self._fds):
            try:
                os.close(fd)
            except OSError:
                pass
