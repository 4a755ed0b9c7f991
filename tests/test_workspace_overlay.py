"""The workspace as an overlay on the host directory (issue 16, target 6), on the process and
gVisor tiers: nothing is copied at create, every command's write-back carries exactly what the
sandbox changed (files, directories, deletions, renames, opaque directories), symlinks are
never followed on either side, files end up owned by the workspace's owner, the disk limit
bounds copy-ups, and what happens when the host changes the directory meanwhile.

Cost: 16 tests (10 process and 6 gVisor sandboxes), ~5 s on a loaded 2-core machine.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from corral import Sandbox
from corral.errors import InvalidSpec

from .leaks import assert_gone_soon, kill_9, run_gc, sandbox_disk, start_owner
from .tier_probe import overlay_tier  # noqa: F401 (the ``tier`` fixture)

OWNER = (4321, 4322)


def run_dir(sb: Sandbox) -> Path:
    return Path(os.environ["CORRAL_STATE_DIR"]) / "sandboxes" / sb.id


def tree(root: Path) -> dict[str, str]:
    """Every entry below ``root``: file contents, ``->target`` for links, ``/`` for directories."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "->" + os.readlink(path)
        elif path.is_dir():
            out[rel] = "/"
        else:
            out[rel] = path.read_text()
    return out


def ok(sb: Sandbox, cmd: str, user: str | None = None) -> str:
    r = sb.commands.run(cmd, user=user)
    assert r.exit_code == 0, r.stderr
    return r.stdout


def owned_workspace(root: Path) -> Path:
    ws = root / "ws"
    ws.mkdir()
    (ws / "keep.txt").write_text("keep")
    (ws / "edit.txt").write_text("v1")
    (ws / "gone.txt").write_text("x")
    (ws / "old").mkdir()
    (ws / "old" / "a.txt").write_text("a")
    (ws / "redo").mkdir()
    (ws / "redo" / "stale.txt").write_text("stale")
    (ws / "moved").mkdir()
    (ws / "moved" / "m.txt").write_text("m")
    for path in (ws, *ws.rglob("*")):
        os.lchown(path, *OWNER)
    return ws


def test_each_command_writes_back_what_it_changed_and_nothing_is_copied(tier: str, tmp_path: Path) -> None:
    ws = owned_workspace(tmp_path)
    for path in (ws / "keep.txt", ws / "old"):
        os.utime(path, ns=(10**18, 10**18))  # atime = mtime: a relatime read would update it
    with Sandbox.create(tier=tier, workspace=str(ws), memory="256M") as sb:
        upper = sandbox_disk(sb.id, run_dir(sb)) / "ws-upper"
        assert sb.commands.run("ls /workspace/old; cat /workspace/keep.txt /workspace/old/a.txt").stdout == "a.txt\nkeepa"
        assert list(upper.iterdir()) == []  # nothing copied, and reading copies nothing up
        for path in (ws / "keep.txt", ws / "old"):  # nor does it touch the host's files
            assert path.stat().st_atime_ns == 10**18, path
        ok(sb, "echo v2 > /workspace/edit.txt && rm /workspace/gone.txt && rm -r /workspace/old"
               " && rm -r /workspace/redo && mkdir /workspace/redo && echo fresh > /workspace/redo/new.txt"
               " && mkdir -p /workspace/n/e/w && echo deep > /workspace/n/e/w/f"
               " && mv /workspace/moved /workspace/renamed && mv /workspace/keep.txt /workspace/kept.txt"
               " && ln -s kept.txt /workspace/link")
        # written back when the command ended, before the sandbox closes
        assert tree(ws) == {
            "edit.txt": "v2\n", "kept.txt": "keep", "link": "->kept.txt", "n": "/", "n/e": "/", "n/e/w": "/",
            "n/e/w/f": "deep\n", "redo": "/", "redo/new.txt": "fresh\n", "renamed": "/", "renamed/m.txt": "m",
        }
        assert sorted(p.name for p in upper.iterdir()) == sorted(
            ["edit.txt", "gone.txt", "old", "redo", "n", "moved", "renamed", "keep.txt", "kept.txt", "link"])
        # a directory made inside, written back, then renamed and emptied inside: the host follows
        ok(sb, "mv /workspace/n /workspace/n2 && rm /workspace/n2/e/w/f && rm /workspace/kept.txt")
        assert "n" not in tree(ws) and "kept.txt" not in tree(ws)
        assert tree(ws)["n2/e/w"] == "/" and "n2/e/w/f" not in tree(ws)
    for path in (ws, *ws.rglob("*")):
        assert (path.lstat().st_uid, path.lstat().st_gid) == OWNER, path


