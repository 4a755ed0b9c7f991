"""A process-tier sandbox mounts in a namespace of its own, never in the host's (issue 16).

bubblewrap copies the mount table it starts from into each new sandbox: were every
sandbox's mounts in the host's table, each create would cost more per live sandbox.
"""

from __future__ import annotations

import os
from pathlib import Path

from corral import Sandbox
from corral.host import mounts

from .leaks import kill_9, run_gc, sandbox_leftovers, start_owner


def _host_mounts_under(path: Path) -> list[Path]:
    return mounts.mounts_under(path)  # this process's namespace: the host's


def test_live_sandboxes_add_no_mount_to_the_hosts_namespace(state_dir: Path, tmp_path: Path) -> None:
    sandboxes = state_dir / "sandboxes"
    workspace = tmp_path / "dn-ws"
    workspace.mkdir()
    # the first with a host workspace: its overlay (ws_overlay) is mounted in its namespace too
    live = [Sandbox.create(workspace=str(workspace)), Sandbox.create(), Sandbox.create()]
    try:
        assert _host_mounts_under(sandboxes) == []
        for sb in live:
            run_dir = sandboxes / sb.id
            # its root and disk are mounted, in its own namespace (seen through its processes)
            points = set(mounts.mounted_anywhere(run_dir))
            assert {str(run_dir / "disk"), str(run_dir / "root")} <= points, points
            # and work: the overlay root takes writes, the workspace copy too
            result = sb.commands.run("echo hi > /tmp/f && cat /tmp/f && echo w > /workspace/w && cat /workspace/w")
            assert result.stdout == "hi\nw\n", result.stderr
        assert str(sandboxes / live[0].id / "disk" / "ws") in mounts.mounted_anywhere(sandboxes / live[0].id)
        assert (workspace / "w").read_text() == "w\n"  # written back from the overlay's upper layer
        # each sees only its own: no sandbox's namespace holds another's mounts
        first = sandboxes / live[0].id
        others = _pids_of(live[1].id)
        assert others
        for pid in others:
            assert str(first) not in Path(f"/proc/{pid}/mountinfo").read_text()
    finally:
        for sb in live:
            sb.kill()
    for sb in live:
        assert mounts.mounted_anywhere(sandboxes / sb.id) == []
        assert sandbox_leftovers(sb.id, state_dir) == []


def _pids_of(sandbox_id: str) -> list[int]:
    """The host pids of a sandbox's processes (bwrap in its mount namespace, the agent below)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if sandbox_id in Path(f"/proc/{pid}/cgroup").read_text():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_no_mount_survives_kill_9_of_the_owner_and_gc(state_dir: Path) -> None:
    owner, (sandbox_id,) = start_owner("a = Sandbox.create()\nprint(a.id, flush=True)")
    try:
        run_dir = state_dir / "sandboxes" / sandbox_id
        assert str(run_dir / "root") in mounts.mounted_anywhere(run_dir)
        assert _host_mounts_under(run_dir) == []
    finally:
        kill_9(owner)
    run_gc(sandbox_id)
    assert mounts.mounted_anywhere(run_dir) == []
    assert sandbox_leftovers(sandbox_id, state_dir) == []
