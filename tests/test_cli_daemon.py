"""`corral daemon` and `corral run`'s fast path through it (issue 16, CLI speed).

The fast path must be invisible but for speed: the same stdout, stderr and exit
code as the in-process path for every kind of outcome, only for root, and a
daemon that died (kill -9) neither breaks `corral run` nor leaves its warm
sandboxes behind once `corral gc` ran.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from corral.registry import Registry

from .leaks import sandbox_leftovers
from .sandbox_wait import wait_until

#: `make install`'s C launcher (src/corral/cli/launcher.c): its own client of the daemon
CORRAL = str(Path(sys.executable).with_name("corral"))
#: the Python CLI: corral/cli/fast_run.py is its client of the daemon
PYTHON_CLI = [sys.executable, "-m", "corral.cli"]
CLIENTS = {"launcher": [CORRAL], "python": PYTHON_CLI}


@dataclass
class Daemon:
    state: Path
    proc: subprocess.Popen[str]
    log: Path

    @property
    def socket(self) -> Path:
        return self.state / "daemon.sock"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_NO_DAEMON")}
        return {**env, "CORRAL_STATE_DIR": str(self.state), **extra}

    def run(self, *args: str, daemon: bool = True, client: str = "launcher") -> subprocess.CompletedProcess[str]:
        env = self.env() if daemon else self.env(CORRAL_NO_DAEMON="1")
        return subprocess.run([*CLIENTS[client], "run", *args], capture_output=True, text=True, env=env,
                              timeout=120)

    def served(self) -> str:
        return self.log.read_text()


def start_daemon() -> Daemon:
    # not pytest's tmp_path: its 0700 parents would keep the sandboxes' own uids out
    state = Path(tempfile.mkdtemp(prefix="corral-test-daemon-"))
    log = Path(tempfile.mkstemp(prefix="corral-test-daemon-", suffix=".log")[1])
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_URL"}
    proc = subprocess.Popen([CORRAL, "--state-dir", str(state), "daemon", "--pool", "1"],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True, env=env)
    deadline = time.monotonic() + 60
    while True:
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(state / "daemon.sock"))
            break
        except OSError:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the daemon never listened"
            time.sleep(0.05)
        finally:
            probe.close()
    return Daemon(state, proc, log)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon()
    yield d
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(timeout=60)
    assert not d.socket.exists()
    assert Registry.at(d.state).rows() == []  # its warm sandboxes went with it
    shutil.rmtree(d.state, ignore_errors=True)
    d.log.unlink()


CASES = {
    "true": ["--", "true"],
    "false": ["--", "false"],
    "both streams and a code": ["--", "sh", "-c", "echo out; echo err >&2; exit 3"],
    "not found": ["--", "no-such-command-here"],
    "timeout": ["--timeout", "0.5", "--", "sleep", "5"],
    "bad timeout": ["--timeout", "-1", "--", "true"],
    "oom": ["--", "python3", "-c", "b = bytearray(900 << 20)"],
    "no separator": ["echo", "a b", "c"],
}


@pytest.mark.parametrize("client", list(CLIENTS))
@pytest.mark.parametrize("case", list(CASES))
def test_the_fast_path_gives_the_in_process_results(daemon: Daemon, case: str, client: str) -> None:
    args = CASES[case]
    served = daemon.served().count("daemon ran")
    here = daemon.run(*args, daemon=False, client=client)
    there = daemon.run(*args, client=client)
    # the same but for a time measured on each run ("timed out after 0.5 s" and "0.6 s" under load)
    assert (there.returncode, there.stdout, _measured(there.stderr)) == (here.returncode, here.stdout,
                                                                         _measured(here.stderr))
    assert there.returncode == EXPECTED_CODES[case], there.stderr
    if case != "bad timeout":  # refused before anything ran
        assert wait_for(lambda: daemon.served().count("daemon ran") == served + 1), "the daemon did not run it"


def _measured(stderr: str) -> str:
    return re.sub(r"timed out after \d+\.\d s", "timed out after N s", stderr)


EXPECTED_CODES = {"true": 0, "false": 1, "both streams and a code": 3, "not found": 127, "timeout": 124,
                  "bad timeout": 125, "oom": 137, "no separator": 0}


def wait_for(condition: Callable[[], bool], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("client", list(CLIENTS))
def test_json_results_match_and_the_daemon_served_them(daemon: Daemon, client: str) -> None:
    here = json.loads(daemon.run("--json", "--", "sh", "-c", "echo hi; exit 4", daemon=False, client=client).stdout)
    there = json.loads(daemon.run("--json", "--", "sh", "-c", "echo hi; exit 4", client=client).stdout)
    for result in (here, there):
        result.pop("duration_ms")
    assert there.pop("sandbox_id") in daemon.served()
    assert here.pop("sandbox_id") not in daemon.served()
    assert there == here and there["exit_code"] == 4


def test_calls_the_daemon_does_not_handle_run_in_process(daemon: Daemon) -> None:
    before = daemon.served().count("daemon ran")
    out = daemon.run("--memory", "128M", "--", "cat", "/sys/fs/cgroup/memory.max")
    assert daemon.served().count("daemon ran") == before
    assert out.returncode in (0, 1)  # read or not, it ran here: the daemon never saw it


def test_a_request_shorter_than_its_length_runs_nothing(daemon: Daemon) -> None:
    """A client that promised more bytes than it sent (and closed its writing side) had the part
    that came run as its command; it is answered with nothing now, and the daemon goes on."""
    from corral.cli import local_wire

    body = local_wire.encode_request(["sh", "-c", "echo RAN $0"], None)
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(str(daemon.socket))
        client.sendall(local_wire.LENGTH.pack(len(body) + 50) + body)
        client.shutdown(socket.SHUT_WR)
        client.settimeout(30)
        assert local_wire.read_frame(client) is None
    assert daemon.run("--", "echo", "after").stdout == "after\n"


def test_only_root_may_use_the_socket(daemon: Daemon) -> None:
    assert daemon.socket.stat().st_mode & 0o777 == 0o600
    probe = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("refused")
    raise SystemExit
try:
    s.sendall(bytes([5, 0, 0, 0, 0]) + b"true")
    print("reply", s.recv(16))
except (BrokenPipeError, ConnectionResetError):
    print("reply", b"")
"""

    def as_nobody() -> str:
        # Debian's python: the venv's may sit where nobody cannot reach
        out = subprocess.run(["/usr/bin/python3", "-c", probe, str(daemon.socket)], capture_output=True, text=True,
                             user=65534, group=65534, extra_groups=[], timeout=30, cwd="/")
        return out.stdout.strip() or out.stderr

    assert as_nobody() == "refused"
    # with the file mode opened up, the daemon's own peer check still serves no one but root
    before = daemon.served().count("daemon ran")
    os.chmod(daemon.state, 0o711)
    os.chmod(daemon.socket, 0o666)
    try:
        assert as_nobody() == "reply b''"
    finally:
        os.chmod(daemon.socket, 0o600)
        os.chmod(daemon.state, 0o700)
    assert daemon.served().count("daemon ran") == before