def test_the_sandbox_sees_its_owner_as_itself_and_other_users_files_as_nobody(tier: str, tmp_path: Path) -> None:
    ws = owned_workspace(tmp_path)
    (ws / "theirs.txt").write_text("theirs")
    os.chown(ws / "theirs.txt", 777, 777)
    os.chmod(ws / "theirs.txt", 0o666)  # world-writable on the host, still not the sandbox's to change
    (ws / "secret.txt").write_text("secret")
    os.chown(ws / "secret.txt", 777, 777)
    os.chmod(ws / "secret.txt", 0o600)
    with Sandbox.create(tier=tier, workspace=str(ws), memory="256M") as sb:
        owners = sb.commands.run("stat -c '%n %u %g' /workspace/edit.txt /workspace/theirs.txt").stdout
        assert owners.splitlines() == ["/workspace/edit.txt 1000 1000", "/workspace/theirs.txt 65534 65534"]
        assert sb.commands.run("cat /workspace/theirs.txt").stdout == "theirs"
        assert sb.commands.run("cat /workspace/secret.txt").exit_code != 0
        for user in ("user", "root"):  # neither changed nor removed
            for cmd in ("echo mine >> /workspace/theirs.txt", "rm /workspace/theirs.txt"):
                assert sb.commands.run(cmd, user=user).exit_code != 0, (cmd, user)
        ok(sb, "echo mine >> /workspace/edit.txt", user="root")
    assert (ws / "theirs.txt").read_text() == "theirs" and (ws / "theirs.txt").stat().st_uid == 777
    assert (ws / "edit.txt").read_text() == "v1mine\n"


#: a group of the owner's files other than the workspace directory's own (group-shared projects)
SHARED_GID = 4323


def test_the_owners_files_of_another_group_are_the_sandboxs_and_keep_their_group(tmp_path: Path) -> None:
    ws = owned_workspace(tmp_path)
    for name in ("append.txt", "rewrite.txt", "replace.txt", "gone.txt"):
        (ws / name).write_text("shared\n")
        os.chown(ws / name, OWNER[0], SHARED_GID)
        os.chmod(ws / name, 0o664)
    for name, gid in (("proj", SHARED_GID), ("plain", OWNER[1])):  # setgid directories
        (ws / name).mkdir()
        os.chown(ws / name, OWNER[0], gid)
        os.chmod(ws / name, 0o2775)
    with Sandbox.create(tier="process", workspace=str(ws), memory="256M") as sb:
        # its group is none of the sandbox's (it cannot take it): ``nogroup``, as before
        assert ok(sb, "stat -c '%u %g' /workspace/append.txt") == "1000 65534\n"
        ok(sb, "cd /workspace && echo more >> append.txt && echo new > rewrite.txt"
               " && sed -i s/shared/edited/ replace.txt && rm gone.txt"
               " && echo p > proj/new.txt && mkdir proj/sub && echo s > proj/sub/deep.txt && echo q > plain/new.txt")
        assert ok(sb, "cat /workspace/append.txt") == "shared\nmore\n"
        # root inside has no override over a group it has no name for: it changes them as their owner
        r = sb.commands.run("echo root >> /workspace/rewrite.txt", user="root")
        assert r.exit_code != 0 and "Permission denied" in r.stderr
        ok(sb, "setpriv --reuid=1000 --regid=1000 --clear-groups sh -c 'echo owner >> /workspace/rewrite.txt'", user="root")
    assert (ws / "append.txt").read_text() == "shared\nmore\n" and (ws / "rewrite.txt").read_text() == "new\nowner\n"
    assert (ws / "replace.txt").read_text() == "edited\n" and not (ws / "gone.txt").exists()

    def owner(rel: str) -> tuple[int, int]:
        st = os.lstat(ws / rel)
        return st.st_uid, st.st_gid

    shared = (OWNER[0], SHARED_GID)
    # changed in place: the host file keeps its group (and its group's write)
    assert owner("append.txt") == owner("rewrite.txt") == shared
    assert os.stat(ws / "append.txt").st_mode & 0o777 == 0o664
    # a new file (``sed -i`` writes one and renames it over) is the directory's group, as any new file
    assert owner("replace.txt") == OWNER
    # a setgid directory passes its group on, to files and directories, and stays setgid
    assert owner("proj") == owner("proj/new.txt") == owner("proj/sub") == owner("proj/sub/deep.txt") == shared
    for rel in ("proj", "proj/sub", "plain"):
        assert os.stat(ws / rel).st_mode & 0o2000, rel
    assert owner("plain/new.txt") == OWNER


