"""Cgroup moves that do not wait for an RCU grace period.

Moving a process between cgroups takes the kernel's global ``cgroup_threadgroup_rwsem`` for
writing.  Its ``rcu_sync`` goes idle when no move happened for about a grace period, and the
first move after that waits for a whole one: measured on this 2-core VM, 4.5-7.5 ms for the
first of four moves after 0.6 s idle against 0.03-0.07 ms back to back, and 15-24 ms for the
holder's join in a process-tier create after 0.5 s idle (``bench/cold_trace.py --gap 0.5``).
Every create and the spare placed after each command (see ``tiers/process/spares.py``) make
such a move, and a user's commands and creates come seconds apart: the slow case is the
common one.

With ``/sys/kernel/rcu_expedited`` set, the kernel expedites its grace periods (an
inter-processor interrupt to each CPU instead of waiting for each to pass through a quiescent
state): the same first move took 0.2 ms.  Set for good it would change every grace period of
the host, so Corral sets it only around its own moves -- the first mover of the process sets
it, the last one clears it, a fraction of a millisecond later -- and never when a move of this
process happened within :data:`WARM` seconds (the lock is still warm: nothing to expedite).

Left alone: the switch whenever it is found set by someone else (the administrator's choice,
or another Corral process's window: that process clears it), a host where it cannot be written
(no sysfs write access: the moves only wait as before), and any process with
``CORRAL_EXPEDITE_CGROUP_MOVES=0``.  Another process's window may close under a move that
joined it (that move then waits, as before).

A process killed inside its window would leave the switch set for good (a full test run here
did): each process that expedites keeps a record, :data:`RECORDS`/``expedite@PID.START``, saying
``open`` while its window is (written before the switch is set, ``closed`` after it is
cleared).  Whoever finds the switch set while some record says ``open`` for a process that is
gone -- a process's next window, at most once a second, and ``corral gc`` -- clears it, unless
a live process's record says ``open``; records of gone processes are removed.  A switch set with
no such record is the administrator's and stays.  ``corral doctor`` shows its value.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .uids import owner_is_gone, process_owner

SWITCH = "/sys/kernel/rcu_expedited"
#: one record per process that expedites (host-wide, like the uid-range claims), named by
#: :func:`uids.process_owner`
RECORDS = Path("/run/corral/expedite")
RECORD_KIND = "expedite"
#: seconds between two looks for a dead process's window from one process
REAP_INTERVAL = 1.0
#: seconds after a move of this process during which the next one finds the lock warm
WARM = 0.004


class _Expediter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._fd: int | None = None
        self._usable: bool | None = None  # None: not probed yet
        self._ours = False  # whether this process set the switch for the window now open
        self._last_move = 0.0
        self._record: int | None = None  # this process's record, open once
        self._record_pid = 0
        self._last_reap = 0.0
        #: how many times this process set the switch (tests read it)
        self.windows = 0

    def _probe(self) -> bool:
        if os.environ.get("CORRAL_EXPEDITE_CGROUP_MOVES", "1") == "0":
            return False
        try:
            self._fd = os.open(SWITCH, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        reap_left_open()  # (and the records of processes gone since, once per process)
        atexit.register(self._at_exit)
        return True

    def _at_exit(self) -> None:
        # a daemon thread (the spare placer) stopped inside its window by the interpreter's exit
        # would leave the switch set
        with self._lock:
            if self._ours:
                self._close_window()

    def _mark(self, state: bytes) -> bool:
        """This process's record says ``state``; False when it cannot be written (then no window:
        one that a kill could leave open would have nobody to close it)."""
        pid = os.getpid()
        try:
            if self._record is None or self._record_pid != pid:  # (a fork has its own record)
                RECORDS.mkdir(parents=True, exist_ok=True, mode=0o700)
                self._record = os.open(RECORDS / process_owner(RECORD_KIND), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                       0o600)
                self._record_pid = pid
            os.pwrite(self._record, state.ljust(6), 0)
            return True
        except OSError:
            return False

    def _open_window(self) -> None:
        """Set the switch unless it is set already: then it is someone else's (the administrator's,
        or another Corral process's window), and stays as it is."""
        assert self._fd is not None
        try:
            if os.pread(self._fd, 8, 0).strip() != b"0":
                now = time.monotonic()
                if now - self._last_reap < REAP_INTERVAL:
                    return
                self._last_reap = now  # (an administrator's switch: one look a second, not each move)
                if not reap_left_open():
                    return
            if not self._mark(b"open"):
                return
            os.pwrite(self._fd, b"1", 0)
            self._ours = True
            self.windows += 1
        except OSError:
            self._usable = False  # e.g. sysfs remounted read-only meanwhile: moves just wait

    def _close_window(self) -> None:
        assert self._fd is not None
        self._ours = False
        try:
            os.pwrite(self._fd, b"0", 0)
        except OSError:
            self._usable = False
            return
        self._mark(b"closed")

    @contextlib.contextmanager
    def around_move(self) -> Iterator[None]:
        with self._lock:
            if self._usable is None:
                self._usable = self._probe()
            expedite = bool(self._usable) and (self._holders > 0 or time.monotonic() - self._last_move > WARM)
            if expedite:
                self._holders += 1
                if self._holders == 1:
                    self._open_window()
        try:
            yield
        finally:
            with self._lock:
                self._last_move = time.monotonic()
                if expedite:
                    self._holders -= 1
                    if self._holders == 0 and self._ours:
                        self._close_window()


_EXPEDITER = _Expediter()


def expedited_move() -> contextlib.AbstractContextManager[None]:
    """Wrap one or more cgroup moves made by this process (never in a child between fork and
    exec: it takes a lock)."""
    return _EXPEDITER.around_move()


def reap_left_open() -> bool:
    """Clear the switch if a process that is gone left it set (its record says ``open``) and no
    live process's window is open; remove the records of gone processes.  True if cleared."""
    try:
        records = list(RECORDS.iterdir())
    except OSError:
        return False
    left_open, live_open = False, False
    for record in records:
        if not record.name.startswith(f"{RECORD_KIND}@"):
            continue
        try:
            state = record.read_bytes().strip()
        except OSError:
            continue
        if not owner_is_gone(record.name):
            live_open = live_open or state == b"open"
            continue
        left_open = left_open or state == b"open"
        with contextlib.suppress(OSError):
            record.unlink()
    if not left_open or live_open:
        return False
    try:
        with open(SWITCH, "r+b", buffering=0) as switch:
            if switch.read().strip() == b"0":
                return False
            switch.seek(0)
            switch.write(b"0")
    except OSError:
        return False
    return True


def current() -> str:
    """``/sys/kernel/rcu_expedited`` as read now ("unreadable" when it cannot be)."""
    try:
        with open(SWITCH) as f:
            return f.read().strip()
    except OSError:
        return "unreadable"