FAKE_DAEMON = """
import os, socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1] + "/daemon.sock")
s.listen(8)
print("listening", flush=True)
s.settimeout(60)
while True:
    try:
        conn, _ = s.accept()
    except OSError:
        break
    conn.settimeout(5)
    got = conn.recv(1 << 16)
    if not got:  # connected, and left without a word: what a client that checked does
        conn.close()
        continue
    with open(sys.argv[1] + "/requests", "ab") as f:
        f.write(got + b"\\n")
    conn.sendall(b"o" + struct.pack("<I", 5) + b"FAKE\\n")
    conn.sendall(b"r" + struct.pack("<I", 14) + struct.pack("<i??d", 0, False, False, 1.0))
    conn.close()
"""


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_socket_another_user_made_in_the_state_directory_is_never_used(client: str) -> None:
    """A state directory another user can change (here their own, in /tmp) may hold their
    listener at ``daemon.sock``: root's `corral run` once sent it the command and printed what
    it answered.  Now neither client talks to a listener that is not root's (``SO_PEERCRED``),
    and the in-process path refuses the directory itself."""
    evil = Path(tempfile.mkdtemp(prefix="corral-test-evil-state-"))
    os.chmod(evil, 0o755)
    os.chown(evil, 65534, 65534)
    fake = subprocess.Popen(["/usr/bin/python3", "-c", FAKE_DAEMON, str(evil)], stdout=subprocess.PIPE, text=True,
                            user=65534, group=65534, extra_groups=[], cwd="/")
    try:
        assert fake.stdout is not None and fake.stdout.readline() == "listening\n"
        env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_NO_DAEMON")}
        r = subprocess.run([*CLIENTS[client], "run", "--", "echo", "hi"], capture_output=True, text=True,
                           env={**env, "CORRAL_STATE_DIR": str(evil)}, timeout=120)
        assert "FAKE" not in r.stdout and not (evil / "requests").exists(), r
        assert r.returncode == 125 and "belongs to uid 65534" in r.stderr, r
        assert stat.S_IMODE(evil.stat().st_mode) == 0o755 and evil.stat().st_uid == 65534
    finally:
        fake.kill()
        fake.wait()
        shutil.rmtree(evil)


