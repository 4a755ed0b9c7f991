"""Root inside a sandbox (issue 13): the sandbox's 65,536 host ids mapped to 0-65535, the
default user uid 1000, ``user="root"`` on create and per command, image files with their
real owners, a copy-on-write root that root may change and that vanishes with the sandbox.

Cost: ~12 process-tier sandboxes, ~10 s on a loaded 2-core machine.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from corral import Sandbox
from corral.errors import InvalidSpec
from corral.host import uids as host_uids
from corral.tiers.process.tier import ROOT_CAPS

from .server_fixtures import CORRAL

#: CapEff of root inside: ROOT_CAPS and nothing else
_CAP_BITS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4, "CAP_KILL": 5,
             "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10,
             "CAP_AUDIT_WRITE": 29, "CAP_SETFCAP": 31}
ROOT_MASK = f"{sum(1 << _CAP_BITS[c] for c in ROOT_CAPS):016x}"
STATUS = "id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status"


def _status(sb: Sandbox, user: str | None = None) -> dict[str, str]:
    r = sb.commands.run(STATUS, user=user)
    assert r.exit_code == 0, r
    lines = r.stdout.split()
    return {"uid": lines[0], **dict(zip(lines[1::2], lines[2::2], strict=True))}


def _host_uids_of(marker: bytes) -> set[int]:
    """The real, effective, saved and file-system uids on the host of the process whose command
    line starts with ``marker`` (waiting up to 5 s for it to exist)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(marker):
                    status = Path(f"/proc/{pid}/status").read_text().splitlines()
                    return {int(v) for line in status if line.startswith("Uid:") for v in line.split()[1:]}
            except OSError:
                continue
        time.sleep(0.02)
    raise AssertionError(f"no process {marker!r}")


def test_the_whole_range_is_mapped_the_default_is_uid_1000_and_root_is_asked_for() -> None:
    with Sandbox.create() as sb:
        maps = sb.commands.run("cat /proc/self/uid_map /proc/self/gid_map").stdout.split()
        base = int(maps[1])
        assert maps == ["0", str(base), "65536"] * 2
        assert base >= host_uids.UID_BASE and base + 65536 <= host_uids.UID_TOP
        user = _status(sb)
        assert user == {"uid": "1000", "CapEff:": "0" * 16, "CapBnd:": "0" * 16, "NoNewPrivs:": "1", "Seccomp:": "2"}
        root = _status(sb, "root")
        assert root == {"uid": "0", "CapEff:": ROOT_MASK, "CapBnd:": ROOT_MASK, "NoNewPrivs:": "1", "Seccomp:": "2"}
        assert sb.commands.run("echo $HOME $USER", user="root").stdout == "/root root\n"
        # on the host, root inside is the range's first uid: no host privilege
        handle = sb.commands.start("exec sleep 31.4159", user="root")
        try:
            assert _host_uids_of(b"sleep\x0031.4159") == {base}
        finally:
            handle.kill()
            handle.wait()
    with Sandbox.create(user="root") as sb:
        assert _status(sb)["uid"] == "0"
        assert _status(sb, "user") == user
    with pytest.raises(InvalidSpec, match="user"):
        Sandbox.create(user="admin")
    with pytest.raises(InvalidSpec, match="cannot run commands as root"):
        Sandbox.create(tier="wasm", user="root")


def test_image_files_show_real_owners_and_only_root_may_change_them() -> None:
    with Sandbox.create() as sb:
        assert sb.commands.run("stat -c %U:%G /usr/bin/env /etc/passwd").stdout == "root:root\n" * 2
        assert sb.commands.run("stat -c %U ~").stdout == "user\n"
        denied = sb.commands.run("touch /usr/bin/c13-x; chown 4242 /tmp; setpriv --reuid=4242 true")
        assert denied.stderr.count("Permission denied") + denied.stderr.count("Operation not permitted") == 3
        done = sb.commands.run(
            "echo hi > /usr/bin/c13-x && chown 4242:4242 /usr/bin/c13-x && stat -c %u:%g /usr/bin/c13-x"
            " && setpriv --reuid=4242 --regid=4242 --clear-groups sh -c 'id -u; grep CapEff /proc/self/status'"
            " && rm /etc/hostname && echo removed", user="root")
        assert done.stdout.split() == ["4242:4242", "4242", "CapEff:", "0" * 16, "removed"], done
        assert sb.commands.run("cat /usr/bin/c13-x").stdout == "hi\n"  # others read it (0644)
    assert not Path("/usr/bin/c13-x").exists()
    with Sandbox.create(user="root") as sb:  # a new sandbox: the image as it was
        assert sb.commands.run("test -e /usr/bin/c13-x || test -e /etc/hostname && echo fresh").stdout == "fresh\n"


