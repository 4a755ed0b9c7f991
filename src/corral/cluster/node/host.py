"""One node's Corral host: the sandboxes of one cluster node, behind calls a Ray actor carries.

:class:`NodeHost` is plain Python (no Ray here): :mod:`corral.cluster.node.actor` makes it the
long-lived actor pinned to its node.  It owns the node's sandboxes through the library as any
embedded owner does -- :class:`~corral.local_transport.LocalTransport` (tiers, registry, the
janitor at its first create), :class:`~corral.pool.PoolSet` warm pools -- and adds what a
cluster needs:

- **slots**: at most ``slots`` sandboxes handed out at once (the node's ``corral_slots``); a
  create finds a free slot or waits for one up to the time it was given, then raises
  :class:`~corral.errors.ClusterFull` (the caller's placement tries the other nodes);
- **idle timeouts**: a sandbox nobody used for its ``idle_timeout`` is destroyed, so the
  sandboxes of a driver that was killed do not outlive it by more than that;
- **the janitor, again and again**: every ``janitor_interval`` seconds the registry's janitor
  reaps sandboxes whose owner died (a host actor of this machine that was killed with its node);
- **commands as long polls**: output is kept per command until it is handed out from a cursor,
  so the caller streams it with a few round trips, and a background command is found again by
  pid.  What is kept, for pollers and of results, is bounded (:mod:`.command_output`): it is the
  host actor's memory, outside every sandbox's cgroup.

Every method answers plain data (dataclasses of :mod:`corral.tiers.base` and
:mod:`corral.transport`) or raises :mod:`corral.errors`.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import ClusterFull, InvalidSpec, SandboxNotFound
from ...host.heap import return_free_memory
from ...lifecycle import SandboxInfo, matches
from ...local_backend import LocalBackend
from ...local_transport import LocalTransport
from ...pool import PoolSet, host_memory
from ...registry import gc, state_dir
from ...tiers.base import ExecResult, FileEntry
from ...transport import CommandCall, CreateOptions
from .command_output import FORGET_AFTER, MAX_BUFFERED, MAX_HOST_BUFFERED, Budget, Command, Poll, bound_kept_results

if TYPE_CHECKING:
    from ...commands import CommandInfo
    from ...egress.audit import AuditEvent
    from ...execution import Execution
    from ...sandbox import Sandbox

#: a sandbox with no idle_timeout of its own is destroyed after this long without a call
DEFAULT_IDLE_TIMEOUT = 600.0
#: how often idle sandboxes are looked for
REAP_INTERVAL = 0.5
#: how often the registry's janitor runs (sandboxes of dead owners on this machine)
JANITOR_INTERVAL = 2.0
#: for this long after output was let go of, the reaper hands free heap memory back to the node
TRIM_FOR = 5.0


@dataclass
class Entry:
    backend: LocalBackend
    idle_timeout: float
    metadata: dict[str, str]
    #: the pool member's front object, if it came from a warm pool (it holds the backend)
    sandbox: Sandbox | None = None
    last_used: float = field(default_factory=time.monotonic)
    active: int = 0
    commands: dict[int, Command] = field(default_factory=dict)


class NodeHost:
    """The sandboxes of one node; thread-safe (a Ray actor with many concurrent calls)."""

    def __init__(self, node_id: str, slots: int, state: str | None = None,
                 pools: list[dict[str, Any]] | None = None, janitor_interval: float = JANITOR_INTERVAL) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise InvalidSpec(f"slots: {slots!r} must be a whole number >= 0")
        self.node_id = node_id
        self.slots = slots
        self.root = state_dir(state)
        self._local = LocalTransport(self.root)
        self._pools = PoolSet.from_config(pools or [], self.root)
        self._entries: dict[str, Entry] = {}
        self._pending = 0
        #: creates waiting for a slot of this node
        self._waiting = 0
        self._slot_free = threading.Condition()
        self._handles = itertools.count(1)
        #: output held for pollers by all of this host's commands
        self.buffers = Budget(MAX_HOST_BUFFERED)
        self._janitor_interval = janitor_interval
        self._closed = threading.Event()
        gc(self.root)  # what a host of this machine that died left behind
        self._reaper = threading.Thread(target=self._reap_loop, name="corral-node-reaper", daemon=True)
        self._reaper.start()

    # -- placement ---------------------------------------------------------------
    def load(self, key: str | None = None) -> dict[str, Any]:
        """What placement weighs: free slots, memory not yet promised to sandboxes, warm members."""
        with self._slot_free:
            used = len(self._entries) + self._pending
            waiting = self._waiting
            promised = sum(e.backend.spec.limits.memory for e in self._entries.values())
        pool = next((p for p in self._pools.pools() if p.key == key), None) if key else None
        return {"node_id": self.node_id, "slots": self.slots, "used": used, "free": max(0, self.slots - used),
                "free_memory": max(0, host_memory() - promised), "warm": pool.idle_count() if pool else 0,
                "waiting": waiting, "buffered": self.buffers.held,
                "kept": sum(c.kept for e in list(self._entries.values()) for c in list(e.commands.values()))}

    # -- create / destroy -------------------------------------------------------------
    def _reserve(self, wait: float) -> None:
        deadline = time.monotonic() + max(0.0, wait)
        with self._slot_free:
            self._waiting += 1
            try:
                while len(self._entries) + self._pending >= self.slots:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ClusterFull(f"node {self.node_id}: all {self.slots} slots are taken")
                    self._slot_free.wait(left)
            finally:
                self._waiting -= 1
            self._pending += 1

    def create(self, options: CreateOptions, wait: float = 0.0) -> tuple[str, bool]:
        """A sandbox in a free slot (waiting up to ``wait`` s for one); (its id, from a warm pool)."""
        if options.spec.workspace is not None:
            raise InvalidSpec("workspace: a host directory of the caller's machine cannot be mounted on a cluster "
                              "node; upload files with the files API instead")
        self._reserve(wait)
        try:
            pool = self._pools.get(options.spec)
            sandbox = pool.try_acquire() if pool is not None else None
            if sandbox is not None:
                backend = sandbox._backend
                assert isinstance(backend, LocalBackend)
                if options.lifetime is not None:
                    backend.set_timeout(options.lifetime)
            else:
                plain = CreateOptions(options.spec, options.metadata, options.lifetime)
                backend = self._local.create(plain)
            entry = Entry(backend, options.idle_timeout or DEFAULT_IDLE_TIMEOUT, dict(options.metadata), sandbox)
            with self._slot_free:
                self._entries[backend.id] = entry
        finally:
            with self._slot_free:
                self._pending -= 1
                self._slot_free.notify_all()  # a failed create frees its slot for a waiter
        return backend.id, sandbox is not None

    def destroy(self, sandbox_id: str) -> bool:
        with self._slot_free:
            entry = self._entries.pop(sandbox_id, None)
            self._slot_free.notify_all()
        if entry is None:
            return False
        try:
            entry.backend.close()
        finally:  # its commands' output, kept for pollers that will not come now
            for command in list(entry.commands.values()):
                command.forget()
            entry.commands.clear()
            self.buffers.freed_at = time.monotonic()
        return True

    def shutdown(self) -> int:
        """Destroy every sandbox of this node and its warm pools (an operator's ``corral cluster down``)."""
        self._closed.set()
        ids = list(self._entries)
        for sandbox_id in ids:
            self.destroy(sandbox_id)
        self._pools.close()
        return len(ids)

    # -- lookup --------------------------------------------------------------------
    def _entry(self, sandbox_id: str) -> Entry:
        entry = self._entries.get(sandbox_id)
        if entry is None:
            raise SandboxNotFound(f"no live sandbox {sandbox_id} on node {self.node_id}", sandbox_id=sandbox_id)
        entry.last_used = time.monotonic()
        return entry

    def _use(self, entry: Entry, delta: int) -> None:
        """A command (or cell) begins (+1) or ends (-1): a sandbox in use is never idle."""
        with self._slot_free:
            entry.active += delta
            entry.last_used = time.monotonic()

    def owns(self, sandbox_id: str) -> bool:
        return sandbox_id in self._entries

    def sandboxes(self, metadata: dict[str, str] | None = None) -> list[SandboxInfo]:
        infos = []
        for sandbox_id, entry in list(self._entries.items()):
            try:
                info = entry.backend.info()
            except Exception:
                continue
            info = SandboxInfo(**{**info.to_dict(), "metadata": dict(entry.metadata)})
            if matches(info.metadata, metadata) and sandbox_id in self._entries:
                infos.append(info)
        return infos

    def info(self, sandbox_id: str) -> SandboxInfo:
        entry = self._entry(sandbox_id)
        return SandboxInfo(**{**entry.backend.info().to_dict(), "metadata": dict(entry.metadata)})

    def spec_of(self, sandbox_id: str) -> Any:
        return self._entry(sandbox_id).backend.spec

    # -- commands ---------------------------------------------------------------
    def run(self, sandbox_id: str, call: CommandCall, stdin: bytes | None) -> ExecResult:
        entry = self._entry(sandbox_id)
        self._use(entry, +1)
        try:
            return entry.backend.run(call, stdin, None)
        finally:
            self._use(entry, -1)

    def start(self, sandbox_id: str, call: CommandCall, stdin: bytes | None, background: bool) -> tuple[int, int | None]:
        """Start a command; (its handle for :meth:`poll`, its pid if already known)."""
        entry = self._entry(sandbox_id)
        command = Command(limit=min(MAX_BUFFERED, entry.backend.spec.limits.max_output), budget=self.buffers)
        if background:
            process = entry.backend.start_background(call, stdin, command.feed)
        else:
            process = entry.backend.start(call, command.feed)
            if stdin is not None:
                process.write_stdin(stdin)
        command.process = process
        handle = next(self._handles)
        entry.commands[handle] = command
        self._use(entry, +1)

        def finish() -> None:
            try:
                command.finish()
                # twice: a result holds up to max_output of each stream
                bound_kept_results(list(entry.commands.values()), 2 * entry.backend.spec.limits.max_output)
            finally:
                self._use(entry, -1)

        threading.Thread(target=finish, name="corral-node-wait", daemon=True).start()
        return handle, process.pid

    def _command(self, sandbox_id: str, handle: int) -> Command:
        command = self._entry(sandbox_id).commands.get(handle)
        if command is None:
            raise InvalidSpec(f"sandbox {sandbox_id} has no command with handle {handle}")
        return command

    def poll(self, sandbox_id: str, handle: int, cursor: int, wait: float, output: bool = True) -> Poll:
        """Output after ``cursor`` (waiting up to ``wait`` s for some, or for the end); output
        handed out is not kept (a second poller gets what came after)."""
        command = self._command(sandbox_id, handle)
        with command.changed:
            command.changed.wait_for(lambda: command.end > cursor or command.result is not None
                                     or command.error is not None, timeout=wait)
            new_cursor = command.end
            chunks = command.chunks[max(0, cursor - command.base):] if output else []
            if output:
                command.drop(new_cursor)
            result, error, truncated = command.result, command.error, command.truncated
            pid = command.process.pid if command.process is not None else None
            if result is not None:
                command.let_go_of_output()  # handed out (the object handed out stays whole)
        if error is not None:
            raise error
        return Poll(chunks, new_cursor, pid, result is not None, result, truncated)

    def stdin(self, sandbox_id: str, handle: int, data: bytes | None) -> None:
        process = self._command(sandbox_id, handle).process
        if data is None:
            process.close_stdin()
        else:
            process.write_stdin(data)

    def signal(self, sandbox_id: str, handle: int, signum: int) -> None:
        self._command(sandbox_id, handle).process.send_signal(signum)

    def kill_handle(self, sandbox_id: str, handle: int) -> None:
        self._command(sandbox_id, handle).process.kill()

    def resize(self, sandbox_id: str, handle: int, rows: int, cols: int) -> None:
        self._command(sandbox_id, handle).process.resize(rows, cols)

    def commands(self, sandbox_id: str) -> list[CommandInfo]:
        return self._entry(sandbox_id).backend.commands()

    def attach(self, sandbox_id: str, pid: int) -> int:
        """The handle of the command with this pid started through this host (running, or ended
        less than FORGET_AFTER ago)."""
        entry = self._entry(sandbox_id)
        mine = [(command.ended_at is None, handle) for handle, command in list(entry.commands.items())
                if command.process is not None and command.process.pid == pid]
        if mine:  # a running one first, else the one that ended last (its output is still here)
            return max(mine)[1]
        raise InvalidSpec(f"sandbox {sandbox_id} has no running command with pid {pid}")

    def kill_command(self, sandbox_id: str, pid: int) -> bool:
        return self._entry(sandbox_id).backend.kill_command(pid)

    # -- files and the rest ----------------------------------------------------------
    def read_file(self, sandbox_id: str, path: str, max_bytes: int) -> bytes:
        return self._entry(sandbox_id).backend.read_file(path, max_bytes)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        self._entry(sandbox_id).backend.write_file(path, data, mode)

    def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        return self._entry(sandbox_id).backend.list_dir(path)

    def stat(self, sandbox_id: str, path: str) -> FileEntry:
        return self._entry(sandbox_id).backend.stat(path)

    def remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        self._entry(sandbox_id).backend.remove(path, recursive)

    def make_dir(self, sandbox_id: str, path: str, mode: int) -> None:
        self._entry(sandbox_id).backend.make_dir(path, mode)

    def set_timeout(self, sandbox_id: str, seconds: float) -> None:
        self._entry(sandbox_id).backend.set_timeout(seconds)

    def state(self, sandbox_id: str) -> tuple[bool, bool]:
        """(alive, paused); a sandbox this node does not have is not alive."""
        entry = self._entries.get(sandbox_id)
        if entry is None:
            return False, False
        return entry.backend.alive(), entry.backend.paused

    def pause(self, sandbox_id: str) -> None:
        self._entry(sandbox_id).backend.pause()

    def resume(self, sandbox_id: str) -> None:
        self._entry(sandbox_id).backend.resume()

    def audit(self, sandbox_id: str) -> list[AuditEvent]:
        return self._entry(sandbox_id).backend.audit()

    def create_code_context(self, sandbox_id: str, language: str, cwd: str | None) -> str:
        return self._entry(sandbox_id).backend.create_code_context(language, cwd)

    def code_contexts(self, sandbox_id: str) -> list[tuple[str, str, str | None]]:
        return self._entry(sandbox_id).backend.code_contexts()

    def remove_code_context(self, sandbox_id: str, name: str) -> None:
        self._entry(sandbox_id).backend.remove_code_context(name)

    def run_code(self, sandbox_id: str, code: str, language: str | None, context: str | None,
                 timeout: float | None, envs: dict[str, str] | None) -> Execution:
        from ...sandbox import Sandbox

        entry = self._entry(sandbox_id)
        front = entry.sandbox or Sandbox(entry.backend)
        self._use(entry, +1)
        try:
            return entry.backend.run_code(front, code, language=language, context=context, timeout=timeout,
                                          envs=envs, callbacks={})
        finally:
            self._use(entry, -1)

    # -- idle sandboxes, dead owners --------------------------------------------------
    def idle(self, now: float) -> list[str]:
        return [sandbox_id for sandbox_id, e in list(self._entries.items())
                if not e.backend.alive() or (e.active == 0 and not e.backend.paused
                                             and now - e.last_used >= e.idle_timeout)]

    def _forget_ended(self, now: float) -> None:
        # a function of its own: a loop variable of the reaper's loop kept the last sandbox's
        # entry (and every command's output in it) alive after its destroy, until another came
        for entry in list(self._entries.values()):
            for handle, command in list(entry.commands.items()):
                if command.ended_at is not None and now - command.ended_at > FORGET_AFTER:
                    entry.commands.pop(handle, None)
                    command.forget()

    def _reap_loop(self) -> None:
        next_janitor = time.monotonic() + self._janitor_interval
        while not self._closed.wait(REAP_INTERVAL):
            now = time.monotonic()
            self._forget_ended(now)
            if now - self.buffers.freed_at < TRIM_FOR:
                # the megabytes of output and results let go of are handed back to the node: freed
                # by other threads, at times of their own (a command's end after its sandbox's),
                # glibc would keep them for reuse (the actor's RSS grew by each round for good)
                return_free_memory()
            for sandbox_id in self.idle(now):
                try:
                    self.destroy(sandbox_id)
                except Exception:  # the janitor reaps what a failed destroy left
                    pass
            if time.monotonic() >= next_janitor:
                next_janitor = time.monotonic() + self._janitor_interval
                try:
                    gc(self.root)
                except Exception:
                    pass