def test_a_killed_daemon_breaks_nothing_and_gc_reaps_its_sandboxes() -> None:
    d = start_daemon()
    deadline = time.monotonic() + 60
    while not Registry.at(d.state).rows():  # its pool has a warm sandbox
        assert time.monotonic() < deadline
        time.sleep(0.05)
    warm = [row.id for row in Registry.at(d.state).rows()]
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    assert d.socket.exists()  # stale: nobody listens
    gc = subprocess.run([CORRAL, "gc"], capture_output=True, text=True, env=d.env(), timeout=120)
    assert gc.returncode == 0, gc.stderr
    for sandbox_id in warm:
        assert sandbox_id in gc.stdout
        assert sandbox_leftovers(sandbox_id, d.state) == []
    out = d.run("--", "echo", "still works")
    assert (out.returncode, out.stdout) == (0, "still works\n"), out.stderr
    shutil.rmtree(d.state, ignore_errors=True)
    d.log.unlink()


def _remove(d: Daemon) -> None:
    """A test's own daemon, gone: whatever it left reaped, its state directory and log removed."""
    subprocess.run([CORRAL, "gc"], capture_output=True, env=d.env(), timeout=120)
    shutil.rmtree(d.state, ignore_errors=True)
    d.log.unlink()


def _processes_running(argv: list[str]) -> list[int]:
    wanted = "\0".join(argv).encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and Path(f"/proc/{entry}/cmdline").read_bytes() == wanted:
                found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_silent_command_ends_when_its_client_is_interrupted(daemon: Daemon, client: str) -> None:
    """The daemon learned that its client left only when it next forwarded output: a command
    that printed nothing ran on to its timeout after Ctrl-C (as the in-process path does not),
    holding one of the daemon's slots."""
    marker = ["sleep", f"{os.getpid() % 1000 + 7000}.{len(client)}"]  # (a command line of this test's own)
    running = subprocess.Popen([*CLIENTS[client], "run", "--timeout", "60", "--", *marker], env=daemon.env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: _processes_running(marker), 30)
        assert _processes_running(marker), "the command never started"
        running.send_signal(signal.SIGINT)  # Ctrl-C
        running.wait(timeout=30)
        wait_until(lambda: not _processes_running(marker), 10)
        assert _processes_running(marker) == [], "the command outlived its client"
        # and the daemon serves the next run at once
        assert daemon.run("--", "echo", "next", client=client).stdout == "next\n"
    finally:
        running.kill()
        running.wait()