def _wheel(directory: Path) -> Path:
    """A pure-Python wheel, built here (no network, no build backend)."""
    path = directory / "c13wheel-1.0-py3-none-any.whl"
    files = {
        "c13wheel/__init__.py": "ANSWER = 42\n",
        "c13wheel-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: c13wheel\nVersion: 1.0\n",
        "c13wheel-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: corral-test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "c13wheel-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in {**files, "c13wheel-1.0.dist-info/RECORD": record}.items():
            zf.writestr(name, text)
    return path


def _npm_tarball(directory: Path) -> Path:
    path = directory / "c13-tool-1.0.0.tgz"
    members = {
        "package/package.json": json.dumps({"name": "c13-tool", "version": "1.0.0", "bin": {"c13-tool": "cli.js"}}),
        "package/cli.js": "#!/usr/bin/env node\nconsole.log('c13 tool ran');\n",
    }
    with tarfile.open(path, "w:gz") as tf:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tf.addfile(info, io.BytesIO(data))
    return path


def test_pip_and_npm_install_as_root_and_their_results_vanish_with_the_sandbox(tmp_path: Path) -> None:
    wheel, tarball = _wheel(tmp_path), _npm_tarball(tmp_path)
    with Sandbox.create(user="root", disk="256M") as sb:
        sb.files.write(f"/tmp/{wheel.name}", wheel.read_bytes())
        sb.files.write(f"/tmp/{tarball.name}", tarball.read_bytes())
        # the allowed direction is root's; the sandbox user cannot install system-wide
        as_user = sb.commands.run(f"npm install -g --offline --no-audit --no-fund /tmp/{tarball.name}",
                                  user="user", timeout=120)
        assert as_user.exit_code != 0 and "EACCES" in as_user.stdout + as_user.stderr
        pip = sb.commands.run(f"python3 -m pip install --no-index --break-system-packages /tmp/{wheel.name}",
                              timeout=120)
        assert pip.exit_code == 0, pip
        npm = sb.commands.run(f"npm install -g --offline --no-audit --no-fund /tmp/{tarball.name}", timeout=120)
        assert npm.exit_code == 0, npm
        used = sb.commands.run("python3 -c 'import c13wheel; print(c13wheel.ANSWER, c13wheel.__file__)'; c13-tool",
                               user="user")
        assert used.stdout.split() == ["42", "/usr/local/lib/python3.11/dist-packages/c13wheel/__init__.py",
                                       "c13", "tool", "ran"], used
    assert not Path("/usr/local/lib/python3.11/dist-packages/c13wheel").exists()
    assert not Path("/usr/local/bin/c13-tool").exists()
    with Sandbox.create(user="root") as sb:
        assert sb.commands.run("python3 -c 'import c13wheel'; command -v c13-tool").exit_code != 0


def test_what_root_writes_in_the_image_counts_against_disk() -> None:
    with Sandbox.create(user="root", disk="32M") as sb:
        r = sb.commands.run("dd if=/dev/zero of=/usr/c13-big bs=1M count=64 2>&1; rm -f /usr/c13-big")
        assert "No space left on device" in r.stdout
        assert sb.commands.run("head -c 1M /dev/zero > /usr/c13-small && echo ok").stdout == "ok\n"


def test_workspace_write_back_keeps_the_workspace_owner_whoever_wrote_inside(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    os.chown(ws, 4321, 4322)
    with Sandbox.create(workspace=str(ws)) as sb:
        sb.commands.run("mkdir /workspace/d && echo r > /workspace/d/by-root && chown 7:7 /workspace/d/by-root",
                        user="root", check=True)
        sb.commands.run("echo u > /workspace/by-user", check=True)
    for path in (ws / "d", ws / "d" / "by-root", ws / "by-user"):
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (4321, 4322), path


def test_user_travels_over_rest_the_cli_and_mcp(tmp_path: Path, state_dir: Path) -> None:
    from .server_fixtures import ServerProcess

    env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_API_KEY")}
    cli = subprocess.run([CORRAL, "run", "--user", "root", "--", "id", "-u"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert (cli.returncode, cli.stdout) == (0, "0\n"), cli.stderr
    cli = subprocess.run([CORRAL, "run", "--", "id", "-u"], capture_output=True, text=True, env=env, timeout=60)
    assert cli.stdout == "1000\n"
    with ServerProcess(state_dir / "c13-server") as server:
        client = server.client()
        made = client.post("/v1/sandboxes", json={"user": "root"})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        ran = client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "id -u"}).json()
        as_user = client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "id -u", "user": "user"}).json()
        assert (ran["stdout"], as_user["stdout"]) == ("0\n", "1000\n")
        bad = client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "id -u", "user": "admin"})
        assert bad.status_code == 400
        client.delete(f"/v1/sandboxes/{sid}")
        with Sandbox.create(url=server.url) as sb:  # the SDK over HTTP: per command, and the exec stream
            assert sb.commands.run("id -u", user="root").stdout == "0\n"
            assert sb.commands.start("id -u", user="root").wait().stdout == "0\n"
            assert sb.commands.run("id -u").stdout == "1000\n"
    _mcp_round(state_dir / "c13-mcp", env)


