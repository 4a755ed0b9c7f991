"""What a destroyed sandbox may not leave behind, checked against the real host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def sandbox_leftovers(sandbox_id: str, state_dir: Path) -> list[str]:
    """Everything of ``sandbox_id`` still on the host: run dir, cgroups, mounts, processes, registry row."""
    from corral.host import cgroups, mounts
    from corral.registry import Registry

    found: list[str] = []
    run_dir = state_dir / "sandboxes" / sandbox_id
    if run_dir.exists():
        found.append(f"run dir {run_dir}")
    # its own groups, and those of its helpers beside it (a snapshot's converter: ``<id>-snapshot``)
    found += [f"cgroup {name}" for name in sorted(cgroups.list_sandbox_groups())
              if name == sandbox_id or name.startswith(f"{sandbox_id}-")]
    found += [f"mount {m}" for m in mounts.mounted_anywhere(run_dir)]  # its own namespace too
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if sandbox_id in Path(f"/proc/{pid}/cgroup").read_text() and not _zombie(pid):
                found.append(f"process {pid}")
        except OSError:
            continue
    if any(row.id == sandbox_id for row in Registry.at(state_dir).rows()):
        found.append("registry row")
    found += [f"uid range {base}" for base in ranges_of(sandbox_id, state_dir)]
    return found


def assert_gone_soon(sandbox_id: str, state_dir: Path, seconds: float = 5) -> None:
    """Assert that nothing of ``sandbox_id`` is left on the host within ``seconds`` (processes a
    janitor killed take a moment to go)."""
    deadline = time.monotonic() + seconds
    while sandbox_leftovers(sandbox_id, state_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_leftovers(sandbox_id, state_dir) == []


def sandbox_disk(sandbox_id: str, run_dir: Path) -> Path:
    """The sandbox's disk tmpfs as the host reaches it: at ``run_dir/disk`` where it was mounted in
    the host's namespace (gVisor), else through a process of the sandbox's own mount namespace
    (the process tier's bwrap: ``/proc/PID/root``)."""
    disk = run_dir / "disk"
    if os.path.ismount(disk):
        return disk
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if sandbox_id not in Path(f"/proc/{pid}/cgroup").read_text():
                continue
            seen = Path(f"/proc/{pid}/root") / disk.relative_to("/")
            if seen.is_dir() and os.path.ismount(seen):
                return seen
        except OSError:
            continue
    return disk


def ranges_of(owner: str, state_dir: Path) -> list[int]:
    """Bases of the host uid ranges still reserved for ``owner`` (its records in the state dir)."""
    records = state_dir / "uids"
    found = []
    if records.is_dir():
        for record in records.iterdir():
            if _owner(record) == owner:
                found.append(int(record.name))
    return found


def processes_naming(text: str) -> list[int]:
    """Host pids whose command line mentions ``text`` (runsc's carry the sandbox id)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(pid))
    return found


def start_owner(body: str, sleep: int = 300) -> tuple[subprocess.Popen[str], list[str]]:
    """A process that owns sandboxes as an application does, for a test to kill -9: it runs
    ``body`` (Python, with ``Sandbox`` imported, that makes them and prints their ids on one line,
    flushed), then sleeps ``sleep`` s.  Returns it and the ids it printed."""
    owner = subprocess.Popen(
        [sys.executable, "-c", f"import time\nfrom corral import Sandbox\n{body}\ntime.sleep({sleep})\n"],
        stdout=subprocess.PIPE, text=True, env=os.environ.copy(),
    )
    assert owner.stdout is not None
    try:
        return owner, owner.stdout.readline().split()
    except BaseException:
        kill_9(owner)
        raise


def kill_9(owner: subprocess.Popen[str]) -> None:
    """SIGKILL ``owner`` and reap it: none of its cleanup code runs."""
    owner.send_signal(signal.SIGKILL)
    owner.wait()


def run_gc(sandbox_id: str, timeout: float = 120) -> str:
    """Run ``corral gc`` as an operator would after a crash; it must succeed and name ``sandbox_id``."""
    corral = Path(sys.executable).with_name("corral")
    result = subprocess.run([str(corral), "gc"], capture_output=True, text=True, env=os.environ.copy(),
                            timeout=timeout)
    assert result.returncode == 0, result.stderr
    assert sandbox_id in result.stdout, result.stdout
    return result.stdout


def all_leftovers(state_dir: Path) -> list[str]:
    """Every sandbox resource under this test run's state dir and cgroup parent."""
    from corral.host import cgroups, mounts

    found = [f"cgroup {name}" for name in sorted(cgroups.list_sandbox_groups())]
    sandboxes = state_dir / "sandboxes"
    if sandboxes.is_dir():
        found += [f"run dir {p}" for p in sandboxes.iterdir()]
    found += [f"mount {m}" for m in mounts.mounted_anywhere(sandboxes)]
    uids = state_dir / "uids"
    if uids.is_dir():
        # a wasm tier's standby guests hold uids for sandboxes not created yet: the tier's, not a
        # sandbox's (process names, wasm-spare@PID.START; an older Corral's wasm-spare:PID)
        found += [f"uid {p.name}" for p in uids.iterdir() if not _owner(p).startswith(("wasm-spare@", "wasm-spare:"))]
    return found


def _owner(uid_file: Path) -> str:
    try:
        return uid_file.read_text()
    except FileNotFoundError:  # released while we looked
        return "wasm-spare:"


def _zombie(pid: str) -> bool:
    # A zombie holds no memory, files or mounts, only a pid until its parent
    # reaps it; after an owner's kill -9 that parent is host init, whose timing
    # is not ours (on this VM pid 1 is not a reaping init at all).
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def remove_cgroup_parent(name: str) -> None:
    """Remove, in every hierarchy, a cgroup parent a test had sandboxes made under (or a janitor
    run with it made): empty by then."""
    from corral.host import cgroups

    layout = cgroups.detect()
    for root in {*layout.controllers.values(), layout.kill_root}:
        if (root / name).is_dir():
            (root / name).rmdir()
