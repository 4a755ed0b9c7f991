"""A newcomer's tier: the least a fifth tier needs to join Corral, written outside ``src/``.

It registers itself with :func:`corral.tiers.register_tier`, touching no other
tier, and has a sandbox that keeps files in memory and cannot run anything:
every part of the contract it does not have raises ``NotImplementedError``, and
the conformance suite reports each test it cannot pass as "lacks <the contract
method>" (see ``conftest.py``; ``test_newcomer.py`` checks that report).
"""

from __future__ import annotations

import errno
import posixpath
import shutil
import time
from pathlib import Path
from typing import Any

from corral.errors import FileError, FileNotFoundInSandbox, SandboxClosed
from corral.spec import SandboxSpec
from corral.tiers import register_tier
from corral.tiers.base import (
    Availability,
    Capabilities,
    ExecRequest,
    FileEntry,
    OutputCallback,
    Process,
    Tier,
    TierSandbox,
)

NAME = "stub"


class StubTier(Tier):
    name = NAME
    capabilities = Capabilities(network_modes=("none",), pty=False, images=None, users="nobody: nothing runs")

    @classmethod
    def probe(cls, state_dir: Path) -> Availability:
        return Availability(cls.name, True, "a test stub: files in memory, no commands")

    def create(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path) -> TierSandbox:
        return StubSandbox(sandbox_id, run_dir)

    def reap(self, sandbox_id: str, run_dir: Path, record: dict[str, Any]) -> None:
        shutil.rmtree(run_dir, ignore_errors=True)


class StubSandbox(TierSandbox):
    def __init__(self, sandbox_id: str, run_dir: Path) -> None:
        self.id = sandbox_id
        self._run_dir = run_dir
        self._files: dict[str, bytes] = {}
        self._dirs = {"/", "/tmp", "/workspace"}
        self._closed = False

    def start(self, request: ExecRequest, on_output: OutputCallback | None = None) -> Process:
        raise NotImplementedError

    def _open(self, path: str) -> str:
        if self._closed:
            raise SandboxClosed(f"sandbox {self.id} is closed", sandbox_id=self.id)
        return posixpath.normpath(path)

    def read_file(self, path: str, max_bytes: int) -> bytes:
        path = self._open(path)
        if path not in self._files:
            raise FileNotFoundInSandbox(f"{path}: no such file", errno.ENOENT)
        return self._files[path][:max_bytes]

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        path = self._open(path)
        if posixpath.dirname(path) not in self._dirs:
            raise FileNotFoundInSandbox(f"{path}: no such directory", errno.ENOENT)
        self._files[path] = data

    def list_dir(self, path: str) -> list[FileEntry]:
        path = self._open(path)
        names = [p for p in (*self._files, *self._dirs) if p != path and posixpath.dirname(p) == path]
        return [self.stat(p) for p in sorted(names)]

    def stat(self, path: str) -> FileEntry:
        path = self._open(path)
        if path in self._dirs:
            return FileEntry(posixpath.basename(path), path, "dir", 0, 0o755, time.time())
        if path in self._files:
            return FileEntry(posixpath.basename(path), path, "file", len(self._files[path]), 0o644, time.time())
        raise FileNotFoundInSandbox(f"{path}: no such file", errno.ENOENT)

    def remove(self, path: str, recursive: bool = False) -> None:
        path = self._open(path)
        if self._files.pop(path, None) is None:
            raise FileError(f"{path}: only files can be removed here", errno.EPERM)

    def make_dir(self, path: str, mode: int = 0o755) -> None:
        self._dirs.add(self._open(path))

    def alive(self) -> bool:
        return not self._closed

    def close(self) -> None:
        self._closed = True
        shutil.rmtree(self._run_dir, ignore_errors=True)

    def reap_record(self) -> dict[str, Any]:
        return {}


register_tier(NAME, StubTier)