def _mcp_round(state: Path, env: dict[str, str]) -> None:
    import anyio
    from mcp import ClientSession, StdioServerParameters, stdio_client

    state.mkdir()
    params = StdioServerParameters(command=CORRAL, args=["--state-dir", str(state), "mcp"], env=env)

    async def session() -> list[str]:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            out = []
            for create, run in (({"user": "root"}, {}), ({}, {"user": "root"}), ({}, {})):
                made = await client.call_tool("create_sandbox", {"memory": "128M", **create})
                sid = json.loads(made.content[0].text)["sandbox_id"]  # type: ignore[union-attr]
                ran = await client.call_tool("run_command", {"sandbox_id": sid, "command": "id -u", **run})
                out.append(json.loads(ran.content[0].text)["stdout"])  # type: ignore[union-attr]
            return out

    assert anyio.run(session) == ["0\n", "0\n", "1000\n"]


def test_gvisor_root_and_real_owners(state_dir: Path) -> None:
    from .tier_probe import skip_unless_tier

    skip_unless_tier("gvisor", state_dir)
    with Sandbox.create(tier="gvisor", memory="256M") as sb:
        assert sb.commands.run("id -u; stat -c %U:%G /usr/bin/env; stat -c %U ~").stdout == "1000\nroot:root\nuser\n"
        assert sb.commands.run("touch /usr/bin/c13-x").exit_code != 0
        root = _status(sb, "root")
        assert root["uid"] == "0" and root["CapEff:"] == ROOT_MASK
        done = sb.commands.run("echo hi > /usr/bin/c13-x && chown 4242 /usr/bin/c13-x && stat -c %u /usr/bin/c13-x"
                               " && setpriv --reuid=4242 --regid=4242 --clear-groups id -u", user="root")
        assert done.stdout.split() == ["4242", "4242"], done
        sb.files.write("/home/user/by-files-api", "x")  # the files API writes as the default user
        assert sb.commands.run("stat -c %u /home/user/by-files-api").stdout == "1000\n"
    assert not Path("/usr/bin/c13-x").exists()


