"""What a caller of another process's sandbox (``Sandbox.connect`` through its owner,
corral.owner_link) can make the owner hold or wait on.

A caller that stops reading must not hold up the owner's sandbox: its output goes out from a
queue of its own, bounded (``max_output`` per stream), and a caller that takes nothing for
``LINK_SEND_STALL`` is given up.  A caller that reads gets every byte.  The link's connections,
the wait for a request and the bytes of unfinished requests are bounded.  A staging directory
a killed owner left while binding its socket is reaped by gc.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from corral import Sandbox, owner_link
from corral.host.procs import process_start_time
from corral.registry import gc

from .sandbox_wait import wait_until

MiB = 1 << 20

STALLED_CALLER = """
import json, sys, time
from corral import Sandbox
s = Sandbox.connect(sys.argv[1])
got = []
def stall(text):
    got.append(text)
    if len(got) == 1:
        print("stalled", flush=True)
        sys.stdin.readline()  # reads nothing more of its link until told
h = s.commands.run("yes | head -c 100000000", background=True, timeout=60, on_stdout=stall)
try:
    r = h.wait()
    said = ["result", r.exit_code, r.truncated]
except Exception as exc:
    said = ["raised", type(exc).__name__]
print(json.dumps(said + [sum(map(len, got))]), flush=True)
"""


def test_a_caller_that_stops_reading_does_not_hold_up_the_owners_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's own command on the sandbox ends on time, the stalled caller is given up after
    LINK_SEND_STALL (its call ends as at a hangup), and the owner's kill is prompt."""
    monkeypatch.setattr(owner_link, "LINK_SEND_STALL", 3.0, raising=False)
    sb = Sandbox.create(max_output="1M")
    caller = subprocess.Popen([sys.executable, "-c", STALLED_CALLER, sb.id], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert caller.stdout is not None and caller.stdin is not None
        assert caller.stdout.readline().strip() == "stalled"
        time.sleep(1)  # the flood fills the link's buffers, then its queue
        for _ in range(3):
            started = time.monotonic()
            r = sb.commands.run("echo hi", timeout=5)
            took = time.monotonic() - started
            assert (r.stdout, r.exit_code) == ("hi\n", 0) and took < 3, (r, took)
        assert sb.files.read("/etc/hostname") is not None  # file answers come on the same reader
        # given up: nothing of the call waits on the caller any more
        assert wait_until(lambda: not [t for t in threading.enumerate() if t.name == "corral-owner-send"],
                          timeout=3.0 + 15), "the stalled caller's sender still waits"
        caller.stdin.write("\n")
        caller.stdin.flush()
        said = json.loads(caller.stdout.readline())
        # what it had in its buffers, then the end of its call (its background command is the owner's)
        assert said[:2] == ["raised", "ConnectionLost"], said
        assert said[2] < 100_000_000
    finally:
        started = time.monotonic()
        sb.kill()
        took = time.monotonic() - started
        caller.kill()
        caller.wait()
    assert took < 3, f"kill() took {took:.1f} s"


READING_CALLER = """
import json, sys, time
from corral import Sandbox
s = Sandbox.connect(sys.argv[1])
lag = float(sys.argv[2])
out, err = [], []
def slow(text):
    if not out and lag:
        time.sleep(lag)  # behind by more than max_output, for less than LINK_SEND_STALL
    out.append(text)
r = s.commands.run(sys.argv[3], timeout=60, on_stdout=slow, on_stderr=err.append)
h = s.commands.run(sys.argv[3], timeout=60, background=True, on_stdout=out.append)
b = h.wait()
print(json.dumps({"streamed": "".join(out), "stderr": "".join(err), "exit": [r.exit_code, b.exit_code],
                  "truncated": [r.truncated, b.truncated], "kept": r.stdout}))
"""


def read_through_link(sb: Sandbox, lag: float, cmd: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", READING_CALLER, sb.id, str(lag), cmd], capture_output=True,
                         text=True, timeout=120, env=os.environ.copy())
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout))