def test_on_gvisor_the_owners_files_of_another_group_are_replaced_or_deleted_not_written_in_place(
        tmp_path: Path, state_dir: Path) -> None:
    """gVisor's Sentry reaches the host's files as the sandbox's root, whose override over a file
    needs its group to be one of the sandbox's: such a file is read-only in place (``EACCES``),
    as root's is on the process tier, and is deleted, renamed and replaced as any other."""
    from .tier_probe import skip_unless_tier

    skip_unless_tier("gvisor", state_dir)
    ws = owned_workspace(tmp_path)
    for name in ("append.txt", "replace.txt", "gone.txt"):
        (ws / name).write_text("shared\n")
        os.chown(ws / name, OWNER[0], SHARED_GID)
        os.chmod(ws / name, 0o664)
    with Sandbox.create(tier="gvisor", workspace=str(ws), memory="256M") as sb:
        r = sb.commands.run("echo more >> /workspace/append.txt")
        assert r.exit_code != 0 and "Permission denied" in r.stderr
        ok(sb, "cd /workspace && rm gone.txt && cp replace.txt r.new && echo more >> r.new && mv r.new replace.txt")
    assert (ws / "append.txt").read_text() == "shared\n" and os.stat(ws / "append.txt")[4:6] == (OWNER[0], SHARED_GID)
    assert not (ws / "gone.txt").exists() and (ws / "replace.txt").read_text() == "shared\nmore\n"
    assert os.stat(ws / "replace.txt")[4:6] == OWNER


def test_other_owners_files_stay_unchangeable_and_no_other_group_is_written_back(tier: str, tmp_path: Path) -> None:
    ws = owned_workspace(tmp_path)
    (ws / "theirs.txt").write_text("theirs")  # another user's, of a group the owner's files have
    os.chown(ws / "theirs.txt", 777, SHARED_GID)
    os.chmod(ws / "theirs.txt", 0o666)
    (ws / "groupread.txt").write_text("members only")
    os.chown(ws / "groupread.txt", 777, SHARED_GID)
    os.chmod(ws / "groupread.txt", 0o640)
    (ws / "theirdir").mkdir()  # another user's setgid directory, writable by all
    os.chown(ws / "theirdir", 777, SHARED_GID)
    os.chmod(ws / "theirdir", 0o2777)
    (ws / "mine.txt").write_text("mine")
    os.chown(ws / "mine.txt", OWNER[0], SHARED_GID)
    with Sandbox.create(tier=tier, workspace=str(ws), memory="256M") as sb:
        for user in ("user", "root"):
            for cmd in ("echo x >> /workspace/theirs.txt", "rm /workspace/theirs.txt",
                        "cat /workspace/groupread.txt", "echo x > /workspace/theirdir/new.txt",
                        "setpriv --regid=65534 --clear-groups cat /workspace/groupread.txt"):
                assert sb.commands.run(cmd, user=user).exit_code != 0, (cmd, user)
        # root inside can give a file no group of the host's (it names only the sandbox's)
        sb.commands.run("chgrp 0 /workspace/mine.txt", user="root")
        ok(sb, "echo r > /workspace/rootmade.txt && chgrp 50 /workspace/rootmade.txt"
               " && chgrp 50 /workspace/edit.txt && chmod 2775 /workspace/old", user="root")
        ok(sb, "chgrp user /workspace/mine.txt")  # the user may give its file its own group
    assert (ws / "theirs.txt").read_text() == "theirs" and os.stat(ws / "theirs.txt")[4:6] == (777, SHARED_GID)
    assert not (ws / "theirdir" / "new.txt").exists()
    # (gVisor answers a ``chgrp`` its gofer cannot make with success, and the file keeps its group)
    assert os.stat(ws / "mine.txt")[4:6] == (OWNER if tier == "process" else (OWNER[0], SHARED_GID))
    for path in (ws, *ws.rglob("*")):
        st = os.lstat(path)
        if path.name not in ("theirs.txt", "groupread.txt", "theirdir", "mine.txt"):
            assert (st.st_uid, st.st_gid) == OWNER, path  # the directory's own, and nothing else
    assert not os.stat(ws / "old").st_mode & 0o2000  # a setgid bit the host did not have is not given


