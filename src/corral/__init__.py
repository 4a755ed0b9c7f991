"""Corral: isolated, ephemeral, resource-limited sandboxes for AI agents.

Imports are lazy so that ``corral run`` starts fast.
"""

from __future__ import annotations

# not `from typing import TYPE_CHECKING`: importing typing costs `corral run` several ms,
# and the fast path through the local daemon imports nothing else of Corral (mypy treats a
# name TYPE_CHECKING as true either way)
TYPE_CHECKING = False

__version__ = "0.1.0"

_EXPORTS = {
    "Sandbox": "corral.sandbox",
    "AsyncSandbox": "corral.async_sandbox",
    "run": "corral.sandbox",
    "SandboxSpec": "corral.spec",
    "Limits": "corral.spec",
    "Workspace": "corral.spec",
    "ExecResult": "corral.tiers.base",
    "FileEntry": "corral.tiers.base",
    "Snapshot": "corral.snapshots",
}
_ERRORS = (
    "SandboxError", "InvalidSpec", "HostNotSupported", "ClusterUnauthenticated", "SandboxNotFound", "SandboxClosed", "SandboxLost", "InvalidState",
    "SandboxPaused", "SnapshotNotFound", "SnapshotCorrupt", "ExecError",
    "ExecTimeout", "OutOfMemory", "ContainmentFailed", "ResourceLimit", "ClusterFull", "HostError", "FileError",
    "FileNotFoundInSandbox",
    "ImageBuildFailed", "TransportError", "ConnectionLost", "Unauthorized", "ServerError",
)

__all__ = [*_EXPORTS, *_ERRORS]

if TYPE_CHECKING:
    from typing import Any

    from .async_sandbox import AsyncSandbox as AsyncSandbox
    from .errors import *  # noqa: F403
    from .sandbox import Sandbox as Sandbox
    from .sandbox import run as run
    from .snapshots import Snapshot as Snapshot
    from .spec import Limits as Limits
    from .spec import SandboxSpec as SandboxSpec
    from .spec import Workspace as Workspace
    from .tiers.base import ExecResult as ExecResult
    from .tiers.base import FileEntry as FileEntry


def __getattr__(name: str) -> Any:
    import importlib

    if name in _ERRORS:
        return getattr(importlib.import_module("corral.errors"), name)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'corral' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