def test_a_caller_that_reads_gets_all_output_exactly() -> None:
    """The allowed direction: output far over the link's socket buffers, every byte in order."""
    expected = "".join(f"{i}\n" for i in range(1, 400_001))  # 2.7 MB, under max_output
    with Sandbox.create() as sb:
        said = read_through_link(sb, 0, "seq 1 400000; echo done >&2")
    assert said["streamed"] == expected * 2  # the run's, then the background command's
    assert said["kept"] == expected and said["stderr"] == "done\n"
    assert said["exit"] == [0, 0] and said["truncated"] == [False, False]


def test_a_caller_that_falls_behind_loses_the_rest_and_its_result_says_so() -> None:
    """Behind by more than max_output: what was queued arrives, in order, then the result
    (truncated); the owner held no more than that for it meanwhile."""
    with Sandbox.create(max_output="1M") as sb:
        said = read_through_link(sb, 2, "yes | head -c 30000000")
        streamed = str(said["streamed"])
        assert said["exit"] == [0, 0] and said["truncated"] == [True, True]
        assert 0 < len(streamed) < 30_000_000 * 2, len(streamed)
        assert streamed == "y\n" * (len(streamed) // 2)  # a prefix of each: nothing out of order
        assert sb.commands.run("echo still", timeout=5).stdout == "still\n"


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
    daemons = state_dir / ".bind-999999999.1-daemon"  # a killed `corral daemon`'s, beside daemon.sock
    for staging in (live, reused, old_form, new_unknown, daemons):
        staging.mkdir(mode=0o700)
        (staging / "s").touch()
    os.utime(old_form, (time.time() - 3600, time.time() - 3600))
    try:
        gc(state_dir)
        assert not left[0].exists() and not reused.exists() and not old_form.exists() and not daemons.exists()
        assert live.exists() and new_unknown.exists()
    finally:
        for staging in (live, reused, old_form, new_unknown, daemons):
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


# -- the link's own bounds ------------------------------------------------------------------
def answer_of(conn: socket.socket, timeout: float) -> dict[str, object]:
    conn.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return dict(json.loads(data)) if data else {}


REFUSED_CALLER = """
import sys
from corral import Sandbox
try:
    Sandbox.connect(sys.argv[1])
except Exception as exc:
    print(type(exc).__name__)
"""

LINK_CALL = """
import sys
from corral import Sandbox
s = Sandbox.connect(sys.argv[1])
s.files.write("big", b"x" * (6 << 20))
print(s.commands.run("wc -c < big").stdout.strip())
"""


def test_the_link_bounds_connections_the_wait_for_a_request_and_unfinished_requests(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(owner_link, "MAX_LINK_CONNECTIONS", 4, raising=False)
    monkeypatch.setattr(owner_link, "FIRST_FRAME_TIMEOUT", 1.5, raising=False)
    with Sandbox.create() as sb:
        listener = owner_link._listeners[state_dir]
        path = str(owner_link.socket_path(state_dir, os.getpid()))

        def connect() -> socket.socket:
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(path)
            return conn

        def calls() -> int:
            return len([t for t in threading.enumerate() if t.name == "corral-owner-call"])

        idle = [connect() for _ in range(4)]
        connected = time.monotonic()  # (their wait for a request line runs from here)
        try:
            assert wait_until(lambda: calls() == 4)
            refused = connect()  # past the bound: answered at once, without a thread
            started = time.monotonic()
            assert answer_of(refused, 5).get("error") == "resource_limit"
            assert time.monotonic() - started < 1 and calls() == 4
            refused.close()
            out = subprocess.run([sys.executable, "-c", REFUSED_CALLER, sb.id], capture_output=True, text=True,
                                 timeout=60, env=os.environ.copy())
            assert out.stdout.strip() == "ResourceLimit", out.stderr[-2000:]
            # a request line that does not come: the connection is answered and closed on time
            started = time.monotonic()
            assert answer_of(idle[0], 10).get("error") == "invalid_spec"
            # not before FIRST_FRAME_TIMEOUT after the connect (a loaded run's caller above took
            # most of it: measured from the answer's wait, it came in 0.94 s), nor long after
            assert time.monotonic() - connected > 1 and time.monotonic() - started < 5
            assert wait_until(lambda: calls() == 0)
        finally:
            for conn in idle:
                conn.close()
        # unfinished lines: one holds the budget, the next is refused
        monkeypatch.setattr(listener._budget, "total", 8 * MiB)
        holding, second = connect(), connect()
        try:
            holding.sendall(b"x" * (6 * MiB))
            assert wait_until(lambda: listener._budget.used >= 4 * MiB)
            with contextlib.suppress(OSError):  # (refused before it took it all)
                second.sendall(b"x" * (6 * MiB))
            assert answer_of(second, 10).get("error") == "resource_limit"
        finally:
            holding.close()
            second.close()
        assert wait_until(lambda: listener._budget.used == 0)
        # and what the bounds allow still works, from another process
        out = subprocess.run([sys.executable, "-c", LINK_CALL, sb.id], capture_output=True, text=True,
                             timeout=60, env=os.environ.copy())
        assert out.stdout.strip() == str(6 << 20), out.stderr[-2000:]


# -- ports forwarded through the link -------------------------------------------------------
PORTS_CALLER = """
import json, sys
from corral import Sandbox
from corral.errors import ResourceLimit
sb = Sandbox.connect(sys.argv[1])
held = []
for line in sys.stdin:
    what, *rest = line.split()
    if what == "expose":
        held.append(sb.ports.expose(8000, local_users=rest))
        said = held[-1].port
    elif what == "close":
        sb.ports.close(held.pop())
        said = [e.port for e in sb.ports.list()]
    elif what == "churn":
        for _ in range(int(rest[0])):
            sb.ports.close(sb.ports.expose(8000))
        said = len(sb.ports.list())
    else:  # fill: expose until refused
        try:
            while len(held) < 100:
                held.append(sb.ports.expose(8000))
            said = ["none refused", len(held)]
        except ResourceLimit as exc:
            said = [len(sb.ports.list()), str(exc)]
    print(json.dumps(said), flush=True)
"""


class PortsCaller:
    """Another process driving ``sb.ports`` through the owner link, one step per line."""

    def __init__(self, sandbox_id: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", PORTS_CALLER, sandbox_id], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=os.environ.copy())

    def __call__(self, step: str) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(step + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the caller died at {step!r}"
        return json.loads(line)

    def end(self) -> None:
        self.process.kill()
        self.process.wait()


def _served_to_nobody(port: int) -> bytes:
    from .server_fixtures import reply_as_user

    return reply_as_user(65534, port, b"GET /index.html HTTP/1.0\r\n\r\n", whole=True)


def _refused_here(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _serving(sb: Sandbox) -> None:
    sb.commands.start("cd /tmp && echo served > index.html && exec python3 -m http.server 8000 --bind 127.0.0.1",
                      timeout=120)
    assert wait_until(lambda: sb.commands.run("python3 -c \"import socket; socket.create_connection(('127.0.0.1', "
                                              "8000))\"", timeout=10).exit_code == 0)


def test_a_forward_closed_through_the_link_is_closed_in_its_owner() -> None:
    """Another user (uid 65534, let in by ``local_users``) reads the sandbox's server through a
    forward a connected process made, until that process closes it: then the listener is gone from
    the owner (refused).  A forward the caller leaves open closes with the sandbox.  Before: the
    close did nothing over the link, and uid 65534 still read the server after it."""
    sb = Sandbox.create()
    caller = PortsCaller(sb.id)
    try:
        _serving(sb)
        shared = int(caller("expose nobody"))
        kept = int(caller("expose"))
        assert _served_to_nobody(shared).endswith(b"served\n")  # the allowed direction
        assert caller("close") == [shared]  # (the last one made is closed: `kept`)
        assert caller("close") == []
        assert _served_to_nobody(shared) == b"" and _refused_here(shared) and _refused_here(kept)
        left_open = int(caller("expose nobody"))
        assert _served_to_nobody(left_open).endswith(b"served\n")
    finally:
        caller.end()
        sb.kill()
    assert _refused_here(left_open)  # closed with its sandbox


def _owner_holds() -> tuple[int, int]:
    """This process's threads and descriptors."""
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def test_forwards_through_the_link_are_bounded_per_sandbox_and_closed_ones_cost_nothing() -> None:
    """300 expose+close through the link leave the owner's threads and descriptors as they were
    (before: +303 threads, +605 descriptors, 301 listeners); a sandbox keeps at most
    MAX_LINK_FORWARDS open through its link (past it: ResourceLimit), and closing one makes room."""
    with Sandbox.create() as sb:
        caller = PortsCaller(sb.id)
        try:
            assert caller("churn 1") == 0  # the first forward makes the sandbox's connector (a thread, kept)
            threads, descriptors = _owner_holds()
            assert caller("churn 300") == 0
            grew = [a - b for a, b in zip(_owner_holds(), (threads, descriptors), strict=True)]
            assert grew[0] <= 2 and grew[1] <= 4, f"threads, descriptors grew by {grew}"
            said = caller("fill")
            assert isinstance(said, list) and said[0] == owner_link.MAX_LINK_FORWARDS, said
            assert "already has 16 ports forwarded" in said[1]
            assert len(caller("close")) == owner_link.MAX_LINK_FORWARDS - 1
            _serving(sb)
            again = int(caller("expose"))
            assert wait_until(lambda: not _refused_here(again))
        finally:
            caller.end()


# -- callers gone from a running command ----------------------------------------------------
ATTACHER = """
import sys
from corral import Sandbox
sb = Sandbox.connect(sys.argv[1])
if sys.argv[2] == "attach":
    h = sb.commands.connect(int(sys.argv[3]))
else:
    h = sb.commands.run("sleep 120", background=True, timeout=120)
print("attached", h.pid, flush=True)
r = h.wait()
print("ended", r.exit_code, flush=True)
"""


def _attach(sandbox_id: str, how: str, pid: int = 0) -> subprocess.Popen[str]:
    caller = subprocess.Popen([sys.executable, "-c", ATTACHER, sandbox_id, how, str(pid)], stdout=subprocess.PIPE,
                              text=True, env=os.environ.copy())
    assert caller.stdout is not None
    said = caller.stdout.readline().split()
    assert said[:1] == ["attached"], said
    return caller


def _link_threads() -> int:
    """Threads of the link's calls (the follower of a call's controls was unnamed before)."""
    return len([t for t in threading.enumerate()
                if (t.name.startswith("corral-owner-") and t.name != "corral-owner-link") or "_follow_controls" in t.name])


def _sockets() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def test_callers_killed_while_attached_to_a_command_leave_the_owner_as_it_was() -> None:
    """Callers that attached to a running command (``commands.connect(pid)``) or started one in the
    background over the link, then were SIGKILLed: within seconds the owner holds none of their
    threads or connections, the commands run on, and a new caller attaches and gets the result.
    Before: 20 killed attachers held 65 threads and 21 connections of the owner until the command
    ended (128 of them would have made every later call ResourceLimit)."""
    with Sandbox.create() as sb:
        pid = sb.commands.run("sleep 120", background=True, timeout=120).pid
        assert pid is not None
        threads, sockets = _link_threads(), _sockets()
        callers = [_attach(sb.id, "attach", pid) for _ in range(12)] + [_attach(sb.id, "start") for _ in range(4)]
        try:
            assert _link_threads() >= threads + 16  # (what they hold while attached)
        finally:
            for caller in callers:
                caller.kill()
                caller.wait()
        assert wait_until(lambda: _link_threads() == threads and _sockets() == sockets, timeout=5), \
            f"threads {_link_threads()} (was {threads}), sockets {_sockets()} (was {sockets})"
        running = {c.pid for c in sb.commands.list()}
        assert pid in running and len(running) == 5, running  # theirs run on: the owner's now
        caller = _attach(sb.id, "attach", pid)
        try:
            sb.commands.kill(pid)
            assert caller.communicate(timeout=30)[0].split() == ["ended", "137"]  # killed (SIGKILL)
        finally:
            caller.kill()
            caller.wait()
