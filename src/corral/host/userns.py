"""A sandbox's user namespace: its whole host uid range mapped to 0-65535 inside.

An unprivileged process can only map its own uid (one entry: bubblewrap's
``--uid``), so a range is mapped from outside by root: a helper (``corral-agent
--userns BASE``, a static binary the host can vfork) drops to the range's
base, makes the namespace (so the namespace belongs to that host uid, as
bubblewrap's own would: bwrap, dropped to the same uid, may join it with
``--userns FD``), and waits while this process writes its ``uid_map`` and
``gid_map`` and keeps a descriptor of it.  The helper then exits; the
descriptor keeps the namespace alive until the sandbox's processes (and its
idmapped image layers, :mod:`corral.host.idmap`) hold it.

The process tier has the same maker forked by the helper of the sandbox's mount
namespace instead (:class:`corral.host.mountns.HolderUserns`): one process started
from here per sandbox, not two.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Protocol

from ..errors import HostNotSupported
from .uids import UidRange


class UsernsMaking(Protocol):
    """A user namespace on its way: :meth:`finish` gives its descriptor, :meth:`close` ends its maker."""

    def finish(self, maps: tuple[str, str] | None = None) -> int: ...

    def close(self) -> None: ...


def map_and_open(pid: int, ids: UidRange, maps: tuple[str, str] | None = None) -> int:
    """Write the uid and gid maps of the user namespace of ``pid`` (its maker, which has made it
    and waits) mapping ``ids`` to ``0 .. ids.size - 1`` (or ``maps``: its ``uid_map`` and
    ``gid_map`` lines); a descriptor of it (O_CLOEXEC)."""
    line = f"0 {ids.base} {ids.size}\n"
    for name, text in zip(("uid_map", "gid_map"), maps or (line, line), strict=True):
        fd = os.open(f"/proc/{pid}/{name}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)


class PendingUserns:
    """A user namespace on its way (:func:`start_userns`): the helper was started; :meth:`finish`
    maps it.  Starting early lets the helper's start-up overlap the sandbox's other set-up."""

    def __init__(self, helper: Path, ids: UidRange) -> None:
        self.ids = ids
        self._proc = subprocess.Popen(
            [str(helper), "--userns", str(ids.base)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True, cwd="/",
            env={},
        )

    def finish(self, maps: tuple[str, str] | None = None) -> int:
        """A descriptor (O_CLOEXEC) of the new user namespace, owned by ``ids.base`` and mapping
        ``ids`` to ``0 .. ids.size - 1`` for uids and gids alike (or ``maps``: its ``uid_map``
        and ``gid_map`` lines, e.g. a workspace's owner to the sandbox user for an idmapped
        mount, :mod:`corral.host.ws_overlay`).  The caller closes it."""
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            if proc.stdout.read(1) != b"u":
                proc.stdin.close()
                err = proc.stderr.read().decode(errors="replace").strip()
                raise HostNotSupported(f"cannot make the sandbox's user namespace: {err or 'the helper failed'}")
            return map_and_open(proc.pid, self.ids, maps)
        finally:
            proc.stdin.close()  # the helper exits on end of file: reaped by close()
            proc.stdout.close()

    def close(self) -> None:
        """Reap the helper (it has exited, or exits now: its stdin is closed)."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        self._proc.wait()
        for pipe in (self._proc.stdout, self._proc.stderr):
            if pipe is not None:
                pipe.close()


def start_userns(helper: Path, ids: UidRange) -> PendingUserns:
    """Start making the user namespace of ``ids`` (``helper``: the agent binary, ``--userns``)."""
    return PendingUserns(helper, ids)


def make_userns(helper: Path, ids: UidRange) -> int:
    """:func:`start_userns` and :meth:`PendingUserns.finish` at once."""
    pending = start_userns(helper, ids)
    try:
        return pending.finish()
    finally:
        pending.close()
