"""The transport of a cluster's sandboxes: ``Sandbox.create(cluster=ADDRESS)`` (or ``CORRAL_CLUSTER``).

:class:`ClusterTransport` places each create on a node (:mod:`corral.cluster.placement`), asks
that node's host actor to make it, and records where it went in the :class:`ClusterRegistry`;
each sandbox's :class:`ClusterBackend` sends every call to its node's host actor.  Errors the
host raised arrive as the same :mod:`corral.errors` classes; a node that was lost makes every
call on its sandboxes raise :class:`~corral.errors.SandboxLost`, and later creates go to the
nodes that are left.  The host actors are started on the nodes by the cluster's operator
(``corral cluster up``, :func:`corral.cluster.node.actor.start_hosts`).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ClusterFull, ConnectionLost, InvalidSpec, InvalidState, SandboxError, SandboxLost, SandboxNotFound
from ..lifecycle import SandboxInfo
from ..spec import SandboxSpec, template_key
from ..tiers.base import ExecResult, FileEntry
from ..transport import CommandCall, CommandProcess, CreateOptions, OutputCallback, SandboxBackend, Transport
from .nodes import NAMESPACE, host_name, join, lost, ray_errors, slot_nodes
from .placement import DEFAULT_K, rank, sample
from .process import ClusterProcess

if TYPE_CHECKING:
    from ..commands import CommandInfo
    from ..egress.audit import AuditEvent
    from ..execution import Execution
    from ..ports import ExposedPort

#: how long a create waits for a free slot anywhere unless the caller says (``slot_timeout=``)
DEFAULT_SLOT_TIMEOUT = 30.0
#: one wait on a node for a slot before the whole cluster is asked again
WAIT_ROUND = 1.0
#: the node list is asked of the GCS again after this long
NODES_TTL = 2.0
#: a host actor that cannot be reached for this long counts as lost with its node
UNREACHABLE_IS_LOST = 8.0
#: how long a sandbox's state (alive, paused) is waited for: a host that does not answer by then
#: (stopped, swapping, cut off) makes the question raise ConnectionLost, not hang its caller
STATE_TIMEOUT = 3.0


def actor_key(actor: Any) -> str:
    """The identity of one host actor instance (a host that replaces it on the same node has another)."""
    return str(actor._actor_id.hex())


class ClusterRegistry:
    """Sandbox id -> node id, for this process: filled by creates and by asking the hosts (each
    node's own registry, in SQLite on the node, is the record).  A host actor found lost stays
    lost, with the sandboxes it held; a host started after it on the same node (a sibling restarts
    a crashed one) is another actor, and is used."""

    def __init__(self) -> None:
        self._where: dict[str, str] = {}
        #: actor ids (:func:`actor_key`) of host actors that died
        self.lost_hosts: set[str] = set()
        self._lock = threading.Lock()

    def put(self, sandbox_id: str, node_id: str) -> None:
        with self._lock:
            self._where[sandbox_id] = node_id

    def get(self, sandbox_id: str) -> str | None:
        return self._where.get(sandbox_id)

    def drop(self, sandbox_id: str) -> None:
        with self._lock:
            self._where.pop(sandbox_id, None)

    def mark_lost(self, actor: Any) -> None:
        with self._lock:
            self.lost_hosts.add(actor_key(actor))

    def is_lost(self, actor: Any) -> bool:
        return actor_key(actor) in self.lost_hosts


class ClusterBackend(SandboxBackend):
    """One sandbox on a cluster node."""

    remote = True

    def __init__(self, transport: ClusterTransport, sandbox_id: str, spec: SandboxSpec, node_id: str,
                 actor: Any, metadata: dict[str, str]) -> None:
        self.id = sandbox_id
        self.spec = spec
        self.node_id = self._node = node_id
        self._transport = transport
        self._actor = actor
        self._metadata = metadata
        self._closed = False

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """``method`` of the node's host actor, for this sandbox; typed errors, SandboxLost on node
        loss, ConnectionLost when ``timeout`` s pass without an answer."""
        registry = self._transport.registry
        if registry.is_lost(self._actor):
            raise lost(self.id, self._node, "its host was lost earlier")
        ray = self._transport.ray
        try:
            with ray_errors(self.id, self._node):
                try:
                    return ray.get(getattr(self._actor, method).remote(self.id, *args), timeout=timeout)
                except ray.exceptions.ActorUnavailableError:
                    if not self._reachable_again():
                        raise
                    raise ConnectionLost(f"node {self._node[:12]} did not answer for a moment: the call may or "
                                         "may not have run", sandbox_id=self.id) from None
        except SandboxLost:
            registry.mark_lost(self._actor)
            raise

    def _reachable_again(self) -> bool:
        """After an unanswered call: True once the host answers again; False when Ray says it died,
        or it stays unreachable for UNREACHABLE_IS_LOST seconds (then the node counts as lost)."""
        ray = self._transport.ray
        deadline = time.monotonic() + UNREACHABLE_IS_LOST
        while time.monotonic() < deadline:
            try:
                ray.get(self._actor.state.remote(self.id), timeout=1.0)
                return True
            except ray.exceptions.ActorDiedError:
                return False
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                time.sleep(0.2)
        return False

    # -- commands ---------------------------------------------------------------
    def start(self, call: CommandCall, on_output: OutputCallback | None) -> ClusterProcess:
        handle, pid = self.call("start", call, None, False)
        return ClusterProcess(self, handle, pid, on_output)

    def run(self, call: CommandCall, stdin: bytes | None, on_output: OutputCallback | None,
            started: Callable[[CommandProcess], None] | None = None) -> ExecResult:
        if on_output is None and started is None:
            result: ExecResult = self.call("run", call, stdin)  # one round trip
            return result
        handle, pid = self.call("start", call, stdin, False)
        process = ClusterProcess(self, handle, pid, on_output)
        if started is not None:
            started(process)
        process.close_stdin()
        return process.wait()

    def start_background(self, call: CommandCall, stdin: bytes | None,
                         on_output: OutputCallback | None) -> ClusterProcess:
        handle, pid = self.call("start", call, stdin, True)
        return ClusterProcess(self, handle, pid, on_output)

    def commands(self) -> list[CommandInfo]:
        found: list[CommandInfo] = self.call("commands")
        return found

    def command(self, pid: int) -> ClusterProcess:
        return ClusterProcess(self, self.call("attach", pid), pid, None)

    def kill_command(self, pid: int) -> bool:
        return bool(self.call("kill_command", pid))

    # -- files --------------------------------------------------------------------
    def read_file(self, path: str, max_bytes: int) -> bytes:
        return bytes(self.call("read_file", path, max_bytes))

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        self.call("write_file", path, data, mode)

    def list_dir(self, path: str) -> list[FileEntry]:
        entries: list[FileEntry] = self.call("list_dir", path)
        return entries

    def stat(self, path: str) -> FileEntry:
        entry: FileEntry = self.call("stat", path)
        return entry

    def remove(self, path: str, recursive: bool) -> None:
        self.call("remove", path, recursive)

    def make_dir(self, path: str, mode: int) -> None:
        self.call("make_dir", path, mode)

    # -- the sandbox --------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def info(self) -> SandboxInfo:
        info: SandboxInfo = self.call("info")
        return info

    def set_timeout(self, seconds: float) -> None:
        self.call("set_timeout", seconds)

    def _state(self) -> tuple[bool, bool]:
        if self._closed:
            return False, False
        try:
            # bounded: the server's reaper asks this of every sandbox, and a stopped node must not
            # hold it (nor anyone else); ConnectionLost when the host does not answer in time
            alive, paused = self.call("state", timeout=STATE_TIMEOUT)
        except SandboxLost:
            return False, False
        return bool(alive), bool(paused)

    def alive(self) -> bool:
        return self._state()[0]

    @property
    def paused(self) -> bool:
        return self._state()[1]

    def pause(self, to_disk: bool = False) -> None:
        if to_disk:  # its state would be on the node's disk, which a restart of this process cannot find
            raise InvalidState(f"sandbox {self.id}: a cluster's sandboxes cannot pause to disk", sandbox_id=self.id)
        self.call("pause")

    def resume(self) -> None:
        self.call("resume")

    def run_code(self, sandbox: Any, code: str, *, language: str | None, context: str | None,
                 timeout: float | None, envs: dict[str, str] | None, callbacks: dict[str, Any]) -> Execution:
        execution: Execution = self.call("run_code", code, language, context, timeout, envs)
        replay: list[tuple[str, Any]] = [("on_stdout", line) for line in execution.logs.stdout]
        replay += [("on_stderr", line) for line in execution.logs.stderr]
        replay += [("on_result", result) for result in execution.results]
        if execution.error is not None:
            replay.append(("on_error", execution.error))
        for name, value in replay:  # after the cell: the node cannot call back into this process
            callback: Callable[[Any], Any] | None = callbacks.get(name)
            if callback is not None:
                callback(value)
        return execution

    def create_code_context(self, language: str, cwd: str | None) -> str:
        return str(self.call("create_code_context", language, cwd))

    def code_contexts(self) -> list[tuple[str, str, str | None]]:
        contexts: list[tuple[str, str, str | None]] = self.call("code_contexts")
        return contexts

    def remove_code_context(self, name: str) -> None:
        self.call("remove_code_context", name)

    def audit(self) -> list[AuditEvent]:
        events: list[AuditEvent] = self.call("audit")
        return events

    def expose_port(self, port: int, unix: bool, other_users: Sequence[int] = ()) -> tuple[ExposedPort, Callable[[], None]]:
        raise InvalidState(f"sandbox {self.id}: ports of a cluster sandbox open on its node, not here; "
                           "front the cluster with `corral serve --cluster` to reach them", sandbox_id=self.id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._transport.registry.drop(self.id)
        try:
            self.call("destroy")
        except (SandboxLost, SandboxNotFound):
            pass  # gone with its node (the node's janitor reaps it), or already destroyed


class ClusterTransport(Transport):
    """Sandboxes on the nodes of a Ray cluster that offer ``corral_slots``.

    ``Sandbox.create(cluster=...)`` uses one transport per address for the whole process
    (:meth:`shared`): one cluster registry, one cache of host actors, one exit hook."""

    remote = True
    places = True
    _shared: dict[str, ClusterTransport] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, address: str | bool = True) -> ClusterTransport:
        with cls._shared_lock:
            transport = cls._shared.get(str(address))
            if transport is None:
                transport = cls._shared[str(address)] = cls(address)
            return transport

    def __init__(self, address: str | bool = True, *, slot_timeout: float = DEFAULT_SLOT_TIMEOUT,
                 k: int = DEFAULT_K) -> None:
        self.ray = join(address)
        self.slot_timeout = slot_timeout
        self.k = k
        self.registry = ClusterRegistry()
        self._hosts: dict[str, Any] = {}
        self._hosts_at = 0.0
        self._lock = threading.Lock()
        self._mine: weakref.WeakSet[ClusterBackend] = weakref.WeakSet()
        atexit.register(_destroy_at_exit, weakref.ref(self))

    # -- nodes ------------------------------------------------------------------
    def hosts(self, fresh: bool = False) -> dict[str, Any]:
        """node id -> host actor, for every live node with slots whose host actor is up (a host
        found lost is looked up again by name: the host a sibling started in its place is used)."""
        registry = self.registry
        with self._lock:
            if fresh or time.monotonic() - self._hosts_at > NODES_TTL:
                found = {}
                for node in slot_nodes(self.ray):
                    actor = self._hosts.get(node.node_id)
                    if actor is None or registry.is_lost(actor):
                        try:
                            actor = self.ray.get_actor(host_name(node.node_id), namespace=NAMESPACE)
                        except ValueError:
                            continue  # no host on it (yet): `corral cluster up`, or a sibling restarts it
                        if registry.is_lost(actor):
                            continue  # the dead one, still under its name
                    found[node.node_id] = actor
                self._hosts, self._hosts_at = found, time.monotonic()
            return {node_id: actor for node_id, actor in self._hosts.items() if not registry.is_lost(actor)}

    def _loads(self, hosts: dict[str, Any], node_ids: list[str], key: str) -> list[dict[str, Any]]:
        refs = {node_id: hosts[node_id].load.remote(key) for node_id in node_ids}
        loads = []
        for node_id, ref in refs.items():
            try:
                with ray_errors(None, node_id):
                    loads.append(self.ray.get(ref, timeout=UNREACHABLE_IS_LOST))
            except SandboxLost:
                self.registry.mark_lost(hosts[node_id])
            except SandboxError:
                continue  # unreachable this time: not placed on now
        return loads

    # -- create ---------------------------------------------------------------------
    def create(self, options: CreateOptions) -> ClusterBackend:
        if options.snapshot is not None:
            raise InvalidSpec("snapshot: snapshots live in one host's state directory, not on a cluster's nodes")
        if options.spec.workspace is not None:
            raise InvalidSpec("workspace: a directory of this machine cannot be mounted on a cluster node; "
                              "upload files with sb.files instead")
        if options.spec.secrets:
            # a brokered secret's value comes from the creating process's environment: on a node that
            # would be the node's own, handed to whichever host the caller names
            raise InvalidSpec("secrets: brokered secrets are not available on a cluster (their values would "
                              "come from the node's environment)")
        if options.spec.unsafe_allow_ranges:
            raise InvalidSpec("unsafe_allow_ranges: private and local ranges cannot be opened on a cluster "
                              "(they are the nodes' own networks)")
        wait_for = options.slot_timeout if options.slot_timeout is not None else self.slot_timeout
        deadline = time.monotonic() + wait_for
        key = template_key(options.spec)
        while True:
            hosts = self.hosts()
            if not hosts:
                hosts = self.hosts(fresh=True)
            first, rest = sample(list(hosts), self.k)
            loads = self._loads(hosts, first, key)
            if not any(load["free"] > 0 for load in loads) and rest:
                loads += self._loads(hosts, rest, key)
            for load in rank(loads, options.spec.limits.memory):
                backend = self._create_on(hosts, load["node_id"], options, 0.0)
                if backend is not None:
                    return backend
            left = deadline - time.monotonic()
            if left <= 0 and not hosts:
                raise ClusterFull("no node of the cluster offers corral_slots with a Corral host on it: start "
                                  "nodes with --resources '{\"corral_slots\": N}' and run `corral cluster up`")
            if left <= 0:
                raise ClusterFull(f"no free slot on any of {len(hosts)} node(s) for {wait_for:g} s "
                                  f"(slot_timeout); every node's corral_slots are taken")
            if not hosts:
                time.sleep(min(left, WAIT_ROUND))
                continue
            # wait on one node for a slot to free, then ask the whole cluster again
            node_id = min(loads, key=lambda load: load["used"] - load["slots"])["node_id"] if loads else first[0]
            backend = self._create_on(hosts, node_id, options, min(left, WAIT_ROUND))
            if backend is not None:
                return backend

    def _create_on(self, hosts: dict[str, Any], node_id: str, options: CreateOptions,
                   wait: float) -> ClusterBackend | None:
        try:
            with ray_errors(None, node_id):
                sandbox_id, _ = self.ray.get(hosts[node_id].create.remote(options, wait))
        except ClusterFull:
            return None
        except SandboxLost:
            self.registry.mark_lost(hosts[node_id])
            return None
        backend = ClusterBackend(self, sandbox_id, options.spec, node_id, hosts[node_id], dict(options.metadata))
        self.registry.put(sandbox_id, node_id)
        self._mine.add(backend)
        return backend

    # -- by id ----------------------------------------------------------------------
    def _locate(self, sandbox_id: str) -> tuple[str, Any]:
        hosts = self.hosts()
        node_id = self.registry.get(sandbox_id)
        if node_id is not None:
            if node_id not in hosts:
                raise lost(sandbox_id, node_id, "its node is gone")
            return node_id, hosts[node_id]
        refs = {node_id: actor.owns.remote(sandbox_id) for node_id, actor in hosts.items()}
        for node_id, ref in refs.items():
            try:
                with ray_errors(sandbox_id, node_id):
                    if self.ray.get(ref, timeout=UNREACHABLE_IS_LOST):
                        self.registry.put(sandbox_id, node_id)
                        return node_id, hosts[node_id]
            except SandboxError:
                continue
        raise SandboxNotFound(f"no live sandbox {sandbox_id} on any node of the cluster", sandbox_id=sandbox_id)

    def connect(self, sandbox_id: str) -> ClusterBackend:
        node_id, actor = self._locate(sandbox_id)
        with ray_errors(sandbox_id, node_id):
            info: SandboxInfo = self.ray.get(actor.info.remote(sandbox_id))
            spec: SandboxSpec = self.ray.get(actor.spec_of.remote(sandbox_id))
        return ClusterBackend(self, sandbox_id, spec, node_id, actor, dict(info.metadata))

    def list(self, metadata: dict[str, str] | None) -> list[SandboxInfo]:
        infos: list[SandboxInfo] = []
        refs = {node_id: actor.sandboxes.remote(metadata) for node_id, actor in self.hosts().items()}
        for node_id, ref in refs.items():
            try:
                with ray_errors(None, node_id):
                    infos += self.ray.get(ref, timeout=UNREACHABLE_IS_LOST)
            except SandboxError:
                continue  # a lost node has no sandboxes left to list
        return infos

    def kill(self, sandbox_id: str) -> bool:
        try:
            node_id, actor = self._locate(sandbox_id)
        except (SandboxNotFound, SandboxLost):
            return False
        self.registry.drop(sandbox_id)
        with ray_errors(sandbox_id, node_id):
            return bool(self.ray.get(actor.destroy.remote(sandbox_id)))

    def destroy_mine(self) -> None:
        """Destroy the sandboxes this transport made that are still open (at interpreter exit, as
        this process's embedded sandboxes die with it)."""
        if not self.ray.is_initialized():
            return  # Ray was shut down first: a call now would start a Ray of its own
        for backend in list(self._mine):
            try:
                backend.close()
            except Exception:
                pass


def _destroy_at_exit(ref: weakref.ref[ClusterTransport]) -> None:
    transport = ref()
    if transport is not None:
        transport.destroy_mine()
