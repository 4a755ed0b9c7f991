"""What a workspace's write-back writes to the host is bounded by the sandbox's disk limit.

A sandbox with a 64 MiB disk could write gigabytes into the user's directory: a sparse file
(``truncate -s 4G``) costs it nothing on its tmpfs, and each hard link to a file was copied
as a file of its own.  Write-back now copies data extents only and keeps the names of one
file as names of one host file, on every tier that writes a workspace back (the process
tier's overlay and its copy, gVisor, the microVM).

The walk is bounded too: a chain of directories thousands deep (free on a tmpfs) made every
write-back raise ``RecursionError``; now entries below ``MAX_DEPTH`` levels are not written
back and the host's own deep trees are deleted without recursion.

Cost: 7 sandboxes and one walk of 20,000 files, ~10 s (the microVM's ~3 s of it when its tier
is available).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral.host import workspace, ws_overlay

from .memory_groups import usage
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


@pytest.mark.parametrize("copy_tier", ["process", "gvisor", "microvm"])
def test_a_workspace_copied_in_is_charged_to_the_sandbox_not_its_owner(
        copy_tier: str, state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        owner_group: Path) -> None:
    """The copy of a workspace (the microVM's always; the process tier's and gVisor's where the
    directory cannot be idmapped, or in a sandbox made from a snapshot) is written onto the
    sandbox's disk tmpfs from the owner, and a tmpfs page is charged to its writer: 100 MiB copied
    in grew the owner's group by 208 MiB (process; gVisor 207, microVM 232) and the sandboxes'
    parent's by 1, outside every limit.  Now one child in the sandbox's memory group copies it."""
    if copy_tier != "process":
        skip_unless_tier(copy_tier, state_dir)
    monkeypatch.setattr(ws_overlay, "ENABLED", False)
    size = 64 << 20
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "big.bin").write_bytes(os.urandom(1 << 20) * 64)
    owner = owner_group
    before_owner = usage(owner)
    with Sandbox.create(tier=copy_tier, workspace=f"{ws}:cow", memory="512M", disk="256M") as sb:
        grown_owner = usage(owner) - before_owner
        inner = sb._tier_sandbox()
        assert inner.cgroup is not None
        grown_sandbox = usage(inner.cgroup.memory_group)
        assert grown_sandbox >= size, (grown_sandbox >> 20, grown_owner >> 20)
        assert grown_owner < size // 2, (grown_sandbox >> 20, grown_owner >> 20)
        assert sb.commands.run("wc -c < /workspace/big.bin").stdout == f"{size}\n"


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


#: a chain of directories far deeper than the write-back walks, made by one process
DEEP = "import os\nfor _ in range(1500):\n    os.mkdir('a')\n    os.chdir('a')\nopen('bottom', 'w').close()"


def host_chain(root: Path, depth: int) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("a", dir_fd=fd)
        nxt = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)


def chain_depth(root: Path) -> int:
    fd, depth = os.open(root, os.O_RDONLY | os.O_DIRECTORY), 0
    try:
        while True:
            try:
                nxt = os.open("a", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                return depth
            os.close(fd)
            fd, depth = nxt, depth + 1
    finally:
        os.close(fd)


def test_a_tree_deeper_than_the_write_back_walks_is_written_to_its_bound(tier: str, tmp_path: Path) -> None:
    # before, every command's write-back raised RecursionError once a chain passed ~990 levels;
    # the walk is the host's, the same code for every tier: not the microVM (1,500 levels over
    # 9p under TCG take ~35 s)
    if tier == "microvm":
        pytest.skip("the same host-side walk as the other tiers, ~35 s over 9p under TCG")
    ws = tmp_path / "ws"
    (ws / "host-deep").mkdir(parents=True)
    host_chain(ws / "host-deep", 1500)  # the host's own, which the sandbox deletes
    with Sandbox.create(tier=tier, workspace=str(ws), memory="256M") as sb:
        r = sb.commands.run(["python3", "-c", DEEP], cwd="/workspace", timeout=120)
        assert r.exit_code == 0, r.stderr
        r = sb.commands.run("rm -rf host-deep && echo removed", cwd="/workspace", timeout=120)
        assert (r.exit_code, r.stdout) == (0, "removed\n"), r.stderr
        assert sb.commands.run("echo alive").stdout == "alive\n"
    assert chain_depth(ws) == workspace.MAX_DEPTH
    assert not (ws / "host-deep").exists()


def test_the_manifest_of_a_deep_tree_costs_names_not_paths(tmp_path: Path) -> None:
    # 20,000 files 120 directories down, as a sandbox can make them for nothing on its tmpfs:
    # keyed by whole paths (~3.7 KB each) the host held ~75 MB per walk, and two walks at once
    # (200,000 files: the owner's RSS reached 1.7 GB for a sandbox limited to 512 MiB)
    import tracemalloc

    root = Path(tempfile.mkdtemp(prefix="wb-manifest-", dir="/dev/shm"))
    try:
        deep = root
        for _ in range(120):
            deep = deep / ("d" * 30)
        deep.mkdir(parents=True)
        fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
        for i in range(20_000):
            os.close(os.open(f"f{i:05d}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        os.close(fd)
        tracemalloc.start()
        try:
            manifest = workspace.scan(root)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(manifest) == 20_120
        assert peak < 32 * 2**20, f"a walk of 20,000 entries held {peak / 2**20:.1f} MiB"
    finally:
        shutil.rmtree(root)


def test_a_tree_of_any_depth_is_removed_holding_a_bounded_number_of_descriptors(tmp_path: Path) -> None:
    """The removal of a tree (a write-back's, and the wasm tier's ``files.remove``) held one
    descriptor per level: a chain deeper than the owner's free descriptors could not be removed,
    and took the owner's other threads' descriptors meanwhile.  Under a limit of 200 more than
    the owner holds, a 3,000-level chain goes; a link in a tree is removed, not followed."""
    import resource

    (tmp_path / "chain").mkdir()
    host_chain(tmp_path / "chain", 3000)
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "file").write_text("x")
    (tmp_path / "tree" / "sub" / "link").symlink_to(tmp_path / "kept")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 200, hard))
        try:
            workspace.remove_beneath(root, "chain")
            workspace.remove_beneath(root, "tree")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    finally:
        os.close(root)
    assert sorted(os.listdir(tmp_path)) == ["kept"]
    assert (tmp_path / "kept" / "file").read_text() == "x"


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "mount-ids"])
def test_a_bind_mount_of_the_same_file_system_is_not_opened_beneath(
        openat2: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``st_dev`` cannot tell a bind mount of a directory of the same file system from a directory
    of the workspace: ``openat2(RESOLVE_NO_XDEV)`` can, and so can the mount ids compared where a
    kernel (or the owner's seccomp filter) has no ``openat2``.  A plain directory opens either way."""
    import subprocess

    monkeypatch.setattr(workspace, "_no_openat2", not openat2)
    (tmp_path / "ws" / "sub").mkdir(parents=True)
    (tmp_path / "ws" / "plain").mkdir()
    (tmp_path / "other").mkdir()
    subprocess.run(["mount", "--bind", str(tmp_path / "other"), str(tmp_path / "ws" / "sub")], check=True)
    root = os.open(tmp_path / "ws", workspace._DIR_FLAGS)
    try:
        assert os.stat(tmp_path / "ws" / "sub").st_dev == os.fstat(root).st_dev
        with pytest.raises(workspace.OtherMount):
            workspace.open_beneath(root, "sub", workspace._DIR_FLAGS)
        os.close(workspace.open_beneath(root, "plain", workspace._DIR_FLAGS))
        with pytest.raises(FileNotFoundError):
            workspace.open_beneath(root, "absent", workspace._DIR_FLAGS)
    finally:
        os.close(root)
        subprocess.run(["umount", str(tmp_path / "ws" / "sub")], check=True)
