"""One wasm sandbox: its tmpfs with ``/workspace`` and ``/tmp``, its host uid and
cgroup, the worker processes of its commands, and the guest it pre-starts for
its next command (see :mod:`.tier` for the limits and docs/wasm.md).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import FileError, SandboxClosed
from ...host import cgroups, charged, mounts
from ...host.uids import allocate_uid, release_uid
from ...host.ws_copy import WorkspaceCopy
from ...spec import MiB, SandboxSpec
from ..base import ExecRequest, FileEntry, OutputCallback, Process, TierSandbox
from .files import SandboxFiles
from .process import RefusedProcess, WasmProcess
from .python import PRESTART_ARGV, NotPython, guest_argv, launch_record
from .runtime import Worker

if TYPE_CHECKING:
    from .tier import WasmTier

#: cgroup memory on top of the guest's limit: the worker's interpreter, wasmtime, the module
WORKER_OVERHEAD = 128 * MiB
#: how long a command waits for a pre-start already under way before starting its own
PRESTART_WAIT = 5.0
#: how long after a command a sandbox pre-starts the next one's interpreter
PRESTART_DELAY = 0.05


class WasmSandbox(TierSandbox):
    def __init__(self, tier: WasmTier, spec: SandboxSpec, sandbox_id: str, run_dir: Path) -> None:
        self.id = sandbox_id
        self.spec = spec
        self._tier = tier
        self._run_dir = run_dir
        self._closed = False
        self._lock = threading.Lock()
        self._running: set[WasmProcess] = set()
        #: a worker whose guest has started and waits for its command (see _prestart_soon)
        self._next: Worker | None = None
        self._prestarting = False
        self._prestart_done = threading.Event()
        self._prestart_timer: threading.Timer | None = None
        self.workspace: WorkspaceCopy | None = None
        self.cgroup: cgroups.SandboxCgroup | None = None
        self._uid_reserved = False
        self.uid, self.gid = os.getuid(), os.getgid()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        spec, tier = self.spec, self._tier
        root = self._run_dir / "fs"
        root.mkdir()
        guests = tier.standby_guests()
        standby = guests.take(spec) if guests is not None else None
        if tier.privileged:
            os.chmod(self._run_dir, 0o711)  # the worker, as the sandbox uid, must reach fs/
        if standby is not None and guests is not None:
            # a guest already started, with its own tmpfs and uid: make them this sandbox's
            self.uid = self.gid = standby.uid
            self._uid_reserved = True
            self._next = standby.worker
            try:
                guests.adopt(standby, self.id, root, mounts.disk_held_in_memory(spec.limits))
            except BaseException:
                guests.discard(standby)  # releases the uid: it is no longer ours to release
                self._next = None
                self._uid_reserved = False
                raise
        elif tier.privileged:
            self.uid = self.gid = allocate_uid(tier.state_dir, self.id)
            self._uid_reserved = True
            mounts.mount_tmpfs(root, mounts.disk_held_in_memory(spec.limits), self.uid, self.gid, 0o711)
        if tier.cgroup_layout is not None:
            # before anything is written onto the sandbox's disk: its pages are charged there
            limits = replace(spec.limits, memory=spec.limits.memory + WORKER_OVERHEAD)
            self.cgroup = cgroups.SandboxCgroup(self.id, limits, tier.cgroup_layout)
            self._leaf = self.cgroup.leaf("workers")
        ws, tmp = root / "workspace", root / "tmp"
        if spec.workspace is not None:
            self.workspace = WorkspaceCopy.create(spec.workspace.path, ws, self.uid, self.gid,
                                                  mounts.disk_held_in_memory(spec.limits), charge=self._charge)
        else:
            ws.mkdir(mode=0o755, exist_ok=True)
        tmp.mkdir(mode=0o700, exist_ok=True)
        for path in (ws, tmp):
            os.chown(path, self.uid, self.gid)
            os.chmod(path, 0o700)  # only the sandbox's uid (and root): no other sandbox's uid reads in
        self.roots = {"/workspace": ws, "/tmp": tmp}
        self.files = SandboxFiles(self.roots, self.uid, self.gid, self._charge)
        if self._next is not None:
            self._place(self._next)
        self._prestart_soon()

    def _charge(self, work: Callable[[], None]) -> None:
        """Run ``work``, which writes onto the sandbox's disk, where its pages are charged to the
        sandbox's memory (and so to the parent's that bounds all sandboxes), not to the owner's
        group, which has no limit (see ``host/charged.py``)."""
        if self.cgroup is None:
            charged.run_here(work)  # no cgroups (not root): nothing to charge to
            return
        charged.run_in_memory_group(self.cgroup, work, self._leaf)  # (v2: its workers' leaf)

    # -- commands ----------------------------------------------------------
    def _job(self, argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
        limits = self.spec.limits
        return {
            "argv": argv,
            "env": env,
            "preopens": [[str(host), guest, self._mutable(guest)] for guest, host in self.roots.items()],
            "memory": limits.memory,
            "fuel": self._tier.fuel_budget(limits.cpus, timeout),
            "timeout": timeout,
            "uid": self.uid if self._tier.privileged else None,
            "gid": self.gid if self._tier.privileged else None,
            "seccomp": str(self._tier.seccomp) if self._tier.seccomp is not None else None,
        }

    def _launch_worker(self, job: dict[str, Any], worker: Worker | None = None) -> Worker:
        """A warm worker (from the pool unless given), placed in this sandbox's cgroup, given ``job``.

        An idle worker can die while it waits (its zygote was killed, the OOM killer):
        then the next one is taken.
        """
        for attempt in range(3):
            worker = worker or self._tier.pool.take()
            try:
                self._place(worker)
                worker.control.sendall(json.dumps(job).encode() + b"\n")
                return worker
            except OSError:
                worker.close()
                worker = None
                if attempt == 2:
                    raise
            except BaseException:
                worker.close()
                raise
        raise AssertionError("unreachable")

    def _place(self, worker: Worker) -> None:
        """Put a worker in this sandbox's cgroup (limits and kill tree)."""
        if self.cgroup is not None:
            # the leaf, then every limit group the worker is not in yet (checked, not assumed)
            self.cgroup.attach(worker.pid, self._leaf)

    def _prestart_soon(self) -> None:
        """Start the next command's interpreter in the background, so that it is ready when asked.

        CPython's start-up (most of a command's cost) then overlaps with the time
        between commands.  The pre-started guest waits in a read of its stdin.
        Called when the sandbox is created and whenever a command ends.
        """
        if not self._tier.prestart:
            return
        with self._lock:
            if self._closed or self._next is not None or self._prestarting:
                return
            self._prestarting = True
            self._prestart_done.clear()
        threading.Thread(target=self._prestart, name=f"corral-wasm-prestart-{self.id}", daemon=True).start()

    def _prestart(self) -> None:
        worker: Worker | None = None
        try:
            idle = self._tier.pool.take()
            with self._lock:
                closed = self._closed
            if closed:  # destroyed meanwhile: the idle worker is still clean, give it back
                self._tier.pool.put_back(idle)
            else:
                job = self._job(list(PRESTART_ARGV), {}, self.spec.limits.timeout)
                job["wait"] = True
                worker = self._launch_worker(job, idle)
                worker.await_started()
        except Exception:  # commands fall back to a fresh start
            worker = None
        with self._lock:
            self._prestarting = False
            if worker is not None and not self._closed:
                self._next, worker = worker, None
            self._prestart_done.set()
        if worker is not None:  # the sandbox closed while the job was sent
            worker.close()

    def _take_prestarted(self) -> Worker | None:
        if self._prestarting:
            # one is on its way (e.g. the first command right after create): waiting
            # for it costs less than starting a second interpreter next to it
            self._prestart_done.wait(PRESTART_WAIT)
        with self._lock:
            worker, self._next = self._next, None
        if worker is not None and worker.proc.poll() is not None:
            worker.close()
            return None
        return worker

    def start(self, request: ExecRequest, on_output: OutputCallback | None = None) -> Process:
        if self._closed:
            raise SandboxClosed(f"sandbox {self.id} is closed", sandbox_id=self.id)
        try:
            argv = guest_argv(request.argv, request.cwd)
        except NotPython as exc:
            return RefusedProcess(str(exc), on_output)
        self._cancel_prestart_timer()
        env = dict(request.env)
        record = launch_record(argv, env) if request.timeout <= self.spec.limits.timeout else None
        worker = self._take_prestarted() if record is not None else None
        process: WasmProcess | None = None
        if worker is not None:
            job = self._job(argv, env, request.timeout)
            try:
                process = WasmProcess(self, worker, request, on_output, job, launch=record)
            except OSError:  # the pre-started guest died: start a fresh one
                worker.close()
                process = None
        if process is None:
            job = self._job(argv, env, request.timeout)
            worker = self._launch_worker(job)
            try:
                process = WasmProcess(self, worker, request, on_output, job)
            except BaseException:
                worker.close()
                raise
        with self._lock:
            if self._closed:
                process.kill()
                raise SandboxClosed(f"sandbox {self.id} is closed", sandbox_id=self.id)
            self._running.add(process)
        return process

    def _mutable(self, guest: str) -> bool:
        ws = self.spec.workspace
        return not (guest == "/workspace" and ws is not None and ws.mode == "ro")

    def _finished(self, process: WasmProcess) -> None:
        with self._lock:
            self._running.discard(process)
            # Not at once: a sandbox is often destroyed right after its last command,
            # and an interpreter started for nothing costs an idle worker and a CPU burst.
            if not self._closed and self._tier.prestart:
                self._prestart_timer = threading.Timer(PRESTART_DELAY, self._prestart_soon)
                self._prestart_timer.daemon = True
                self._prestart_timer.start()
        self.sync()

    def _cancel_prestart_timer(self) -> None:
        with self._lock:
            timer, self._prestart_timer = self._prestart_timer, None
        if timer is not None:
            timer.cancel()

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills() if self.cgroup is not None else 0

    def worker_pids(self) -> list[int]:
        """Pids of this sandbox's worker processes: running commands and the pre-started guest."""
        with self._lock:
            pids = [p.worker.pid for p in self._running]
            if self._next is not None:
                pids.append(self._next.pid)
            return pids

    # -- files -------------------------------------------------------------
    def _files(self) -> SandboxFiles:
        if self._closed:
            raise SandboxClosed(f"sandbox {self.id} is closed", sandbox_id=self.id)
        return self.files

    def read_file(self, path: str, max_bytes: int) -> bytes:
        return self._files().read_file(path, max_bytes)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._writable(path)
        self._files().write_file(path, data, mode)
        self.sync()

    def list_dir(self, path: str) -> list[FileEntry]:
        return self._files().list_dir(path)

    def stat(self, path: str) -> FileEntry:
        return self._files().stat(path)

    def remove(self, path: str, recursive: bool = False) -> None:
        self._writable(path)
        self._files().remove(path, recursive)
        self.sync()

    def make_dir(self, path: str, mode: int = 0o755) -> None:
        self._writable(path)
        self._files().make_dir(path, mode)
        self.sync()

    def _writable(self, path: str) -> None:
        ws = self.spec.workspace
        clean = os.path.normpath("/" + path.lstrip("/"))
        if ws is not None and ws.mode == "ro" and (clean == "/workspace" or clean.startswith("/workspace/")):
            raise FileError(f"{path}: the workspace is read-only", errno.EROFS)

    def sync(self) -> None:
        if self.workspace is not None and self.spec.workspace and self.spec.workspace.mode == "rw":
            self.workspace.sync_back()

    def share_cpu(self, weight: float) -> None:
        with self._lock:
            if not self._closed and self.cgroup is not None:
                self.cgroup.share_cpu(weight)

    # -- lifecycle ---------------------------------------------------------
    def alive(self) -> bool:
        return not self._closed

    def reap_record(self) -> dict[str, Any]:
        return {"uid": self.uid, "cgroup": self.cgroup is not None}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running = list(self._running)
            prestarted, self._next = self._next, None
            timer, self._prestart_timer = self._prestart_timer, None
        if timer is not None:
            timer.cancel()
        try:
            if prestarted is not None:
                prestarted.close()
            for process in running:
                process.kill()
            for process in running:
                process.join(5.0)
            if self.cgroup is not None:
                # its one leaf is known: no directory walks (a third of a teardown on v1)
                self.cgroup.destroy(leaves=[self._leaf])
        finally:
            if self.workspace is not None:
                self.workspace.close(write_back=False)  # its host directory's descriptor
            mounts.unmount_all(self._run_dir)
            shutil.rmtree(self._run_dir, ignore_errors=True)
            if self._uid_reserved:
                release_uid(self._tier.state_dir, self.uid, owner=self.id)