def test_every_group_but_the_directorys_and_corrals_maps_to_itself_in_a_few_lines() -> None:
    from corral.host.uids import UID_TOP, WIDE_BASE, UidRange
    from corral.host.ws_overlay import HostGroups, owner_maps

    ids = UidRange(WIDE_BASE + 5 * 65536)
    for dir_gid in (0, 1000, 4322, ids.user, WIDE_BASE - 1, UID_TOP, 2**32 - 2):
        groups = HostGroups(dir_gid, ids.user)
        st = os.stat_result((0o40755, 0, 0, 0, 4321, dir_gid, 0, 0, 0, 0))
        uid_map, gid_map = owner_maps(Path("/"), ids.user, st)
        assert uid_map == f"4321 {ids.user} 1\n"
        lines = [tuple(map(int, line.split())) for line in gid_map.splitlines()]
        assert len(lines) <= 6 and lines[0] == (dir_gid, ids.user, 1)
        assert all(low == out and (low, low + count) in groups.spans for low, out, count in lines[1:])
        for gid in (0, 4, 65534, WIDE_BASE - 1, UID_TOP, 2**32 - 2):
            assert (gid in groups) == (gid != dir_gid), (dir_gid, gid)
        for gid in (dir_gid, ids.base, ids.user, WIDE_BASE, UID_TOP - 1, 2**32 - 1):
            assert gid not in groups, (dir_gid, gid)


def test_symlinks_are_never_followed_on_either_side(tier: str, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "file").write_text("HOST-ONLY")
    ws = owned_workspace(tmp_path)
    os.symlink(outside, ws / "hostlink")  # the user's own link, to a host directory
    os.lchown(ws / "hostlink", *OWNER)
    with Sandbox.create(tier=tier, workspace=str(ws), memory="256M") as sb:
        # inside, the host's link leads into the sandbox's own tree, never to the host's
        assert sb.commands.run("cat /workspace/hostlink/file").exit_code != 0
        # replace it with a real directory, and a host directory with a link out: the host's
        # link is replaced, not written through, and no link out is planted on the host
        ok(sb, "rm /workspace/hostlink && mkdir /workspace/hostlink && echo in > /workspace/hostlink/file"
                        f" && rm -r /workspace/redo && ln -s {outside} /workspace/redo")
    assert (outside / "file").read_text() == "HOST-ONLY"
    assert not (ws / "hostlink").is_symlink() and (ws / "hostlink" / "file").read_text() == "in\n"
    assert not (ws / "redo").exists() and not (ws / "redo").is_symlink()


def test_the_disk_limit_bounds_copy_ups_not_the_workspace_size(tier: str, tmp_path: Path) -> None:
    ws = owned_workspace(tmp_path)
    with open(ws / "big.bin", "wb") as f:
        f.truncate(40 << 20)
    # the copy refused a workspace larger than the disk
    with Sandbox.create(tier=tier, workspace=str(ws), disk="16M", memory="256M") as sb:
        assert sb.commands.run("wc -c < /workspace/big.bin").stdout == f"{40 << 20}\n"
        r = sb.commands.run("echo more >> /workspace/big.bin")  # a copy-up of 40 MB onto 16 MB
        assert r.exit_code != 0
        assert sb.commands.run("echo fits > /workspace/small.txt").exit_code == 0
    assert (ws / "big.bin").stat().st_size == 40 << 20 and (ws / "small.txt").read_text() == "fits\n"


