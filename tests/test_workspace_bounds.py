"""What a workspace's write-back writes to the host is bounded by the sandbox's disk limit.

A sandbox with a 64 MiB disk could write gigabytes into the user's directory: a sparse file
(``truncate -s 4G``) costs it nothing on its tmpfs, and each hard link to a file was copied
as a file of its own.  Write-back now copies data extents only and keeps the names of one
file as names of one host file, on every tier that writes a workspace back (the process
tier's overlay and its copy, gVisor, the microVM).

Cost: 4 sandboxes, ~5 s (the microVM's ~2 s of it when its tier is available).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral.host import ws_overlay

from .tier_probe import skip_unless_tier

DISK = 64 << 20
GIB = 1 << 30

#: a 4 GiB sparse file with 4 bytes at each end of its data, and 24 MB of data under two names
FIRST = ("truncate -s 4G sparse && printf head | dd of=sparse conv=notrunc status=none"
         " && printf tail | dd of=sparse bs=1M seek=3072 conv=notrunc status=none"
         " && head -c 24000000 /dev/urandom > data && ln data data2")
#: more names for it, in a later write-back, one in a new directory
SECOND = "ln data data3 && mkdir d && ln data2 d/data4"
#: a change to the file under one name is the file's under every name
THIRD = "echo more >> data3 && sha256sum data | cut -c1-64"


@pytest.fixture(params=["process", "process-copy", "gvisor", "microvm"])
def tier(request: pytest.FixtureRequest, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param in ("gvisor", "microvm"):
        skip_unless_tier(request.param, state_dir)
    if request.param == "process-copy":  # the copy used where a workspace cannot be idmapped
        monkeypatch.setattr(ws_overlay, "ENABLED", False)
    yield request.param.split("-")[0]


def allocated(root: Path) -> int:
    """Bytes the host's file system holds for the files below ``root``, each file once."""
    seen: dict[int, int] = {}
    for path in root.rglob("*"):
        st = path.lstat()
        seen[st.st_ino] = st.st_blocks * 512
    return sum(seen.values())


def test_workspace_write_back_is_bounded_by_the_sandboxs_disk(tier: str, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    with Sandbox.create(tier=tier, workspace=str(ws), disk="64M", memory="256M") as sb:
        for step in (FIRST, SECOND):
            r = sb.commands.run(step, cwd="/workspace", timeout=60)
            assert r.exit_code == 0, r.stderr
        r = sb.commands.run(THIRD, cwd="/workspace", timeout=60)
        assert r.exit_code == 0, r.stderr
        inside = r.stdout.strip()
    assert allocated(ws) <= DISK, f"the host holds {allocated(ws)} bytes of a {DISK}-byte sandbox's files"
    sparse = ws / "sparse"
    assert sparse.stat().st_size == 4 * GIB
    with sparse.open("rb") as f:
        assert f.read(4) == b"head"
        f.seek(3 * GIB)
        assert f.read(4) == b"tail"
        f.seek(GIB)
        assert f.read(4096) == bytes(4096)
    names = [ws / "data", ws / "data2", ws / "data3", ws / "d" / "data4"]
    assert len({path.stat().st_ino for path in names}) == 1, "one file's names became several files"
    assert hashlib.sha256(names[0].read_bytes()).hexdigest() == inside
    assert names[0].read_bytes().endswith(b"more\n")
    for path in (ws, *ws.rglob("*")):
        assert path.lstat().st_uid == ws.stat().st_uid
