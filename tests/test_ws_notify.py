"""A workspace write-back costs what changed since the last one (issue 16, target 6): after the
sandbox made thousands of files, each kind of change -- an edit, a deletion, a renamed
directory, a hard link, a write through ``mmap``, a copy-up, an opaque directory -- arrives on
the host exactly as a walk of the whole upper layer would deliver it, while the write-back looks
at a handful of entries; a lost event queue walks everything and still delivers everything; a
write the events cannot show (through a mapping a background process still holds) arrives at
destroy at the latest; a host without the change watch walks everything, as before.

Cost: 6 process sandboxes and one gVisor sandbox, ~15 s on a loaded 2-core machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral.host import ws_overlay
from corral.host.fsnotify import FAN_CREATE, FAN_MOVED_TO, FAN_ONDIR, ChangeWatch
from corral.host.ws_overlay import WorkspaceOverlay, scan_upper

from .tier_probe import overlay_tier  # noqa: F401 (the ``tier`` fixture)

OWNER = (4321, 4322)

#: the sandbox's view of /workspace, as the host's is computed by ``snapshot`` below
INSIDE = r"""
import hashlib, json, os
out = {}
for top, dirs, files in os.walk("/workspace"):
    for name in dirs + files:
        path = os.path.join(top, name)
        rel = os.path.relpath(path, "/workspace")
        if os.path.islink(path):
            out[rel] = "->" + os.readlink(path)
        elif os.path.isdir(path):
            out[rel] = "/"
        else:
            with open(path, "rb") as f:
                out[rel] = "%o:" % (os.lstat(path).st_mode & 0o777) + hashlib.sha1(f.read()).hexdigest()