def test_host_changes_meanwhile_the_sandboxs_changes_win_for_what_it_changed(tier: str, tmp_path: Path) -> None:
    ws = owned_workspace(tmp_path)
    with Sandbox.create(tier=tier, workspace=str(ws), memory="256M") as sb:
        ok(sb, "echo sandbox > /workspace/edit.txt")
        # the host edits what the sandbox changed and what it did not, and adds a file
        (ws / "edit.txt").write_text("host")
        (ws / "keep.txt").write_text("host edit")
        (ws / "hostnew.txt").write_text("from the host")
        # a path the sandbox has not looked up yet shows the host's new file
        assert sb.commands.run("cat /workspace/hostnew.txt").stdout == "from the host"
        # the sandbox keeps its own copy of what it changed
        assert sb.commands.run("cat /workspace/edit.txt").stdout == "sandbox\n"
        # a write-back carries only what changed since the previous one: the host's edits stay
        assert (ws / "edit.txt").read_text() == "host"
        ok(sb, "echo again >> /workspace/edit.txt")
        assert (ws / "edit.txt").read_text() == "sandbox\nagain\n"  # changed again: the sandbox's wins
        # a change that keeps the size and sets the mtime back is a change all the same
        ok(sb, "cd /workspace && touch -r edit.txt /tmp/ref && tr a-z A-Z < edit.txt > /tmp/up"
               " && cat /tmp/up > edit.txt && touch -r /tmp/ref edit.txt")
        assert (ws / "edit.txt").read_text() == "SANDBOX\nAGAIN\n"
    assert (ws / "keep.txt").read_text() == "host edit"
    assert (ws / "hostnew.txt").read_text() == "from the host"


def test_a_changed_hard_link_is_a_file_of_its_own(tmp_path: Path) -> None:
    ws = owned_workspace(tmp_path)
    os.link(ws / "edit.txt", ws / "alias.txt")
    with Sandbox.create(workspace=str(ws)) as sb:
        # overlayfs copies up the name that was written, as the copy's write-back replaced it
        assert ok(sb, "echo v2 > /workspace/edit.txt; cat /workspace/alias.txt") == "v1"
    assert (ws / "edit.txt").read_text() == "v2\n" and (ws / "alias.txt").read_text() == "v1"


def test_ro_workspace_is_the_live_read_only_view_even_for_root(tier: str, tmp_path: Path) -> None:
    ws = owned_workspace(tmp_path)
    with Sandbox.create(tier=tier, workspace=f"{ws}:ro", memory="256M") as sb:
        (ws / "later.txt").write_text("later")
        assert sb.commands.run("cat /workspace/later.txt").stdout == "later"
        for cmd in ("echo x > /workspace/keep.txt", "mount -o remount,rw /workspace"):
            assert sb.commands.run(cmd, user="root").exit_code != 0, cmd
        assert sb.commands.run("echo x > /workspace/keep.txt; echo x > /tmp/ok", user="root").stderr


@pytest.mark.parametrize("mode", ["ro", "rw", "cow"])
def test_a_host_unix_socket_in_the_workspace_cannot_be_connected_to(tier: str, mode: str, tmp_path: Path) -> None:
    """A socket a host program listens on inside the workspace directory (gpg-agent's in a
    ``.gnupg``, a database's) is not a way out, in every mode and whatever the network: the
    sandbox sees an overlay's inodes, never the host's (an ``ro`` workspace was the idmapped view
    itself, and its socket answered with ``network="none"``). The host's end is asserted to
    work first, so the test fails if the refusal came from somewhere else."""
    ws = owned_workspace(tmp_path)
    path = ws / "agent.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    os.chown(path, *OWNER)
    os.chmod(path, 0o666)  # any caller the kernel lets through may connect
    listener.listen(4)
    listener.settimeout(0.2)
    try:
        with socket.socket(socket.AF_UNIX) as host_side:  # the allowed thing: the host connects
            host_side.connect(str(path))
        listener.accept()[0].close()
        script = ("import socket; s = socket.socket(socket.AF_UNIX)\n"
                  "try: s.connect('/workspace/agent.sock'); print('CONNECTED')\n"
                  "except OSError as e: print('refused', e.errno)")
        network = "none" if tier == "process" else "allow"  # gVisor lets host sockets through with a proxy
        with Sandbox.create(tier=tier, workspace=f"{ws}:{mode}", memory="256M", network=network) as sb:
            for user in ("user", "root"):
                result = sb.commands.run(["python3", "-c", script], user=user, timeout=30)
                assert result.stdout.startswith("refused"), (user, result.stdout, result.stderr)
            assert sb.commands.run("test -S /workspace/agent.sock").exit_code == 0  # it is there, inert
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert (ws / "keep.txt").read_text() == "keep"


