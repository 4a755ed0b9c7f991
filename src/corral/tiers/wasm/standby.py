"""Guests started before any sandbox asks for one: a cold start without CPython's start-up.

A new sandbox's first command would otherwise wait for CPython to initialize
inside wasm (~2.5e8 instructions, most of a cold start).  So the tier keeps a
pre-started guest ready: a worker already running ``python -c BOOT w`` as a
reserved host uid, with its own empty tmpfs preopened as ``/workspace`` and
``/tmp``, blocked reading its launch record.  Creating a sandbox adopts it:

- the standby guest's tmpfs is bind-mounted at the sandbox's ``fs/`` and its original
  mount point lazily detached (the guest's preopened directory fds keep
  pointing at the same tmpfs), then remounted with the sandbox's disk size;
- the reserved uid is handed to the sandbox, the worker joins its cgroup.

Only sandboxes whose limits the standby guest was started with can adopt it: the
store's memory limit and the fuel budget cannot change once a guest runs.
Standby guests are built with the default limits, so the common case is covered;
other sandboxes start their first guest themselves.  Standby guests' directories
carry their owner's pid, and a new tier removes those of dead owners.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...host import mounts
from ...host.procs import named_process_lives
from ...host.uids import allocate_uid, process_owner, release_ranges_of_dead_processes, release_uid, set_owner
from ...spec import Limits, SandboxSpec
from .python import PRESTART_ARGV
from .runtime import Worker

if TYPE_CHECKING:
    from .tier import WasmTier

MS_BIND = 0x1000
MS_REMOUNT = 0x20
# on-disk names keep the old word "spare", so a new version still reaps an old one's leftovers
#: what a standby guest's uid range is reserved for (``uids.process_owner``): released by ``gc``
#: once its process is gone, whether or not its directory was made (its range was kept for ever
#: when the owner died between the two)
OWNER_KIND = "wasm-spare"
DIRECTORY = "wasm-spares"


@dataclass
class StandbyGuest:
    worker: Worker
    uid: int
    directory: Path
    #: the tmpfs, holding workspace/ and tmp/
    fs: Path
    #: whose the uid range is until a sandbox adopts the guest (:func:`~corral.host.uids.process_owner`)
    owner: str


class StandbyGuests:
    """Keeps ``count`` pre-started guests with the default limits (needs root: tmpfs, uids)."""

    def __init__(self, tier: WasmTier, count: int = 1) -> None:
        self.tier = tier
        self.count = count
        self.limits = Limits()
        self.root = tier.state_dir / DIRECTORY
        # the standby guest runs as its own uid: it must be able to reach its tmpfs
        os.chmod(tier.state_dir, os.stat(tier.state_dir).st_mode | 0o111)
        self.root.mkdir(mode=0o711, exist_ok=True)
        os.chmod(self.root, 0o711)  # the standby guest's uid must reach its fs/
        self._ready: list[StandbyGuest] = []
        self._cond = threading.Condition()
        self._closed = False
        self._building = 0
        self.reap_stale()

    def matches(self, spec: SandboxSpec) -> bool:
        limits = spec.limits
        read_only = spec.workspace is not None and spec.workspace.mode == "ro"
        return (not read_only and limits.memory == self.limits.memory
                and limits.cpus * limits.timeout <= self.limits.cpus * self.limits.timeout)

    def take(self, spec: SandboxSpec) -> StandbyGuest | None:
        """A ready standby guest for ``spec``, or None (never waits); a replacement is started."""
        if not self.matches(spec):
            return None
        with self._cond:
            standby = self._ready.pop(0) if self._ready else None
        self.fill()
        if standby is not None and standby.worker.proc.poll() is not None:
            self.discard(standby)
            return None
        return standby

    def fill(self) -> None:
        with self._cond:
            if self._closed or len(self._ready) + self._building >= self.count:
                return
            self._building += 1
        threading.Thread(target=self._build, name="corral-wasm-standby", daemon=True).start()

    def _build(self) -> None:
        standby: StandbyGuest | None = None
        try:
            standby = self._make()
        except Exception:  # sandboxes start their own guests instead
            standby = None
        with self._cond:
            self._building -= 1
            if standby is not None and not self._closed:
                self._ready.append(standby)
                standby = None
        if standby is not None:
            self.discard(standby)

    def _make(self) -> StandbyGuest:
        tier = self.tier
        owner = process_owner(OWNER_KIND)
        uid = allocate_uid(tier.state_dir, owner)
        # named by its owner's pid and start time, as the uid range is: a reused pid is not its owner
        directory = self.root / f"{owner.rpartition('@')[2]}-{secrets.token_hex(6)}"
        fs = directory / "fs"
        standby: StandbyGuest | None = None
        try:
            directory.mkdir(mode=0o711)
            fs.mkdir()
            mounts.mount_tmpfs(fs, mounts.disk_held_in_memory(self.limits), uid, uid, 0o711)
            (fs / "workspace").mkdir(mode=0o700)
            (fs / "tmp").mkdir(mode=0o700)
            for path in (fs / "workspace", fs / "tmp"):
                os.chown(path, uid, uid)
            worker = tier.pool.take()
            standby = StandbyGuest(worker, uid, directory, fs, owner)
            job = {
                "argv": list(PRESTART_ARGV),
                "env": {},
                "preopens": [[str(fs / "workspace"), "/workspace", True], [str(fs / "tmp"), "/tmp", True]],
                "memory": self.limits.memory,
                "fuel": tier.fuel_budget(self.limits.cpus, self.limits.timeout),
                "timeout": self.limits.timeout,
                "uid": uid,
                "gid": uid,
                "seccomp": str(tier.seccomp) if tier.seccomp is not None else None,
                "wait": True,
            }
            worker.control.sendall(json.dumps(job).encode() + b"\n")
            worker.await_started()
            return standby
        except BaseException:
            if standby is not None:
                self.discard(standby)
            else:
                mounts.unmount_all(directory)
                shutil.rmtree(directory, ignore_errors=True)
                release_uid(tier.state_dir, uid, owner=owner)
            raise

    def adopt(self, standby: StandbyGuest, sandbox_id: str, fs: Path, disk: int) -> None:
        """Move the standby guest's tmpfs to ``fs`` (a sandbox's), sized ``disk``; the uid becomes the sandbox's."""
        mounts.mount(str(standby.fs), fs, "", MS_BIND)
        mounts.umount(standby.fs, lazy=True)  # the guest's open directories keep it alive
        shutil.rmtree(standby.directory, ignore_errors=True)
        mounts.mount("", fs, "", MS_REMOUNT | mounts.MS_NOSUID | mounts.MS_NODEV, f"size={disk}")
        set_owner(self.tier.state_dir, standby.uid, sandbox_id, previous=standby.owner)

    def discard(self, standby: StandbyGuest) -> None:
        standby.worker.close()
        mounts.unmount_all(standby.directory)
        shutil.rmtree(standby.directory, ignore_errors=True)
        release_uid(self.tier.state_dir, standby.uid, owner=standby.owner)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            guests, self._ready = self._ready, []
        for standby in guests:
            self.discard(standby)

    def reap_stale(self) -> None:
        """Remove standby guests (directories, mounts, uids) of owners that died."""
        reap_stale(self.tier.state_dir)


def reap_stale(state_dir: Path) -> None:
    """Remove the standby guests (directories, mounts, uids) of owners that died, in
    ``state_dir`` (a new wasm tier does it, and so does ``gc``)."""
    root = state_dir / DIRECTORY
    if not root.is_dir():
        return
    for directory in root.iterdir():
        if named_process_lives(directory.name.split("-", 1)[0]):
            continue
        mounts.unmount_all(directory)
        shutil.rmtree(directory, ignore_errors=True)
    release_ranges_of_dead_processes(state_dir)  # their uids (and any other dead process's)