def test_microvm_defaults_to_uid_1000_root_is_asked_for_and_both_own_their_workspace_files(
        state_dir: Path, tmp_path: Path) -> None:
    """The microVM as the other tiers: uid 1000 with no capability by default, guest root on create
    or per command.  /workspace is a passthrough 9p export from a QEMU that is root of the sandbox's
    uid range (and nothing more): guest uid N is host ``base + N``, so the user writes it, a file
    shows who made it, root's chown is real; write-back gives every file the workspace's owner."""
    from corral.tiers.microvm import MicroVMSandbox
    from corral.tiers.microvm.vmm import VMM_CAPS

    from .tier_probe import skip_unless_tier

    skip_unless_tier("microvm", state_dir)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "given.txt").write_text("host\n")
    for path in (ws, ws / "given.txt"):  # the owner's (another user's file would be read-only inside)
        os.chown(path, 4321, 4322)
    with Sandbox.create(tier="microvm", memory="256M", workspace=str(ws)) as vm:
        user = _status(vm)
        assert user["uid"] == "1000" and user["CapEff:"] == user["CapBnd:"] == "0" * 16, user
        with pytest.raises(InvalidSpec):  # the same values and errors as on the other tiers
            vm.commands.run("id -u", user="admin")
        r = vm.commands.run(
            "stat -c %U:%G /usr/bin/env; stat -c %U ~ /workspace /workspace/given.txt; "
            "echo new > /workspace/new && mkdir /workspace/d && ln -s ../given.txt /workspace/d/link && "
            "echo more >> /workspace/given.txt && touch ~/h && stat -c %u /workspace/new ~/h && "
            "echo x > /workspace/gone && rm /workspace/gone && echo done")
        assert r.stdout == "root:root\nuser\nuser\nuser\n1000\n1000\ndone\n", r
        # the user cannot do root's things: write the image's files, give a file away
        denied = vm.commands.run("for c in 'touch /etc/c13-vm' 'chown 0 /workspace/given.txt' 'chown 0 ~/h' "
                                 "'chmod u+s /usr/bin/env'; do $c 2>/dev/null && echo ALLOWED: $c; done; echo end")
        assert denied.stdout == "end\n", denied
        root = vm.commands.run("id -u; chown 1234:1235 /workspace/given.txt && stat -c %u:%g /workspace/given.txt; "
                               "echo r > /workspace/by-root", user="root")
        assert root.stdout == "0\n1234:1235\n", root
        vm.files.write("/workspace/by-api", "x")  # the files API writes as the default user
        vm.files.write("/home/user/by-api", "x")
        owners = vm.commands.run("stat -c %u /workspace/by-api /home/user/by-api /workspace/by-root")
        assert owners.stdout == "1000\n1000\n0\n", owners
        # on the host: the copy's owners are the range's, QEMU is the range's root with VMM_CAPS only
        inner = vm._inner
        assert isinstance(inner, MicroVMSandbox) and inner.workspace is not None
        base = inner.uid_range.base
        copy = inner.workspace.copy
        assert [os.lstat(copy / n).st_uid - base for n in ("given.txt", "new", "by-root", "d/link")] \
            == [1234, 1000, 0, 1000]
        status = dict(line.split(":", 1) for line in Path(f"/proc/{inner.qemu_pid()}/status").read_text().splitlines())
        assert {int(u) for u in status["Uid"].split()} == {base}, status["Uid"]
        assert status["CapEff"].strip() == status["CapBnd"].strip() == f"{VMM_CAPS:016x}"
        assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
        assert status["Seccomp_filters"].strip() == "2"  # QEMU's own, and the sandboxes' (vmm.launcher)
    # write-back: whoever made a file inside, the host's copy is the workspace directory's owner's
    for path in (ws / "given.txt", ws / "new", ws / "by-root", ws / "by-api", ws / "d", ws / "d" / "link"):
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid) == (4321, 4322), path
    assert (ws / "given.txt").read_text() == "host\nmore\n" and os.readlink(ws / "d" / "link") == "../given.txt"
    assert not (ws / "gone").exists()
    with Sandbox.create(tier="microvm", memory="256M", user="root") as vm:
        assert vm.commands.run("id -u; stat -c %U /home/user").stdout == "0\nuser\n"
        assert _status(vm, "user")["uid"] == "1000"
        vm.files.write("/root/by-api", "x")  # root's sandbox: the files API writes as root
        assert vm.commands.run("stat -c %u /root/by-api").stdout == "0\n"


def test_a_host_that_cannot_idmap_still_runs_sandboxes_with_unmapped_image_files(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from corral.host.mountns import HostMounts, MountNamespace
    from corral.tiers.linux import rootfs

    def unsupported(self: HostMounts, *args: object) -> None:
        raise OSError(errno.EINVAL, "mount_setattr: Invalid argument")

    # in the host's mount namespace (gVisor) and in a sandbox's own (the process tier)
    monkeypatch.setattr(HostMounts, "mapped_overlay", unsupported)
    monkeypatch.setattr(MountNamespace, "mapped_overlay", unsupported)
    monkeypatch.setattr(rootfs, "IDMAP_UNSUPPORTED", None)
    with Sandbox.create(user="root") as sb:
        r = sb.commands.run("id -u; stat -c %U /usr/bin/env; touch /usr/bin/c13-y; echo x > /tmp/t && cat /tmp/t")
        assert r.stdout == "0\nnobody\nx\n" and "Permission denied" in r.stderr, r
    assert rootfs.IDMAP_UNSUPPORTED is not None and "Invalid argument" in rootfs.IDMAP_UNSUPPORTED


@pytest.mark.parametrize("tier", ["process", "gvisor"])
def test_the_user_can_open_its_own_stdin_and_terminal_again(tier: str, state_dir: Path) -> None:
    # the agent (root where it runs) made them: they are handed to the command's user
    from .tier_probe import skip_unless_tier

    if tier != "process":
        skip_unless_tier(tier, state_dir)
    with Sandbox.create(tier=tier, memory="256M") as sb:
        assert sb.commands.run("cat /dev/stdin", stdin="again\n").stdout == "again\n"
        out: list[bytes] = []
        sb.commands.start("echo x > $(tty) && echo tty-ok", pty=(24, 80), on_output=lambda _, b: out.append(b)).wait()
        assert b"tty-ok" in b"".join(out)