def test_snapshot_of_an_overlay_workspace_holds_the_whole_workspace(tmp_path: Path) -> None:
    ws = owned_workspace(tmp_path)
    with Sandbox.create(workspace=f"{ws}:cow") as sb:
        ok(sb, "echo changed > /workspace/edit.txt")
        snap = sb.snapshot()
    try:
        with Sandbox.create(snapshot=snap.id) as child:
            assert child.commands.run("cat /workspace/keep.txt /workspace/edit.txt").stdout == "keepchanged\n"
    finally:
        Sandbox.delete_snapshot(snap.id)
    assert (ws / "edit.txt").read_text() == "v1"


def test_a_workspace_that_cannot_be_idmapped_is_copied_as_before(tmp_path: Path) -> None:
    from corral.host import mounts

    ws = tmp_path / "wo-ramfs"  # ramfs has no idmapped mounts (tmpfs, ext4, xfs, btrfs do)
    ws.mkdir()
    mounts.mount("wo-ramfs", ws, "ramfs")
    try:
        (ws / "f.txt").write_text("on ramfs")
        with Sandbox.create(workspace=str(ws)) as sb:
            assert ok(sb, "cat /workspace/f.txt && echo back > /workspace/g.txt") == "on ramfs"
            assert not (sandbox_disk(sb.id, run_dir(sb)) / "ws-upper").exists()
        assert (ws / "g.txt").read_text() == "back\n"
    finally:
        mounts.umount(ws, lazy=True)


def test_a_killed_owners_read_only_overlay_is_reaped(tier: str, tmp_path: Path, state_dir: Path) -> None:
    """``ro`` is an overlay now (in the host's namespace on gVisor): a killed owner's leaves no
    mount, directory or process once ``gc`` ran, and the host directory is as it was."""
    ws = owned_workspace(tmp_path)
    before = tree(ws)
    owner, (sandbox_id,) = start_owner(
        f"sb = Sandbox.create(tier={tier!r}, workspace={str(ws) + ':ro'!r}, memory='256M')\n"
        "sb.commands.run('cat /workspace/keep.txt')\nprint(sb.id, flush=True)")
    kill_9(owner)
    run_gc(sandbox_id, timeout=60)
    assert_gone_soon(sandbox_id, state_dir)
    assert sandbox_id not in Path("/proc/mounts").read_text()
    assert tree(ws) == before


def test_a_killed_owners_workspace_overlay_is_reaped_and_the_host_directory_kept(tmp_path: Path,
                                                                                 state_dir: Path) -> None:
    ws = owned_workspace(tmp_path)
    owner, (sandbox_id,) = start_owner(
        f"sb = Sandbox.create(workspace={str(ws)!r})\n"
        "sb.commands.run('echo changed > /workspace/edit.txt; echo lost > /workspace/keep.txt.swp')\n"
        "print(sb.id, flush=True)")
    kill_9(owner)
    run_gc(sandbox_id, timeout=60)
    assert_gone_soon(sandbox_id, state_dir)  # the overlay's mount included
    # what was written back stays; the host directory is otherwise as it was
    assert tree(ws)["edit.txt"] == "changed\n" and tree(ws)["keep.txt.swp"] == "lost\n"
    assert tree(ws)["keep.txt"] == "keep" and tree(ws)["old/a.txt"] == "a"


