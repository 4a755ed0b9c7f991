"""Sandboxes by id: metadata, listing, lifetimes, and killing or connecting by id (E2B's shape).

An embedded sandbox belongs to the process that created it (its agent channel,
threads and cgroups are that process's).  Another process lists it from the
registry; it connects to it and kills it through the owner while the owner
lives (:mod:`corral.owner_link`), and kills it by reaping (``gc``) once the owner
is dead.  A lifetime is enforced by a timer in the owner; if the owner dies
first, ``gc`` reaps the sandbox as always, and if the owner lives but cannot end it
(stopped, hung), ``gc`` ends it ``LIFETIME_GRACE`` (5 s) after its lifetime.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import parked
from .errors import InvalidSpec, InvalidState
from .registry import Registry, Row, gc

if TYPE_CHECKING:
    from .local_backend import LocalBackend

#: sandboxes of this process by id (connect/kill by id find them here)
LIVE: weakref.WeakValueDictionary[str, LocalBackend] = weakref.WeakValueDictionary()
MAX_METADATA_KEYS = 64
MAX_METADATA_TEXT = 1024


@dataclass(frozen=True)
class SandboxInfo:
    """What ``Sandbox.list()`` and ``sb.get_info()`` say about a sandbox."""

    sandbox_id: str
    tier: str
    image: str
    metadata: dict[str, str] = field(default_factory=dict)
    started_at: float = 0.0
    #: when its lifetime ends (None: no lifetime)
    end_at: float | None = None
    state: str = "running"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_metadata(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= 128 and len(v) <= MAX_METADATA_TEXT
            for k, v in metadata.items()):
        raise InvalidSpec(f"metadata: at most {MAX_METADATA_KEYS} string keys (1-128 characters) with string "
                          f"values of at most {MAX_METADATA_TEXT} characters")
    return dict(metadata)


def check_lifetime(seconds: Any, what: str = "lifetime") -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 30 * 86400:
        raise InvalidSpec(f"{what}: {seconds!r} must be seconds in (0, 2592000]")
    return float(seconds)


def matches(metadata: dict[str, str], wanted: dict[str, str] | None) -> bool:
    return all(metadata.get(k) == v for k, v in (wanted or {}).items())


class Lifetime:
    """The owner's timer that kills a sandbox when its lifetime ends."""

    def __init__(self, sandbox: LocalBackend) -> None:
        self._ref = weakref.ref(sandbox)
        self._timer: threading.Timer | None = None
        self.end_at: float | None = None

    def set(self, seconds: float) -> None:
        self.cancel()
        self.end_at = time.time() + seconds
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        sandbox = self._ref()
        if sandbox is not None:
            sandbox.close()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def info_of_row(row: Row) -> SandboxInfo:
    own = row.record.get("corral", {})
    return SandboxInfo(row.id, row.tier, str(own.get("image", "")), dict(own.get("metadata", {})), row.created,
                       own.get("end_at"))


def list_embedded(root: Path, metadata: dict[str, str] | None) -> list[SandboxInfo]:
    infos = [SandboxInfo(record.sandbox_id, str(record.spec.get("tier", "")), str(record.spec.get("image", "")),
                         dict(record.metadata), record.started_at, record.end_at, "paused")
             for record in parked.every(root) if matches(record.metadata, metadata)]
    for row in Registry.at(root).rows():
        if not row.owner_alive():
            continue
        info = info_of_row(row)
        sandbox = LIVE.get(row.id)
        if sandbox is not None and sandbox.paused:
            info = SandboxInfo(**{**info.to_dict(), "state": "paused"})
        if matches(info.metadata, metadata):
            infos.append(info)
    return infos


def row_of(root: Path, sandbox_id: str) -> Row | None:
    return next((row for row in Registry.at(root).rows() if row.id == sandbox_id), None)


def kill_embedded(root: Path, sandbox_id: str) -> bool:
    """Kill a sandbox by id: this process's own, or one whose owner died; False if there is none.
    (A live owner's sandbox is killed through the owner: ``LocalTransport.kill``.)"""
    sandbox = LIVE.get(sandbox_id)
    if sandbox is not None:
        sandbox.close()
        return True
    row = row_of(root, sandbox_id)
    if row is None:
        return False
    if row.owner_alive():
        raise InvalidState(f"sandbox {sandbox_id} belongs to live process {row.owner_pid}: an embedded sandbox is "
                           "killed by its owner (share sandboxes between processes through a server)",
                           sandbox_id=sandbox_id)
    return sandbox_id in gc(root)


def owner_elsewhere(root: Path, sandbox_id: str) -> int | None:
    """The pid of the live process (not this one) that owns ``sandbox_id``, if one does."""
    row = row_of(root, sandbox_id)
    if row is not None and row.owner_pid != os.getpid() and row.owner_alive():
        return row.owner_pid
    return None


class InstanceOrClass:
    """``sb.kill()`` on an instance, ``Sandbox.kill(sandbox_id)`` on the class: E2B has both."""

    def __init__(self, on_instance: Any, on_class: Any) -> None:
        self._on_instance = on_instance
        self._on_class = on_class

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self._on_class.__get__(None, owner) if hasattr(self._on_class, "__get__") else self._on_class
        return self._on_instance.__get__(instance, owner)
