"""What another process can leave or hold in the owner of a sandbox (corral.owner_link).

A staging directory a killed owner left while binding its socket is reaped by gc.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from corral.host.procs import process_start_time
from corral.registry import gc

# -- the staging directory of a killed owner's socket ---------------------------------------
KILLED_WHILE_BINDING = """
import time
from corral.host import sockets
def link(*args, **kwargs):
    print("in-window", flush=True)
    time.sleep(60)
sockets.os.link = link
from corral import Sandbox
Sandbox.create()
"""


def test_a_staging_directory_of_a_dead_process_is_removed_by_gc_and_a_live_ones_kept(state_dir: Path) -> None:
    owners = state_dir / "owners"
    before = set(os.listdir(owners)) if owners.is_dir() else set()
    owner = subprocess.Popen([sys.executable, "-c", KILLED_WHILE_BINDING], stdout=subprocess.PIPE, text=True,
                             env=os.environ.copy())
    assert owner.stdout is not None
    assert owner.stdout.readline().strip() == "in-window"
    left = [p for p in owners.iterdir() if p.name.startswith(".bind-") and p.name not in before]
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert len(left) == 1 and (left[0] / "s").exists(), left
    pid = os.getpid()
    live = owners / f".bind-{pid}.{process_start_time(pid)}-live"  # being bound right now
    reused = owners / f".bind-{pid}.{(process_start_time(pid) or 0) + 1}-reused"  # a pid reused since
    old_form, new_unknown = owners / ".bind-k3xq9a_b", owners / ".bind-zz8d7w2c"
    for staging in (live, reused, old_form, new_unknown):
        staging.mkdir(mode=0o700)
        (staging / "s").touch()
    os.utime(old_form, (time.time() - 3600, time.time() - 3600))
    try:
        gc(state_dir)
        assert not left[0].exists() and not reused.exists() and not old_form.exists()
        assert live.exists() and new_unknown.exists()
    finally:
        for staging in (live, reused, old_form, new_unknown):
            (staging / "s").unlink(missing_ok=True)
            if staging.exists():
                staging.rmdir()


def test_bind_private_names_its_staging_directory_for_its_process(tmp_path: Path) -> None:
    from corral.host import sockets

    seen: list[str] = []
    real = sockets.os.link

    def link(src: str, dst: str) -> None:
        seen.extend(os.listdir(tmp_path))
        real(src, dst)

    sock = socket.socket(socket.AF_UNIX)
    try:
        sockets.os.link = link  # type: ignore[assignment]
        sockets.bind_private(sock, tmp_path / "x.sock")
    finally:
        sockets.os.link = real
        sock.close()
    pid = os.getpid()
    assert [name.rsplit("-", 1)[0] for name in seen] == [f".bind-{pid}.{process_start_time(pid)}"]
    assert os.listdir(tmp_path) == ["x.sock"]