def test_a_group_the_upper_layer_says_is_written_back_only_where_the_host_has_it(tmp_path: Path) -> None:
    """The upper layer's group of an entry was written back whenever it was one of the mapped host
    groups: on gVisor a directory raced into place came back owned by ``4321:0`` (root's group,
    which none of the owner's entries had).  Now the source's group is kept only where the host
    has it there already: the entry replaced has it, or the host directory is setgid with it."""
    from corral.host.workspace import _copy_entry
    from corral.host.ws_overlay import HostGroups

    src, dst = tmp_path / "upper", owned_workspace(tmp_path)
    src.mkdir()
    (dst / "kept").write_text("old")
    os.chown(dst / "kept", OWNER[0], SHARED_GID)
    (dst / "setgid").mkdir()
    os.chown(dst / "setgid", OWNER[0], SHARED_GID)
    os.chmod(dst / "setgid", 0o2775)
    (src / "setgid").mkdir()
    for rel, gid in (("kept", SHARED_GID), ("rooted", 0), ("raced", 0), ("setgid/made", SHARED_GID),
                     ("setgid/rooted", 0)):
        if rel == "raced":
            (src / rel).mkdir()
        else:
            (src / rel).write_text("new")
        os.chown(src / rel, 0, gid)
    groups = HostGroups(OWNER[1], 1_500_000_000)
    assert 0 in groups and SHARED_GID in groups
    dst_root = os.open(dst, os.O_RDONLY)
    for rel in ("kept", "rooted", "raced", "setgid/made", "setgid/rooted"):
        parent = rel.rpartition("/")[0]
        src_dir, dst_dir = os.open(src / parent, os.O_RDONLY), os.open(dst / parent, os.O_RDONLY)
        try:
            kind = "d" if (src / rel).is_dir() else "f"
            _copy_entry(src_dir, dst_dir, dst_root, rel, kind, 0o755 if kind == "d" else 0o644,
                        *OWNER, inside_links_only=True, groups=groups)
        finally:
            os.close(src_dir)
            os.close(dst_dir)
    os.close(dst_root)
    groups_of = {rel: os.lstat(dst / rel).st_gid for rel in ("kept", "rooted", "raced", "setgid/made", "setgid/rooted")}
    assert groups_of == {"kept": SHARED_GID, "rooted": OWNER[1], "raced": OWNER[1], "setgid/made": SHARED_GID,
                         "setgid/rooted": OWNER[1]}, groups_of


def _exchange(a: Path, b: Path) -> None:
    """renameat2(RENAME_EXCHANGE): ``a`` and ``b`` swap places at once."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(316, -100, os.fsencode(a), -100, os.fsencode(b), 2) != 0:  # SYS_renameat2 (x86_64)
        raise OSError(ctypes.get_errno(), f"exchange {a} {b}")


@pytest.mark.parametrize("mode", ["ro", "rw"])
def test_a_workspace_path_swapped_for_a_link_as_it_is_mounted_shows_the_sandbox_nothing_else(
        tier: str, mode: str, tmp_path: Path) -> None:
    """The overlay was made of the workspace by its path, well after the spec's checks of it: a
    host user owning a directory on the path could swap it for a link in between, and the sandbox
    saw where the link led, past those checks (here a directory under /var/lib, which is refused as
    a workspace).  Now the view is checked to be the directory the checks saw before the overlay
    is made of it: each create shows the project, or is refused (a typed error), never the other."""
    import threading

    if os.uname().machine != "x86_64":
        pytest.skip("the swap uses x86_64's renameat2 number")
    project, swap = tmp_path / "proj", tmp_path / "swap"
    project.mkdir()
    (project / "marker").write_text("project")
    secret = Path(f"/var/lib/corral-test-secret-{os.getpid()}")
    secret.mkdir()
    try:
        (secret / "marker").write_text("secret")
        swap.symlink_to(secret)
        stop = threading.Event()

        def swapping() -> None:
            while not stop.is_set():
                _exchange(project, swap)

        swapper = threading.Thread(target=swapping, daemon=True)
        seen: dict[str, int] = {}
        swapper.start()
        try:
            for _ in range(30):
                try:
                    with Sandbox.create(tier=tier, workspace=f"{project}:{mode}") as sb:
                        what = sb.commands.run("cat /workspace/marker").stdout or "none"
                except InvalidSpec:
                    what = "refused"
                seen[what] = seen.get(what, 0) + 1
        finally:
            stop.set()
            swapper.join()
        assert "secret" not in seen, seen
        # the allowed direction: with nothing swapping, the project is shown
        if project.is_symlink():
            _exchange(project, swap)
        with Sandbox.create(tier=tier, workspace=f"{project}:{mode}") as sb:
            assert sb.commands.run("cat /workspace/marker").stdout == "project"
    finally:
        (secret / "marker").unlink()
        secret.rmdir()