@pytest.mark.parametrize("path", ["in-process", "daemon"])
def test_a_command_whose_reader_left_ends_at_once_with_141_on_both_paths(daemon: Daemon, path: str) -> None:
    """`corral run -- yes | head -1`: in-process the write error was swallowed and the command
    ran on to its timeout, then said it timed out (124); through the daemon it ended at once."""
    env = daemon.env(**({"CORRAL_NO_DAEMON": "1"} if path == "in-process" else {}))
    start = time.monotonic()
    r = subprocess.run(["bash", "-c", f"{CORRAL} run --timeout 30 -- yes | head -1; echo \"${{PIPESTATUS[0]}}\""],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout == "y\n141\n", r
    assert time.monotonic() - start < 15 and "timed out" not in r.stderr, r.stderr


@pytest.mark.parametrize("client", list(CLIENTS))
@pytest.mark.parametrize("path", ["in-process", "daemon"])
def test_a_command_reading_stdin_gets_its_end_at_once_on_both_paths(daemon: Daemon, path: str, client: str) -> None:
    """`echo hi | corral run -- cat`: through the daemon the command's stdin was closed and it
    ended at once (0); in-process it was left open, and `cat` waited out its timeout (124).  Now
    both close it: the command reads end of file (the CLI's own stdin is not forwarded)."""
    start = time.monotonic()
    r = subprocess.run([*CLIENTS[client], "run", "--timeout", "20", "--", "cat"], input="hi\n",
                       capture_output=True, text=True, timeout=60,
                       env=daemon.env(**({"CORRAL_NO_DAEMON": "1"} if path == "in-process" else {})))
    assert (r.returncode, r.stdout) == (0, ""), r
    assert time.monotonic() - start < 15, r


def test_an_in_process_run_ended_by_sigterm_destroys_its_sandbox() -> None:
    """``timeout 5 corral run ...`` sends SIGTERM: the CLI died of it and left its sandbox's run
    dir, cgroups, registry row and uid range until a janitor ran; now it is destroyed on the
    way out, as on Ctrl-C, and the CLI exits 143."""
    state = Path(tempfile.mkdtemp(prefix="corral-test-sigterm-"))
    env = {**{k: v for k, v in os.environ.items() if k != "CORRAL_URL"}, "CORRAL_STATE_DIR": str(state),
           "CORRAL_NO_DAEMON": "1"}
    marker = ["sleep", f"{os.getpid() % 1000 + 8000}.5"]
    try:
        cli = subprocess.Popen([CORRAL, "run", "--", *marker], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_until(lambda: _processes_running(marker), 30)
        rows = Registry.at(state).rows()
        assert _processes_running(marker) and len(rows) == 1
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=30) == 143
        assert Registry.at(state).rows() == []
        assert sandbox_leftovers(rows[0].id, state) == []
    finally:
        subprocess.run([*PYTHON_CLI, "gc"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)


def test_a_stopped_daemon_destroys_the_sandboxes_of_its_runs_and_tells_their_clients() -> None:
    """SIGTERM: the daemon closed its pool's idle members only; a run under way had its
    processes die with the daemon but left its run dir, cgroups and registry row for gc."""
    d = start_daemon()
    marker = ["sleep", f"{os.getpid() % 1000 + 9000}.5"]
    client = subprocess.Popen([CORRAL, "run", "--", *marker], env=d.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _processes_running(marker), 30)
        assert _processes_running(marker)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=60) == 0
        _, err = client.communicate(timeout=60)
        assert client.returncode == 125 and "the daemon stopped" in err, err
        assert _processes_running(marker) == []
        assert Registry.at(d.state).rows() == []  # (no gc ran)
        assert not any((d.state / "sandboxes").iterdir())
    finally:
        client.kill()
        client.wait()
        _remove(d)


def test_a_daemon_stops_when_sigterm_lands_on_a_thread_other_than_its_main_one() -> None:
    """The kernel hands a process's signal to any of its threads; Python runs the handler in
    the main thread, whose accept() nothing interrupted then: a CI run's daemon still accepted a
    minute after its SIGTERM.  Sent here to one other thread (``tgkill``)."""
    import ctypes

    d = start_daemon()
    try:
        # (accept, accept4, or the poll of an accept with a timeout)
        waiting = wait_until(lambda: Path(f"/proc/{d.proc.pid}/syscall").read_text().split()[0]
                             in ("43", "288", "7", "271"), 30)
        assert waiting, "the daemon's main thread never waited for a client"
        time.sleep(0.5)
        others = [int(t) for t in os.listdir(f"/proc/{d.proc.pid}/task") if int(t) != d.proc.pid]
        assert others, "the daemon runs no other thread"
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(234, d.proc.pid, others[0], signal.SIGTERM) == 0  # SYS_tgkill (x86-64)
        assert d.proc.wait(timeout=20) == 0
        assert not d.socket.exists()
    finally:
        d.proc.kill()
        d.proc.wait()
        _remove(d)


@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_command_the_daemon_started_is_never_run_again_when_the_daemon_dies(client: str, as_json: bool) -> None:
    """A client whose daemon went away before the command printed anything ran it again
    in-process (with ``--json``, even after output): a silent command's work was done twice.
    The daemon says when the command started; from then on the client never runs it again."""
    d = start_daemon()
    marker = ["sleep", f"{os.getpid() % 1000 + 10000}.{len(client)}{int(as_json)}"]
    runner = subprocess.Popen([*CLIENTS[client], "run", *(["--json"] if as_json else []), "--", *marker],
                              env=d.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _processes_running(marker), 30)
        first = _processes_running(marker)
        assert first, "the daemon never ran the command"
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        _, err = runner.communicate(timeout=60)
        assert runner.returncode == 125 and "went away while the command ran" in err, (runner.returncode, err)
        assert not [pid for pid in _processes_running(marker) if pid not in first], "the command ran again"
    finally:
        runner.kill()
        runner.wait()
        _remove(d)


def test_the_launcher_imports_nothing_from_the_directory_it_runs_in(tmp_path: Path) -> None:
    """`python -m` puts the working directory first on sys.path, and root runs `corral` in project
    directories a sandbox writes back to (a default `rw` workspace) or a cloned repository fills:
    a corral/__init__.py or an argparse.py there ran as host root before the CLI started."""
    project = tmp_path / "project"
    (project / "corral").mkdir(parents=True)
    marker = tmp_path / "ran-as-host"
    planted = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    for name in ("corral/__init__.py", "argparse.py", "json.py"):
        (project / name).write_text(planted)
    state = Path(tempfile.mkdtemp(prefix="corral-test-launcher-"))
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_URL"}
    try:
        for argv in (["ls"], ["run", "--", "true"]):  # both exec the Python CLI (no daemon runs)
            done = subprocess.run([CORRAL, "--state-dir", str(state), *argv], cwd=project, env=env,
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, (argv, done.stderr)
        assert not marker.exists(), marker.read_text()
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_the_default_timeout_the_clients_assume_is_the_specs() -> None:
    from corral.cli import local_wire
    from corral.spec import Limits

    assert Limits().timeout == local_wire.DEFAULT_TIMEOUT
    assert f"#define DEFAULT_TIMEOUT {local_wire.DEFAULT_TIMEOUT!r}" in Path(
        local_wire.__file__).with_name("launcher.c").read_text()


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_client_whose_daemon_hangs_after_the_start_gives_up_after_timeout_and_grace(client: str) -> None:
    """A daemon that stops answering (stopped here with SIGSTOP) held its client for ever, whatever
    its --timeout.  Once the command started, the client waits for each frame at most the
    command's timeout and ANSWER_GRACE; then it says so (125)."""
    from corral.cli import local_wire

    d = start_daemon()
    marker = ["sleep", f"{os.getpid() % 1000 + 11000}.{len(client)}"]
    runner = subprocess.Popen([*CLIENTS[client], "run", "--timeout", "1", "--", *marker], env=d.env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _processes_running(marker), 30)
        assert _processes_running(marker)
        d.proc.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        _, err = runner.communicate(timeout=60)
        waited = time.monotonic() - start
        assert runner.returncode == 125 and "said nothing" in err, (runner.returncode, err)
        assert waited < 1 + local_wire.ANSWER_GRACE + 5, waited
    finally:
        d.proc.send_signal(signal.SIGCONT)
        runner.kill()
        runner.wait()
        d.proc.kill()
        d.proc.wait()
        _remove(d)
