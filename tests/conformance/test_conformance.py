"""What every tier promises, run against every tier this machine can run, and through both
transports: embedded (this process owns the sandbox) and through a real ``corral serve`` on
loopback (the same ``Sandbox`` class over HTTP and WebSocket).

A tier the machine cannot run is skipped with the reason its probe gave —
never silently passed.  Commands are Python invocations so that the wasm tier
(which has no other programs) runs the same suite.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import InvalidSpec, Sandbox
from corral.spec import tier_names
from corral.tiers import tier_class

from ..leaks import sandbox_leftovers
from ..server_fixtures import KEYS, ServerProcess
from . import stub_tier  # registers the newcomer's tier (tests only)

#: the built-in tiers and every registered one
TIERS = list(tier_names())


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-conformance", keys=KEYS) as srv:
        yield srv


@pytest.fixture(params=["embedded", "server"])
def where(request: pytest.FixtureRequest, tier: str) -> dict[str, Any]:
    """How ``Sandbox.create`` is reached: in this process, or through a server (started once)."""
    if request.param == "embedded":
        return {}
    if tier == stub_tier.NAME:
        pytest.skip("the stub tier is registered in the test process only, not in the server's")
    server: ServerProcess = request.getfixturevalue("server")
    return {"url": server.url, "api_key": KEYS["alice"]}


def py(code: str) -> list[str]:
    return ["python3", "-c", code]


@pytest.fixture(params=TIERS)
def tier(request: pytest.FixtureRequest, state_dir: Path) -> str:
    name: str = request.param
    try:
        availability = tier_class(name).probe(state_dir)
    except Exception as exc:
        pytest.skip(f"tier {name} unavailable: {exc}")
    if not availability.available:
        pytest.skip(f"tier {name} unavailable: {availability.reason}")
    return name


@pytest.fixture
def sb(tier: str, where: dict[str, Any]) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(tier=tier, memory="256M", **where)
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_exit_codes(sb: Sandbox) -> None:
    assert sb.commands.run(py("import sys; sys.exit(0)")).exit_code == 0
    assert sb.commands.run(py("import sys; sys.exit(7)")).exit_code == 7


def test_stdout_and_stderr_are_separate_and_streamed_in_order(sb: Sandbox) -> None:
    seen: list[tuple[float, str, str]] = []
    code = (
        "import sys, time\n"
        "for i in range(3):\n"
        "    print(f'out{i}', flush=True)\n"
        "    print(f'err{i}', file=sys.stderr, flush=True)\n"
        "    time.sleep(0.3)\n"
    )
    start = time.monotonic()
    result = sb.commands.run(
        py(code),
        on_stdout=lambda s: seen.append((time.monotonic() - start, "stdout", s)),
        on_stderr=lambda s: seen.append((time.monotonic() - start, "stderr", s)),
    )
    assert result.stdout == "out0\nout1\nout2\n"
    assert result.stderr == "err0\nerr1\nerr2\n"
    stdout_text = "".join(s for _, stream, s in seen if stream == "stdout")
    assert stdout_text == result.stdout
    # streamed: the first line arrived well before the command ended
    first = min(t for t, stream, _ in seen if stream == "stdout")
    assert first < result.duration_ms / 1000 - 0.3


def test_files_in_and_out(sb: Sandbox) -> None:
    payload = bytes(range(256)) * 100
    sb.files.write("/workspace/blob.bin", payload)
    assert sb.files.read("/workspace/blob.bin", format="bytes") == payload
    r = sb.commands.run(py("print(len(open('/workspace/blob.bin','rb').read()))"))
    assert r.stdout.strip() == str(len(payload))
    sb.commands.run(py("open('/workspace/made.txt','w').write('from inside')"))
    assert sb.files.read("made.txt") == "from inside"
    names = {e.name for e in sb.files.list("/workspace")}
    assert {"blob.bin", "made.txt"} <= names
    sb.files.remove("made.txt")
    assert not sb.files.exists("made.txt")


def test_workspace_is_mounted_and_written_back(tier: str, where: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "input.txt").write_text("hello workspace")
    if where:  # the one asserted difference: a server cannot mount its client's directory
        with pytest.raises(InvalidSpec, match="upload_dir"):
            Sandbox.create(tier=tier, workspace=str(tmp_path), **where)
        return
    with Sandbox.create(tier=tier, workspace=str(tmp_path)) as sb:
        r = sb.commands.run(py("print(open('/workspace/input.txt').read())"))
        assert r.stdout.strip() == "hello workspace"
        sb.commands.run(py("open('/workspace/output.txt','w').write('result')"))
    assert (tmp_path / "output.txt").read_text() == "result"


@pytest.fixture
def host_workspace(where: dict[str, Any], tmp_path: Path) -> Path:
    """An empty host directory to mount at /workspace, inside ``tmp_path`` (embedded only)."""
    if where:
        pytest.skip("a server mounts no client directory (test_workspace_is_mounted_and_written_back)")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return workspace


def test_a_workspace_link_that_climbs_through_another_link_is_not_written_back(
        tier: str, host_workspace: Path, tmp_path: Path) -> None:
    workspace = host_workspace
    (tmp_path / "outside").write_text("HOST-ONLY")
    with Sandbox.create(tier=tier, workspace=str(workspace)) as sb:
        made = sb.commands.run(py(
            "import os; os.chdir('/workspace'); os.makedirs('d/e'); open('in.txt', 'w').write('in')\n"
            "for target, link in (('.', 'a'), ('a/a/../outside', 'esc'), ('../../in.txt', 'd/e/ok'),"
            " ('../sib', 'd/up'), ('../../../outside', 'd/e/high'), ('e/../../outside', 'd/mid')):\n"
            "    os.symlink(target, link)\n"
            "print('made')"))
        assert made.stdout == "made\n", made
    # 'a/a/../outside' reads as 'a/outside', but a -> . makes it climb from the workspace: it
    # led to the host's tmp_path/outside (the sandbox planted /etc/shadow so)
    for escaping in ("esc", "d/e/high", "d/mid"):
        assert not (workspace / escaping).is_symlink(), escaping
    # links that climb first, and no higher than the workspace, are written back
    assert os.readlink(workspace / "d/e/ok") == "../../in.txt" and (workspace / "d/e/ok").read_text() == "in"
    assert os.readlink(workspace / "d/up") == "../sib" and os.readlink(workspace / "a") == "."
    for path in workspace.rglob("*"):
        assert str(path.resolve()).startswith(str(workspace.resolve())), path


def test_write_back_leaves_the_hosts_git_configuration_and_hooks_as_they_were(
        tier: str, host_workspace: Path) -> None:
    workspace = host_workspace
    (workspace / ".git" / "refs" / "heads").mkdir(parents=True)
    (workspace / ".git" / "config").write_text("[core]\n\tbare = false\n")
    (workspace / "sub" / ".git").mkdir(parents=True)
    with Sandbox.create(tier=tier, workspace=str(workspace)) as sb:
        made = sb.commands.run(py(
            "import os, shutil; os.chdir('/workspace')\n"
            "open('.git/config', 'a').write('[core]\\n\\tfsmonitor = touch /tmp/ran\\n')\n"
            "os.makedirs('.git/hooks'); open('.git/hooks/post-checkout', 'w').write('#!/bin/sh\\ntouch /tmp/ran\\n')\n"
            "open('.git/commondir', 'w').write('../evil\\n')\n"
            "os.makedirs('.git/modules/m/hooks'); open('.git/modules/m/config', 'w').write('x')\n"
            "open('.git/modules/m/hooks/pre-commit', 'w').write('x')\n"
            "shutil.rmtree('sub/.git'); open('sub/.git', 'w').write('gitdir: ../evil\\n')\n"
            "os.makedirs('new/.git'); open('new/.git/config', 'w').write('x')\n"
            "open('.git/refs/heads/feature', 'w').write('0' * 40 + '\\n'); open('.git/HEAD', 'w').write('ref: x\\n')\n"
            "open('notes.txt', 'w').write('kept')\n"
            "os.makedirs('bare/objects'); os.makedirs('bare/refs'); os.makedirs('bare/hooks')\n"
            "open('bare/HEAD', 'w').write('ref: refs/heads/main\\n'); open('bare/hooks/post-checkout', 'w').write('x')\n"
            "open('bare/config', 'w').write('[core]\\n\\tfsmonitor = touch /tmp/ran\\n')\n"
            "print('made')"))
        assert made.stdout == "made\n", made
        # the sandbox's own view has what it wrote
        assert "fsmonitor" in sb.files.read(".git/config")
    # what makes the host's git run a program, or read its configuration elsewhere, stays the host's
    assert (workspace / ".git" / "config").read_text() == "[core]\n\tbare = false\n"
    for kept_out in (".git/hooks", ".git/commondir", ".git/modules/m/config", ".git/modules/m/hooks",
                     "new/.git/config", "bare/HEAD", "bare/config", "bare/hooks"):
        assert not (workspace / kept_out).exists(), kept_out
    assert not (workspace / "sub" / ".git").is_file()
    # the rest of a git directory, and of the workspace, is written back
    assert (workspace / ".git/refs/heads/feature").read_text() == "0" * 40 + "\n"
    assert (workspace / ".git/HEAD").read_text() == "ref: x\n"
    assert (workspace / ".git/modules/m").is_dir() and (workspace / "new/.git").is_dir()
    assert (workspace / "notes.txt").read_text() == "kept"
    assert (workspace / "bare/objects").is_dir()  # a bare repository's layout, but no git directory


def test_env_is_passed_and_host_env_is_not(tier: str, where: dict[str, Any]) -> None:
    os.environ["CORRAL_TEST_HOST_SECRET"] = "host-secret-value"
    try:
        with Sandbox.create(tier=tier, env={"FROM_SPEC": "spec-value"}, **where) as sb:
            r = sb.commands.run(py("import os; print(dict(os.environ))"), env={"FROM_CALL": "call-value"})
    finally:
        del os.environ["CORRAL_TEST_HOST_SECRET"]
    assert "spec-value" in r.stdout and "call-value" in r.stdout
    assert "host-secret-value" not in r.stdout


def test_timeout_is_typed_and_sandbox_stays_usable(sb: Sandbox) -> None:
    start = time.monotonic()
    r = sb.commands.run(py("import time; time.sleep(30)"), timeout=1)
    assert r.timed_out and r.exit_code == 124
    assert time.monotonic() - start < 10
    assert sb.commands.run(py("print('still here')")).stdout == "still here\n"


def test_memory_limit_is_reported_as_oom(sb: Sandbox) -> None:
    r = sb.commands.run(py("x = bytearray(1024 * 1024 * 1024); print('allocated')"), timeout=60)
    assert "allocated" not in r.stdout
    assert r.oom_killed or "MemoryError" in r.stderr
    assert r.oom_killed, f"OOM must be typed: {r}"
    assert sb.commands.run(py("print('alive')")).stdout == "alive\n"


def test_nothing_persists_between_sandboxes(tier: str, where: dict[str, Any]) -> None:
    with Sandbox.create(tier=tier, **where) as first:
        first.files.write("/tmp/marker", "x")
        first.files.write("/workspace/marker", "x")
    with Sandbox.create(tier=tier, **where) as second:
        assert not second.files.exists("/tmp/marker")
        assert not second.files.exists("/workspace/marker")


def test_no_host_files_visible(sb: Sandbox) -> None:
    # a name of this run's own: parallel suite runs must not remove each other's canary
    canary = Path(f"/root/corral-canary-{os.getpid()}-{sb.id}.txt")
    canary.write_text("host secret")
    try:
        r = sb.commands.run(py(
            "import os\n"
            f"for p in [{str(canary)!r}, '/etc/shadow']:\n"
            "    try:\n"
            "        print(open(p).read())\n"
            "    except OSError as e:\n"
            "        print('denied', type(e).__name__)\n"
        ))
    finally:
        canary.unlink()
    assert "host secret" not in r.stdout
    assert "root:" not in r.stdout


def test_no_other_user_of_the_host_reaches_the_sandboxs_files(tier: str, state_dir: Path) -> None:
    """What the sandbox writes is its own on the host too: a user of the host who read the
    sandbox's id in ``ps`` read gVisor's ``/tmp`` and workspace under the run directory (0711) and
    wrote into its ``/tmp``. Every file of the sandbox found under its run directory (as root) is
    neither readable nor writable beside by uid 65534."""
    import subprocess

    with Sandbox.create(tier=tier) as sandbox:
        sandbox.files.write("/tmp/probe-t", "t")
        sandbox.files.write("/workspace/probe-w", "w")
        run_dir = state_dir / "sandboxes" / sandbox.id
        found = [Path(top, name) for top, _, names in os.walk(run_dir) for name in names if name.startswith("probe-")]
        for path in found:
            as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            read = subprocess.run([*as_nobody, "cat", str(path)], capture_output=True, text=True)
            planted = subprocess.run([*as_nobody, "sh", "-c", f"echo x > '{path.parent}/planted'"], capture_output=True)
            assert read.returncode != 0 and read.stdout == "", f"uid 65534 read {path}"
            assert planted.returncode != 0, f"uid 65534 wrote beside {path}"
        assert not sandbox.files.exists("/tmp/planted") and not sandbox.files.exists("/workspace/planted")


def test_teardown_leaves_nothing(tier: str, where: dict[str, Any], state_dir: Path) -> None:
    sandbox = Sandbox.create(tier=tier, **where)
    try:
        sandbox.commands.run(py("print(1)"))  # a tier lacking commands is skipped here: still destroy
    finally:
        sandbox.kill()
    owner_state = state_dir / "srv-conformance" if where else state_dir
    assert sandbox_leftovers(sandbox.id, owner_state) == []
