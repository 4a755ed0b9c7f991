"""The transport of sandboxes owned by this process: tiers, the registry and the janitor.

``Sandbox.create()`` without a server uses :class:`LocalTransport`: it makes, finds,
forks and adopts sandboxes of a state directory; each is a
:class:`corral.local_backend.LocalBackend`.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

from . import owner_link, parked
from .errors import InvalidSpec, SandboxNotFound, host_errors
from .host import shared_tables
from .host.procs import raise_open_files_limit
from .lifecycle import (
    LIVE,
    SandboxInfo,
    check_lifetime,
    kill_embedded,
    list_embedded,
    owner_elsewhere,
)
from .local_backend import LocalBackend, new_sandbox_id, start_inner
from .owner_backend import OwnerBackend
from .parked import Parked
from .registry import Registry, gc, state_dir
from .snapshots import Snapshot, SnapshotStore, end_parked
from .spec import SandboxSpec
from .tiers import get_tier, tier_class
from .transport import CreateOptions, SandboxBackend, Transport

#: a process that goes on creating sweeps again at a create this long after its last sweep began:
#: a server or an agent's long-lived process swept only at its first create, and what a killed
#: owner left meanwhile (a fork's stopped parent VM, a snapshot's converter VM, 384 MiB each)
#: stayed until `corral gc` or some other process's first create
JANITOR_EVERY = 60.0
#: when each state directory's last sweep of this process began (monotonic)
_gc_began: dict[Path, float] = {}
_gc_running: set[Path] = set()
_gc_lock = threading.Lock()
log = logging.getLogger(__name__)


def _startup_gc(root: Path) -> None:
    """The janitor (:func:`.registry.gc`): in this process's first create of ``root``, before it;
    then, past :data:`JANITOR_EVERY`, beside a create, on a thread of its own (one at a time;
    a sweep never frees a live sandbox's resources, whoever made it, whenever)."""
    now = time.monotonic()
    with _gc_lock:
        began = _gc_began.get(root)
        if began is not None and (now - began < JANITOR_EVERY or root in _gc_running):
            return
        _gc_began[root] = now
        if began is not None:
            _gc_running.add(root)
    if began is not None:
        threading.Thread(target=_sweep_again, args=(root,), name="corral-janitor", daemon=True).start()
        return
    raise_open_files_limit()  # once per process: a few descriptors per live sandbox add up
    shared_tables.widen()  # no sandbox may empty a host-wide table for the others
    gc(root)


def _sweep_again(root: Path) -> None:
    try:
        gc(root)
    except Exception:  # the next sweep, or `corral gc`, tries again; the create goes on
        log.warning("the janitor's sweep of %s failed", root, exc_info=True)
    finally:
        with _gc_lock:
            _gc_running.discard(root)


def fork_live(root: Path, parent: LocalBackend, count: int) -> list[LocalBackend]:
    """``count`` sandboxes straight from ``parent``'s live state (a microVM: no snapshot stored;
    ``Tier.fork_live``), registered; all made or none, and nothing left of a failed one."""
    from .snapshots import fork_spec

    spec = fork_spec(parent.spec)
    registry = Registry.at(root)
    tier = get_tier(spec.tier, root)
    children = [(sandbox_id, root / "sandboxes" / sandbox_id) for sandbox_id in
                (new_sandbox_id() for _ in range(count))]
    with host_errors("fork the sandbox", parent.id):
        inner_parent = parent.tier_sandbox()
        try:
            for sandbox_id, run_dir in children:
                registry.add(sandbox_id, spec.tier, run_dir)
                run_dir.mkdir(mode=0o700)
            inners = tier.fork_live(inner_parent, spec, children)
        except BaseException:
            for sandbox_id, run_dir in children:
                tier.reap(sandbox_id, run_dir, {})
                registry.remove(sandbox_id)
            raise
    made = []
    for inner in inners:
        registry.set_record(inner.id, {**inner.reap_record(), "corral": {
            "metadata": {}, "image": spec.image, "end_at": None}})
        backend = LIVE[inner.id] = LocalBackend(spec, inner, root, registry, {})
        made.append(backend)
    owner_link.serve(root)
    return made


def adopt_parked(root: Path, record: Parked) -> LocalBackend:
    """This process's backend of a sandbox paused to disk (by it, or by a process gone since)."""
    backend = LIVE.get(record.sandbox_id)
    if backend is not None and backend.inner is None:
        backend.parked = record  # as it is now: another process may have resumed and paused it since
        return backend
    spec = SandboxSpec.from_dict(record.spec)
    backend = LocalBackend(spec, None, root, Registry.at(root), record.metadata, record)
    backend._started_at = record.started_at
    LIVE[backend.id] = backend
    owner_link.serve(root)
    if record.end_at is not None:
        backend._lifetime.set(max(1.0, record.end_at - time.time()))
    return backend


def _apart_from_corral(workspace: Path, state: Path) -> None:
    """Refuse a workspace that holds Corral's state or image directory, or lies in one: its rw
    write-back, as their owner (root), would let a sandbox change other sandboxes' run
    directories, records and images (a file planted in an image's rootfs runs in every sandbox
    made from it), and reading them shows every sandbox's state."""
    from .images.store import DEFAULT_IMAGE_DIR

    images = Path(os.environ.get("CORRAL_IMAGE_DIR") or DEFAULT_IMAGE_DIR)
    for tree in (state, images):
        tree = tree.resolve()
        if tree.is_relative_to(workspace) or workspace.is_relative_to(tree):
            raise InvalidSpec(f"workspace {workspace}: it holds or lies in Corral's own {tree} (its sandboxes' "
                              "state and images); give the project's own directory")


def _apart_from_other_corrals(workspace: Path) -> None:
    """Refuse a workspace that is, holds or lies in another instance's state or image directory
    (its CORRAL_STATE_DIR and CORRAL_IMAGE_DIR are not ours to know: known by their layout), for
    the reasons :func:`_apart_from_corral` gives."""
    found = _corral_tree_in(workspace) or next(
        (place for place in workspace.parents if _is_a_corral_tree(place)), None)
    if found is not None:
        raise InvalidSpec(f"workspace {workspace}: it holds or lies in {found}, Corral's own state or image "
                          "directory (another instance's sandboxes' state and images); give the project's own "
                          "directory")


#: how deep below a workspace, and through how many directories, another instance's tree is looked
#: for: its own entries only, as every create pays for the search (3 levels and 512 directories
#: cost a project's create 2-26 ms, /usr/share's 46); deeper is the operator's to see
CORRAL_TREE_DEPTH = 1
CORRAL_TREE_BUDGET = 64


def _is_a_corral_tree(path: Path) -> bool:
    from .images.store import is_an_image_dir
    from .registry import is_a_state_dir

    return is_a_state_dir(path) or is_an_image_dir(path)


def _corral_tree_in(workspace: Path) -> Path | None:
    """A state or image directory that is ``workspace`` or below it, CORRAL_TREE_DEPTH levels deep
    (beyond CORRAL_TREE_BUDGET directories, a large project's, the rest is not looked at)."""
    level, budget = [workspace], CORRAL_TREE_BUDGET
    for depth in range(CORRAL_TREE_DEPTH + 1):
        below: list[Path] = []
        for directory in level:
            if budget <= 0:
                return None
            budget -= 1
            if _is_a_corral_tree(directory):
                return directory
            if depth < CORRAL_TREE_DEPTH:
                try:
                    with os.scandir(directory) as entries:
                        for entry in entries:
                            if len(below) >= budget:
                                break
                            if entry.is_dir(follow_symlinks=False):
                                below.append(Path(entry.path))
                except OSError:
                    continue
        level = below
    return None


def _not_a_refused_tree_by_another_path(workspace: Path) -> None:
    """Refuse a workspace that is a refused tree under another path: where a mount shows it from
    (``mountinfo``: a bind of ``/etc/ssl`` at ``/srv/x`` is ``/etc/ssl``) is checked as the path
    itself is; and compared by device and inode, it or a parent is a system tree or a home's
    dot-directory, or it is a holder of others' trees or a home (a link, a mount of a file system
    mounted whole nowhere).  ``/`` bound at ``/srv/x`` made ``/srv/x/etc`` a workspace (the sandbox
    read ``/etc/shadow``), which a check of the path's text missed."""
    from .host.mounts import origin_of
    from .spec import HOLDERS, SYSTEM_TREES, login_homes, why_not_a_workspace

    origin = origin_of(workspace)
    why = why_not_a_workspace(origin) if origin is not None else None
    if why is not None:
        raise InvalidSpec(f"workspace {workspace}: it is {origin} by another path (a bind mount): {why}")

    def identity(path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_dev, st.st_ino

    homes = login_homes()
    within: dict[tuple[int, int], Path] = {}
    for tree in (*SYSTEM_TREES, *(entry for home in homes for entry in _dot_directories(home))):
        if (key := identity(tree)) is not None:
            within[key] = tree
    itself = {key: tree for tree in (*HOLDERS, *homes) if (key := identity(tree)) is not None}
    for place in (workspace, *workspace.parents):
        key = identity(place)
        found = within.get(key) if key is not None else None
        if found is None and place == workspace and key is not None:
            found = itself.get(key)
        if found is not None and found != place:
            raise InvalidSpec(f"workspace {workspace}: {place} is {found} by another path (a bind mount or link): "
                              f"{why_not_a_workspace(found) or 'not a project'}")


def _dot_directories(home: Path) -> list[Path]:
    try:
        return [entry for entry in home.iterdir() if entry.name.startswith(".")]
    except OSError:
        return []


class LocalTransport(Transport):
    """Sandboxes of this process, registered in a state directory (default: ``CORRAL_STATE_DIR``)."""

    def __init__(self, state: str | Path | None = None) -> None:
        self._state = state

    @property
    def root(self) -> Path:
        return state_dir(self._state)

    def create(self, options: CreateOptions) -> LocalBackend:
        if options.idle_timeout is not None:
            raise InvalidSpec("idle_timeout: only a server tracks use (Sandbox.create(url=...)); an embedded "
                              "sandbox lives until kill() or its lifetime")
        spec = options.spec
        tier_class(spec.tier).capabilities.check_user(spec.user, spec.tier)
        if spec.workspace is not None:
            _apart_from_corral(spec.workspace.path, self.root)
            _not_a_refused_tree_by_another_path(spec.workspace.path)
            _apart_from_other_corrals(spec.workspace.path)
        sandbox_id = new_sandbox_id()
        seed: tuple[Path, str] | None = None
        if options.snapshot is not None:
            if spec.workspace is not None:
                raise InvalidSpec("workspace: a sandbox made from a snapshot gets the snapshot's /workspace")
            snapshot, files, digest = SnapshotStore(self.root).files(options.snapshot)
            spec = dataclasses.replace(spec, tier=snapshot.tier, image=snapshot.image)
            seed = (files, digest)
        with host_errors("create the sandbox", sandbox_id):
            root = self.root
            _startup_gc(root)
            end_at = time.time() + options.lifetime if options.lifetime is not None else None
            inner, registry = start_inner(root, spec, sandbox_id, seed, options.metadata, end_at)
        backend = LocalBackend(spec, inner, root, registry, options.metadata)
        LIVE[backend.id] = backend
        owner_link.serve(root)
        if options.lifetime is not None:
            backend.set_timeout(check_lifetime(options.lifetime))
        return backend

    def connect(self, sandbox_id: str) -> SandboxBackend:
        backend = LIVE.get(sandbox_id)
        if backend is not None and backend.inner is not None:
            return backend
        owner = owner_elsewhere(self.root, sandbox_id)
        if owner is not None:
            return OwnerBackend(self.root, owner, sandbox_id)
        record = parked.load(self.root, sandbox_id)
        if record is not None and parked.over(record, time.time()):  # its lifetime ended while it was parked
            end_parked(self.root, sandbox_id)
            raise SandboxNotFound(f"sandbox {sandbox_id}: its lifetime ended while it was paused to disk",
                                  sandbox_id=sandbox_id)
        if record is not None:  # paused to disk, by this process or one gone since: ours now
            return adopt_parked(self.root, record)
        raise SandboxNotFound(f"no live sandbox {sandbox_id}", sandbox_id=sandbox_id)

    def list(self, metadata: dict[str, str] | None) -> list[SandboxInfo]:
        return list_embedded(self.root, metadata)

    def list_snapshots(self) -> builtins.list[Snapshot]:
        return SnapshotStore(self.root).list()

    def fork(self, backend: SandboxBackend, count: int) -> builtins.list[SandboxBackend]:
        # a few forks of a microVM straight from the running sandbox: no snapshot (Tier.direct_forks)
        if isinstance(backend, LocalBackend) and count <= tier_class(backend.spec.tier).direct_forks:
            return list(fork_live(self.root, backend, count))
        return super().fork(backend, count)

    def delete_snapshot(self, snapshot_id: str) -> bool:
        return SnapshotStore(self.root).delete(snapshot_id)

    def kill(self, sandbox_id: str) -> bool:
        record = parked.load(self.root, sandbox_id) if sandbox_id not in LIVE else None
        if record is not None:
            adopt_parked(self.root, record).close()
            return True
        owner = owner_elsewhere(self.root, sandbox_id) if sandbox_id not in LIVE else None
        if owner is not None:  # its owner destroys it, as if it had called kill() itself
            OwnerBackend(self.root, owner, sandbox_id).close()
            return True
        return kill_embedded(self.root, sandbox_id)
