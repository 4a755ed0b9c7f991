"""The in-sandbox agent's binary (``src/corral/agent/*.c``): built by ``make install``
(or here, once, if a compiler exists) and installed where sandbox launchers can read it."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from ...errors import HostNotSupported

AGENT_SOURCE = Path(__file__).resolve().parents[2] / "agent" / "agent.c"
#: every file the agent is built from (the Makefile's list too): a newer one means a rebuild
AGENT_SOURCES = tuple(AGENT_SOURCE.with_name(name) for name in (
    "agent.c", "exec.c", "files.c", "guest_ops.c", "relay.c", "relay_mux.c", "users.c", "mountns.c",
    "command_groups.c", "owner_watch.c", "agent.h", "relay_mux.h"))


def agent_binary(state_dir: Path | None = None, exec_only: bool = False) -> Path:
    """The static agent binary, built by ``make install`` (or here, once, if a compiler exists).

    With ``state_dir``, a copy installed under ``state_dir/bin`` (root-owned,
    world-readable) is returned: launchers that run as unprivileged sandbox
    uids must be able to read it wherever the checkout lives (e.g. under a 0700
    home directory).  ``exec_only``: a copy of its own, mode 0711, that the sandbox runs but
    cannot read (what a sandbox can read it can watch with inotify, and the one binary every
    sandbox execs then tells it when others start; only the process tier's sandboxes see it on
    the host's inode).
    """
    binary = AGENT_SOURCE.with_name("corral-agent")
    if not binary.exists() or binary.stat().st_mtime < max(src.stat().st_mtime for src in AGENT_SOURCES):
        _build_agent(binary)
    if state_dir is None:
        return binary
    data = binary.read_bytes()
    installed = state_dir / "bin" / f"corral-agent-{hashlib.sha256(data).hexdigest()[:16]}{'-x' if exec_only else ''}"
    if not installed.exists():
        installed.parent.mkdir(mode=0o755, exist_ok=True)
        # one name per thread: concurrent first creates of one process each install their own copy
        tmp = installed.with_name(f".{installed.name}-{os.getpid()}-{threading.get_ident()}")
        tmp.write_bytes(data)
        os.chmod(tmp, 0o711 if exec_only else 0o755)
        os.replace(tmp, installed)
    return installed


def _build_agent(binary: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise HostNotSupported(f"{binary} is missing and no C compiler is installed; run `make install`")
    tmp = binary.with_name(f".corral-agent-{os.getpid()}")
    result = subprocess.run(
        [cc, "-O2", "-static", "-o", str(tmp), *(str(src) for src in AGENT_SOURCES if src.suffix == ".c")],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise HostNotSupported(f"cannot build the sandbox agent: {result.stderr.strip()[:500]}")
    os.replace(tmp, binary)
