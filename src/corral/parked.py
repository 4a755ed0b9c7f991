"""Sandboxes paused to disk (``sb.pause(to_disk=True)``): their records.

A sandbox paused to disk holds nothing live: its whole state is a live snapshot in the store
(:mod:`corral.snapshots`, marked ``parked_by`` the sandbox: not listed, not removable on its own,
counted against its tenant's snapshot quota), and this record says how to bring it back under
the same id -- its spec, labels, lifetime and, through a server, its tenant and deadlines.  It
outlives the process that paused it: another process (a restarted server) finds it with
``Sandbox.connect(id)`` and ``resume()`` restores it; ``kill()`` removes the record and the snapshot.
Its lifetime (an embedded ``lifetime``, a server's deadline) runs on while it is parked: once it is
over, ``gc`` ends it (:func:`corral.snapshots.reap_expired_parked`) as it ends a live sandbox whose owner missed its lifetime.

Stored as ``<state>/parked/<sandbox id>.json`` (0600, written whole by a rename).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DIRECTORY = "parked"
_ID = re.compile(r"sb-[0-9a-f]{16}\Z")


@dataclass(frozen=True)
class Parked:
    """A sandbox paused to disk."""

    sandbox_id: str
    snapshot_id: str
    #: the sandbox's spec (``SandboxSpec.to_dict``)
    spec: dict[str, Any]
    metadata: dict[str, str]
    started_at: float
    end_at: float | None = None
    #: through a server: tenant, created, expires_at, idle_timeout (server/manager.py)
    server: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Parked:
        return cls(str(data["sandbox_id"]), str(data["snapshot_id"]), dict(data["spec"]), dict(data["metadata"]),
                   float(data["started_at"]), data.get("end_at"), dict(data.get("server") or {}))


def _path(root: Path, sandbox_id: str) -> Path | None:
    return root / DIRECTORY / f"{sandbox_id}.json" if _ID.match(sandbox_id) else None


def save(root: Path, record: Parked) -> None:
    directory = root / DIRECTORY
    directory.mkdir(mode=0o700, exist_ok=True)
    temp = directory / f".{record.sandbox_id}-{secrets.token_hex(4)}"
    with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "w") as f:
        json.dump(asdict(record), f)
    os.rename(temp, directory / f"{record.sandbox_id}.json")


def load(root: Path, sandbox_id: str) -> Parked | None:
    path = _path(root, sandbox_id)
    if path is None:
        return None
    try:
        return Parked.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove(root: Path, sandbox_id: str) -> None:
    path = _path(root, sandbox_id)
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def claimed(root: Path, sandbox_id: str) -> Iterator[Parked | None]:
    """The record, held against a concurrent resume by another process (None: there is none any
    more -- resumed or killed elsewhere); raises ``BlockingIOError`` while another holds it."""
    path = _path(root, sandbox_id)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if path is not None else -1
    except FileNotFoundError:
        fd = -1
    if fd < 0:
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield load(root, sandbox_id)
    finally:
        os.close(fd)


def every(root: Path) -> list[Parked]:
    directory = root / DIRECTORY
    if not directory.is_dir():
        return []
    found = []
    for entry in sorted(directory.glob("sb-*.json")):
        record = load(root, entry.stem)
        if record is not None:
            found.append(record)
    return found


def end_at(record: Parked) -> float | None:
    """When the sandbox's lifetime ends: its embedded lifetime, or its server's deadline (the
    sooner of the two); None if it has neither."""
    ends = [float(t) for t in (record.end_at, record.server.get("expires_at"))
            if isinstance(t, (int, float)) and not isinstance(t, bool)]
    return min(ends) if ends else None


def over(record: Parked, now: float, grace: float = 0.0) -> bool:
    """Whether its lifetime ended more than ``grace`` seconds before ``now``."""
    end = end_at(record)
    return end is not None and now > end + grace


def set_deadline(root: Path, sandbox_id: str, expires_at: float) -> None:
    """A server extended the sandbox's lifetime while it is paused to disk: its record says so
    (``gc`` ends it by the record).  Nothing if it is being resumed meanwhile (the record goes)."""
    try:
        with claimed(root, sandbox_id) as record:
            if record is not None and record.server:
                save(root, dataclasses.replace(record, server={**record.server, "expires_at": expires_at}))
    except BlockingIOError:
        pass