print(json.dumps(out))
"""


def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "->" + os.readlink(path)
            elif path.is_dir():
                out[rel] = "/"
            else:
                out[rel] = f"{path.lstat().st_mode & 0o777:o}:" + hashlib.sha1(path.read_bytes()).hexdigest()
    return out


def ok(sb: Sandbox, cmd: str) -> str:
    r = sb.commands.run(cmd, timeout=120)
    assert r.exit_code == 0, r.stderr
    return r.stdout


def workspace_of(sb: Sandbox) -> WorkspaceOverlay:
    ws = sb._tier_sandbox().workspace  # type: ignore[attr-defined]
    assert isinstance(ws, WorkspaceOverlay)
    return ws


def host_workspace(root: Path) -> Path:
    ws = root / "ws"
    ws.mkdir()
    (ws / "lower.txt").write_text("host")
    (ws / "lowerdir").mkdir()
    (ws / "lowerdir" / "old.txt").write_text("old")
    (ws / "redo").mkdir()
    (ws / "redo" / "stale.txt").write_text("stale")
    for path in (ws, *ws.rglob("*")):
        os.lchown(path, *OWNER)
    return ws


def make_files(sb: Sandbox, dirs: int, per_dir: int = 100, top: str = "/workspace") -> None:
    """``dirs`` directories ``made01``... of ``per_dir`` empty files ``f001``... (as ``seq -w``
    names them), made by one process: a shell loop forks ~80 times for 2,000 files (7 s in gVisor)."""
    code = (f"import os\nfor d in range(1, {dirs} + 1):\n"
            f"    path = '{top}/made%0{len(str(dirs))}d' % d\n    os.mkdir(path)\n"
            f"    for i in range(1, {per_dir} + 1):\n"
            f"        open(path + '/f%0{len(str(per_dir))}d' % i, 'w').close()\n")
    r = sb.commands.run(["python3", "-c", code], timeout=120)
    assert r.exit_code == 0, r.stderr


def test_each_change_after_thousands_of_files_arrives_as_a_whole_walk_would_deliver_it(tier: str, tmp_path: Path) -> None:
    ws = host_workspace(tmp_path)
    with Sandbox.create(tier=tier, workspace=str(ws), memory="256M") as sb:
        overlay = workspace_of(sb)
        if overlay.watch is None:
            pytest.skip("this host gives no change watch (fanotify with file handles)")
        make_files(sb, 20)  # 2,000 files
        walks = overlay.full_scans
        changes = [
            ("echo more >> /workspace/made05/f007", 3),
            ("rm /workspace/made06/f001", 3),
            ("mv /workspace/made07 /workspace/renamed07", 110),
            ("ln /workspace/made08/f001 /workspace/made09/hard", 5),  # the kernel names the new name only
            ("echo linked > /workspace/made09/hard && ln /workspace/made09/hard /workspace/made08/third", 7),
            ("rm /workspace/made08/third", 5),  # (the other names' change time moves)
            ("python3 -c \"import mmap, os; f = os.open('/workspace/made10/f002', os.O_RDWR);"
             " os.ftruncate(f, 5); m = mmap.mmap(f, 5); os.close(f); m[:] = b'mmap!'; m.close()\"", 3),
            ("echo copied-up >> /workspace/lower.txt && chmod 600 /workspace/made11/f003", 5),
            ("rm -r /workspace/redo && mkdir /workspace/redo && echo fresh > /workspace/redo/new.txt", 4),
            ("rm -r /workspace/lowerdir /workspace/made12 && mv /workspace/renamed07 /workspace/made13/in", 220),
        ]
        for cmd, most in changes:
            ok(sb, cmd)
            assert overlay.full_scans == walks, cmd  # the events sufficed
            assert overlay.looked_at <= most, (cmd, overlay.looked_at)
            # what the events led to is what a whole walk finds, and the host holds the sandbox's view
            assert overlay.manifest == scan_upper(overlay.upper), cmd
            assert snapshot(ws) == json.loads(ok(sb, f"python3 -c '{INSIDE}'")), cmd
        # the names of one file are names of one host file, as after a whole walk
        assert len({os.stat(ws / name).st_ino for name in ("made08/f001", "made09/hard")}) == 1
        assert (ws / "made08" / "f001").read_text() == "linked\n"
        assert (ws / "made10" / "f002").read_bytes() == b"mmap!"
        assert (ws / "made13" / "in" / "f050").exists() and not (ws / "made07").exists()
        ok(sb, "true")
        assert overlay.looked_at == 0
    for path in (ws, *ws.rglob("*")):
        assert (path.lstat().st_uid, path.lstat().st_gid) == OWNER, path


def test_a_lost_event_queue_walks_everything_and_still_delivers_it(tmp_path: Path) -> None:
    ws = host_workspace(tmp_path)
    limit = int(Path("/proc/sys/fs/fanotify/max_queued_events").read_text())
    with Sandbox.create(tier="process", workspace=str(ws), memory="256M", disk="256M") as sb:
        overlay = workspace_of(sb)
        if overlay.watch is None:
            pytest.skip("this host gives no change watch (fanotify with file handles)")
        ok(sb, "true")
        walks = overlay.full_scans
        # more new names in one command than the kernel queues: it reports an overflow
        make_files(sb, (limit + 1000 + 999) // 1000, per_dir=1000)
        assert overlay.full_scans == walks + 1
        assert overlay.manifest == scan_upper(overlay.upper)
        made = snapshot(ws)
        assert made == json.loads(ok(sb, f"python3 -c '{INSIDE}'"))
        assert sum(1 for rel in made if rel.startswith("made")) > limit
        ok(sb, "echo after > /workspace/made01/f0001")  # the watch goes on from there
        assert overlay.full_scans == walks + 1 and overlay.looked_at <= 3
        assert (ws / "made01" / "f0001").read_text() == "after\n"


def test_a_write_back_looks_at_what_changed_not_at_what_the_sandbox_made_before(tmp_path: Path) -> None:
    ws = host_workspace(tmp_path)
    looked = {}
    with Sandbox.create(tier="process", workspace=str(ws), memory="256M") as sb:
        overlay = workspace_of(sb)
        if overlay.watch is None:
            pytest.skip("this host gives no change watch (fanotify with file handles)")
        for dirs in (1, 5, 40):  # 100, then 500, then 4,000 more files made
            ok(sb, f"mkdir /workspace/n{dirs}")
            make_files(sb, dirs, top=f"/workspace/n{dirs}")
            ok(sb, f"echo {dirs} >> /workspace/n{dirs}/made{'1'.zfill(len(str(dirs)))}/f001")
            looked[dirs] = (overlay.looked_at, overlay.full_scans)
            ok(sb, "true")
            assert overlay.looked_at == 0
    assert looked[1] == looked[5] == looked[40], looked
    assert looked[40][0] <= 3


def test_a_write_through_a_mapping_held_in_the_background_arrives_at_destroy(tmp_path: Path) -> None:
    ws = host_workspace(tmp_path)
    (ws / "mapped").write_bytes(b"before")
    os.lchown(ws / "mapped", *OWNER)
    holder = ("import mmap, os, time\n"
              "f = os.open('/workspace/mapped', os.O_RDWR); m = mmap.mmap(f, 6); os.close(f)\n"
              "open('/tmp/mapped', 'w').close()\n"
              "for _ in range(3000):\n"
              "    if os.path.exists('/tmp/go'): break\n"
              "    time.sleep(0.01)\n"
              "m[:] = b'later!'\n"
              "open('/tmp/written', 'w').close()\n"
              "time.sleep(600)\n")
    with Sandbox.create(tier="process", workspace=str(ws), memory="256M") as sb:
        sb.files.write("/tmp/holder.py", holder)
        ok(sb, "echo copied > /workspace/mapped && (python3 /tmp/holder.py > /dev/null 2>&1 &)"
               " && for i in $(seq 3000); do [ -e /tmp/mapped ] && break; sleep 0.01; done")
        ok(sb, "touch /tmp/go; for i in $(seq 3000); do [ -e /tmp/written ] && break; sleep 0.01; done")
        ok(sb, "true")  # (no event: the mapping is still held; the host may lag)
    assert (ws / "mapped").read_bytes() == b"later!\n"


def test_without_a_change_watch_every_write_back_walks_everything_as_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ChangeWatch.open("/proc") is None  # no file handles there: detected, not assumed
    monkeypatch.setattr(ws_overlay, "WATCH", False)
    ws = host_workspace(tmp_path)
    with Sandbox.create(tier="process", workspace=str(ws), memory="256M") as sb:
        overlay = workspace_of(sb)
        assert overlay.watch is None
        make_files(sb, 3)
        walks = overlay.full_scans
        ok(sb, "mv /workspace/made1 /workspace/moved && ln /workspace/made2/f001 /workspace/hard")
        assert overlay.full_scans == walks + 1 and overlay.looked_at == len(overlay.manifest) > 300
        assert snapshot(ws) == json.loads(ok(sb, f"python3 -c '{INSIDE}'"))
    assert os.stat(ws / "made2" / "f001").st_ino == os.stat(ws / "hard").st_ino


@pytest.fixture
def tmpfs() -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="wbn-tmpfs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "wbn", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def test_the_watch_names_the_directory_and_the_entry_of_each_change(tmpfs: Path) -> None:
    watch = ChangeWatch.open(tmpfs)
    assert watch is not None
    try:
        (tmpfs / "d").mkdir()
        (tmpfs / "d" / "f").write_text("x")
        os.rename(tmpfs / "d", tmpfs / "e")
        root = os.open(tmpfs, os.O_RDONLY | os.O_DIRECTORY)
        try:
            seen = []
            for change in watch.drain(100):
                fd = watch.open_dir(root, change.handle)
                seen.append((os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmpfs), change.name, change.mask))
                os.close(fd)
        finally:
            os.close(root)
        # (events on one name merge: "d" was made, then moved away)
        assert any(where == "." and name == "d" and mask & FAN_CREATE and mask & FAN_ONDIR for where, name, mask in seen)
        assert any(where == "e" and name == "f" and mask & FAN_CREATE for where, name, mask in seen)
        assert any(where == "." and name == "e" and mask & FAN_MOVED_TO for where, name, mask in seen)
        assert watch.drain(100) == []
    finally:
        watch.close()
