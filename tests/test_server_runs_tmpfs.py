"""The server's run directories on a tmpfs of its own (``<state>/sandboxes``, see SandboxManager._mount_runs):
mounted at start, the sandboxes' run directories on it, gone at shutdown; never mounted over run
directories of other processes, which it would hide."""

from __future__ import annotations

from pathlib import Path

from corral.host import mounts
from corral.server.manager import RUNS_SOURCE

from .server_fixtures import ServerProcess


def _runs_tmpfs(state: Path) -> list[str]:
    return [rest for point, rest in mounts.mountinfo()
            if point == str(state / "sandboxes") and rest.startswith(f"tmpfs {RUNS_SOURCE} ")]


def _unmount_if_left(state: Path) -> None:
    """Test cleanup, also after a failure: the mount must not outlive the test."""
    if _runs_tmpfs(state):
        mounts.umount(state / "sandboxes", lazy=True)


def test_run_directories_live_on_the_servers_tmpfs_until_shutdown(state_dir: Path) -> None:
    state = state_dir / "cbst-runs"
    server = ServerProcess(state).start()
    try:
        assert len(_runs_tmpfs(state)) == 1
        with server.client() as http:
            sid = http.post("/v1/sandboxes", json={}).json()["id"]
            assert http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo ok"}).json()["stdout"] == "ok\n"
            assert (state / "sandboxes" / sid).is_dir()
            assert http.delete(f"/v1/sandboxes/{sid}").status_code == 204
        assert not (state / "sandboxes" / sid).exists()
        server.stop()
        assert _runs_tmpfs(state) == []
        assert list((state / "sandboxes").iterdir()) == []
    finally:
        server.stop()
        _unmount_if_left(state)


def test_no_tmpfs_over_run_directories_of_another_process(state_dir: Path) -> None:
    state = state_dir / "cbst-runs-busy"
    other = state / "sandboxes" / "sb-cbst0000000000"  # a live run directory of another process: no row, new
    other.mkdir(parents=True)
    server = ServerProcess(state).start()
    try:
        assert _runs_tmpfs(state) == []  # a mount would hide it from its owner
        assert other.is_dir()
        with server.client() as http:
            sid = http.post("/v1/sandboxes", json={}).json()["id"]
            assert (state / "sandboxes" / sid).is_dir()  # on the state directory's own filesystem
            assert http.delete(f"/v1/sandboxes/{sid}").status_code == 204
    finally:
        server.stop()
        _unmount_if_left(state)
        other.rmdir()
