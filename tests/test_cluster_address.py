"""Which Ray cluster ``cluster=True`` joins: real processes, no Ray.

Ray's own "auto" takes a GCS address from any process named ``raylet`` and from its temporary
directory (mode 0777): a local user's fake raylet naming a relay of the real GCS got root's
driver joined through it, read the cluster's token from its first call, and ran code as root on
the node (helper 106).  Corral resolves "auto" itself, from root's raylets only.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from corral.cluster.nodes import local_cluster_address, root_raylets_gcs
from corral.errors import ConnectionLost, InvalidSpec

from .sandbox_wait import wait_until

FAKE_UID = 4242


@contextmanager
def raylet(gcs: str, uid: int | None = None) -> Iterator[int]:
    """A process whose command line is a raylet's naming ``gcs`` (as ``uid``, or root)."""
    argv = ["raylet", "-c", "import time; time.sleep(60)", f"--gcs-address={gcs}"]
    proc = subprocess.Popen(argv, executable="/usr/bin/python3", user=uid)  # (any user may run it)
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        assert wait_until(lambda: b"--gcs-address" in cmdline.read_bytes(), 10)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_auto_takes_root_raylets_only_and_never_a_local_users(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    others = root_raylets_gcs()  # (another test's cluster may run beside this one)
    with raylet("127.0.0.1:16906", uid=FAKE_UID):
        assert "127.0.0.1:16906" not in root_raylets_gcs()  # a user's "raylet": not a cluster
        if not others:
            with pytest.raises(ConnectionLost, match="no Ray cluster of root's"):
                local_cluster_address()
    with raylet("127.0.0.1:16907"):
        assert "127.0.0.1:16907" in root_raylets_gcs()  # root's: the one it names
        if not others:
            assert local_cluster_address() == "127.0.0.1:16907"
        with raylet("127.0.0.1:16908"), pytest.raises(InvalidSpec, match="several clusters"):
            local_cluster_address()
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")  # the operator's word comes first
    assert local_cluster_address() == "10.0.0.5:6379"
