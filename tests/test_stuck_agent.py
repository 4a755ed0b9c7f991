"""An agent that reads nothing holds nobody: not its owner's threads for ever, not a server's loop.

The owner writes requests into the agent's pipe (or virtio-serial port).  A write used to block
for as long as the agent did not read, holding the channel's lock: a fifo the sandbox put where
its client wrote a file held the agent in ``open`` for ever, every later command of the sandbox
timed out, and a stdin frame sent over a WebSocket then blocked the server's event loop -- every
tenant's request waited.  Now the agent refuses to write anything but a regular file, a write
gives up after ``WRITE_TIMEOUT``, a kill does not wait for the agent, and the server sends to a
command from a thread.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from websockets.sync.client import connect

import corral.tiers.linux.agent as agent_protocol
from corral import Sandbox
from corral.errors import FileError, SandboxClosed, SandboxPaused, StdinNotTaken

from .server_fixtures import KEYS, ServerProcess


def test_a_write_to_a_fifo_the_sandbox_made_is_refused_and_the_sandbox_works_on() -> None:
    with Sandbox.create() as sb:
        sb.commands.run("mkfifo /home/user/out.txt /home/user/read.txt")
        reader = sb.commands.run("cat /home/user/read.txt", background=True)  # a reader waits on this one
        time.sleep(0.2)
        for path in ("/home/user/out.txt", "/home/user/read.txt", "/dev/null"):
            assert isinstance(_within(5, sb.files.write, path, b"upload"), FileError), path
        reader.kill()
        result = sb.commands.run("echo alive", timeout=10)
        assert result.stdout == "alive\n" and result.exit_code == 0
        sb.files.write("/home/user/file.txt", b"upload")  # allowed: a regular file, new or existing
        sb.files.write("/home/user/file.txt", b"again")
        assert sb.files.read("/home/user/file.txt") == "again"


def _within(seconds: float, fn: Callable[..., object], *args: object) -> BaseException | None:
    """What ``fn(*args)`` raised (None if nothing), failing the test if it takes over ``seconds``."""
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            fn(*args)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)}{args!r:.60} did not return within {seconds} s"
    return outcome[0]


def test_a_file_larger_than_the_read_limit_is_refused_before_it_is_read() -> None:
    """A sparse 100 GB file the sandbox made where its client reads: refused at once (before, the
    agent read and sent it all, the host dropping every byte past its limit, and the sandbox
    answered nothing else meanwhile); a file within the limit is read whole."""
    with Sandbox.create() as sb:
        sb.commands.run("truncate -s 100G /home/user/big; head -c 70000 /dev/urandom > /home/user/fits")
        refused = _within(5, sb.files.read, "/home/user/big")
        assert isinstance(refused, FileError) and refused.errno == errno.EFBIG, refused
        assert len(sb.files.read("/home/user/fits", "bytes")) == 70000
        assert sb.commands.run("echo alive", timeout=5).stdout == "alive\n"


def _agent_host_pid(sb: Sandbox) -> int:
    return int(sb._backend.inner._agent_host_pid())  # type: ignore[attr-defined]


def test_a_stopped_agent_makes_writes_fail_in_time_and_a_kill_need_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent stopped (SIGSTOP from the host: it reads nothing, answers nothing, never exits):
    stdin to its command fails within WRITE_TIMEOUT, killing the command needs no answer, and the
    sandbox is destroyed (the agent's stuck read left behind: before, destroy waited for it)."""
    monkeypatch.setattr(agent_protocol, "WRITE_TIMEOUT", 1.0, raising=False)
    sb = Sandbox.create()
    agent = _agent_host_pid(sb)
    try:
        command = sb.commands.run("sleep 60", background=True)
        os.kill(agent, signal.SIGSTOP)

        def feed() -> None:
            for _ in range(8):
                command.send_stdin(b"x" * (1 << 20))

        # the channel's write gives up, or, once the agent's pipe took the first window, the wait
        # for the agent to take it does
        assert isinstance(_within(10, feed), (SandboxClosed, StdinNotTaken))
        assert _within(1, command.kill) is None
        # destroyed while its agent is still stopped (before: waited for the agent for ever)
        assert _within(15, sb.kill) is None
        assert not Path(f"/proc/{agent}").exists() or "Z" in Path(f"/proc/{agent}/stat").read_text().split()[2]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent, signal.SIGCONT)
        sb.kill()


def _descendants_named(root: int, name: str) -> list[int]:
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(fields[1])
                names[int(entry.name)] = (entry / "comm").read_text().strip()
            except (OSError, IndexError, ValueError):
                continue

    def below(pid: int) -> bool:
        for _ in range(64):
            pid = parents.get(pid, 0)
            if pid == root:
                return True
            if pid <= 1:
                return False
        return False

    return [pid for pid, comm in names.items() if comm == name and below(pid)]


@pytest.fixture
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-stuck-agent", keys=KEYS) as srv:
        yield srv


def test_a_stuck_agent_does_not_hold_the_servers_loop(server: ServerProcess) -> None:
    """alice's sandbox's agent reads nothing (stopped); she streams stdin to a command in it: bob
    is answered meanwhile (before: the loop blocked in the write and bob waited with everyone)."""
    assert server.proc is not None
    with server.client("alice") as alice, server.client("bob") as bob:
        sid = alice.post("/v1/sandboxes", json={"limits": {"memory": "128M"}}).json()["id"]
        bob_sid = bob.post("/v1/sandboxes", json={"limits": {"memory": "128M"}}).json()["id"]
        url = server.url.replace("http", "ws") + f"/v1/sandboxes/{sid}/exec/stream"
        with connect(url, additional_headers=server.headers("alice"), close_timeout=1) as ws:
            ws.send(json.dumps({"cmd": "sleep 60", "timeout": 90}))
            assert json.loads(ws.recv(timeout=10))["type"] == "started"
            (agent,) = [pid for pid in _descendants_named(server.proc.pid, "agent") if _in_sandbox(sid, pid)]
            os.kill(agent, signal.SIGSTOP)
            try:
                chunk = base64.b64encode(b"x" * (1 << 20)).decode()
                for _ in range(4):
                    ws.send(json.dumps({"type": "stdin", "data_b64": chunk}))
                time.sleep(0.5)
                started = time.monotonic()
                assert bob.get("/healthz", timeout=10).status_code == 200
                answer = bob.post(f"/v1/sandboxes/{bob_sid}/exec", json={"cmd": "echo bob"}, timeout=10)
                assert answer.json()["stdout"] == "bob\n"
                assert time.monotonic() - started < 2, "bob waited behind alice's stuck sandbox"
            finally:
                os.kill(agent, signal.SIGCONT)
        alice.delete(f"/v1/sandboxes/{sid}", timeout=30)
        bob.delete(f"/v1/sandboxes/{bob_sid}")


def _in_sandbox(sid: str, pid: int) -> bool:
    """Whether host process ``pid`` is ``sid``'s: its cgroup path names the sandbox."""
    try:
        return sid in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def test_a_paused_sandbox_is_frozen_not_stuck(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent reads nothing while its sandbox is paused: stdin sent then is SandboxPaused, as any
    other call is, and a write under way when the pause began waits for the resume however long
    the pause (WRITE_TIMEOUT counts only time unpaused), and the sandbox works on."""
    monkeypatch.setattr(agent_protocol, "WRITE_TIMEOUT", 1.0, raising=False)
    with Sandbox.create() as sb:
        reader = sb.commands.run("cat > /dev/null", background=True)
        sb.pause()
        assert isinstance(_within(5, reader.send_stdin, b"x"), SandboxPaused)
        sb.resume()
        feeder = sb.commands.run("cat > /dev/null", background=True)
        outcome: list[BaseException | None] = []

        def feed() -> None:
            try:
                feeder.send_stdin(b"y" * (256 << 20))
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        writing = threading.Thread(target=feed, daemon=True)
        writing.start()
        time.sleep(0.02)
        sb.pause()  # in the middle of the write
        assert writing.is_alive(), "the write ended before the pause: nothing was tested"
        time.sleep(2.5)  # over twice WRITE_TIMEOUT, paused
        sb.resume()
        writing.join(30)
        assert not writing.is_alive() and outcome == [None], outcome
        assert sb.commands.run("echo alive", timeout=10).stdout == "alive\n"


@pytest.mark.parametrize("tier", ["process", "wasm"])
def test_a_directory_larger_than_a_listing_is_refused_whole_not_cut_short(tier: str) -> None:
    # before: the agent stopped at 100,000 entries and the listing looked complete
    from corral.tiers.base import MAX_LIST_ENTRIES

    make = ("import os\nos.mkdir('/tmp/d')\nopen('/tmp/d/0', 'w').close()\n"  # (links: quick under WASI)
            f"for i in range(1, {MAX_LIST_ENTRIES + 1}): os.link('/tmp/d/0', f'/tmp/d/{{i}}')")
    # (the disk holds what memory leaves room for: 100,001 names need 1G)
    with Sandbox.create(tier=tier, memory="1G") as sb:
        assert sb.commands.run(["python3", "-c", make], timeout=240).exit_code == 0
        with pytest.raises(FileError, match="more than 100,000 entries") as refused:
            sb.files.list("/tmp/d")
        assert refused.value.errno == errno.E2BIG
        sb.files.remove("/tmp/d/1")
        assert len(sb.files.list("/tmp/d")) == MAX_LIST_ENTRIES  # the allowed size: whole


# -- files.write lands whole or not at all -----------------------------------------------------
# Before, the host sent a write in 4 MiB chunks, the first truncating the file and the rest
# appended: a rewrite that filled the disk left part of the new data where the old file was, and
# two writes of one path at once interleaved.  Now each write goes to a temporary file beside the
# target, renamed over it by its last request (the agent's files.c, do_fput; wasm: tiers/wasm/files.py).
WRITE_TIERS = ["process", "gvisor", "wasm"]
_FILL = """import os, sys
with open('/tmp/room', 'wb') as f: f.write(b'r' * int(sys.argv[1]))
try:
    with open('/tmp/fill', 'ab') as f:
        while True: f.write(b'f' * (1 << 16)); f.flush()
except OSError: pass
os.remove('/tmp/room')
"""


def _tier_or_skip(tier: str, state_dir: Path) -> None:
    from .tier_probe import skip_unless_tier

    if tier != "process":
        skip_unless_tier(tier, state_dir)


def _names(sb: Sandbox, path: str) -> list[str]:
    return sorted(entry.name for entry in sb.files.list(path))


@pytest.mark.parametrize("tier", WRITE_TIERS)
def test_a_rewrite_that_fills_the_disk_leaves_the_old_file_and_nothing_beside_it(tier: str, state_dir: Path) -> None:
    _tier_or_skip(tier, state_dir)
    old = b"the old contents\n" * 1000
    with Sandbox.create(tier=tier, disk="64M") as sb:
        sb.files.write("/tmp/keep.txt", old)
        # 6 MiB of room: a 12 MiB write's first chunk (4 MiB) fits and its second does not;
        # then none: a 1 MiB write (one request) fails at once
        for room, size in ((6 << 20, 12 << 20), (0, 1 << 20)):
            assert sb.commands.run(["python3", "-c", _FILL, str(room)], timeout=120).exit_code == 0
            with pytest.raises(FileError) as failed:
                sb.files.write("/tmp/keep.txt", b"n" * size)
            assert failed.value.errno in (errno.ENOSPC, errno.EDQUOT), failed.value
            kept = sb.files.read("/tmp/keep.txt", "bytes")
            assert kept == old, f"{len(kept)} bytes, {kept.count(b'n')} of them new"
            assert _names(sb, "/tmp") == ["fill", "keep.txt"]
        sb.files.remove("/tmp/fill")
        sb.files.write("/tmp/keep.txt", b"n" * (12 << 20))  # with room again: whole
        assert sb.files.read("/tmp/keep.txt", "bytes") == b"n" * (12 << 20)


@pytest.mark.parametrize("tier", WRITE_TIERS)
def test_two_writes_of_one_path_at_once_leave_one_of_them_whole(tier: str, state_dir: Path) -> None:
    _tier_or_skip(tier, state_dir)
    writes = (b"a" * (12 << 20), b"b" * (8 << 20))
    with Sandbox.create(tier=tier) as sb:
        failed: list[BaseException] = []
        together = threading.Barrier(2)

        def write(data: bytes) -> None:
            try:
                together.wait(10)
                sb.files.write("/tmp/same", data)
            except BaseException as exc:
                failed.append(exc)

        for _ in range(20):  # (before, a mix came in many rounds, not in every one)
            threads = [threading.Thread(target=write, args=(data,)) for data in writes]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            assert not failed, failed
            got = sb.files.read("/tmp/same", "bytes")
            assert got in writes, f"{len(got)} bytes: {got.count(b'a')} a, {got.count(b'b')} b"
        assert _names(sb, "/tmp") == ["same"]


@pytest.mark.parametrize("tier", ["process", "gvisor"])
def test_a_replaced_file_keeps_its_mode_and_owner_and_a_link_to_a_file_is_followed(tier: str, state_dir: Path) -> None:
    _tier_or_skip(tier, state_dir)
    with Sandbox.create(tier=tier) as sb:
        sb.commands.run("cd /home/user && echo old > kept && chmod 600 kept && echo t > target"
                        " && ln -s target link && ln -s nowhere dangling && echo ro > ro && chmod 444 ro")
        sb.files.write("/home/user/kept", "new", mode=0o644)  # ``mode`` is a new file's
        assert sb.files.read("/home/user/kept") == "new" and sb.files.stat("/home/user/kept").mode == 0o600
        sb.files.write("/home/user/fresh", "x", mode=0o640)
        assert sb.files.stat("/home/user/fresh").mode == 0o640
        assert sb.commands.run("stat -c %u:%g /home/user/fresh /home/user/kept").stdout == "1000:1000\n" * 2
        sb.files.write("/home/user/link", "through")  # the file a link names is what is replaced
        assert sb.files.read("/home/user/target") == "through" and sb.files.stat("/home/user/link").type == "symlink"
        # a dangling link: its target is made, as open(O_CREAT) and `echo here > dangling` do
        sb.files.write("/home/user/dangling", "here")
        assert sb.files.stat("/home/user/dangling").type == "symlink"
        assert sb.files.read("/home/user/nowhere") == "here"
        sb.commands.run("ln -s /nonexistent/dir/f /home/user/nodir")
        with pytest.raises(FileError):  # a link whose target's directory is missing: as open would
            sb.files.write("/home/user/nodir", "x")
        with pytest.raises(FileError) as refused:  # a file the user may not write stays refused
            sb.files.write("/home/user/ro", "x")
        assert refused.value.errno == errno.EACCES and sb.files.read("/home/user/ro") == "ro\n"
        assert not [name for name in _names(sb, "/home/user") if ".corral-" in name]


def test_a_writer_waiting_when_the_channel_closes_writes_nowhere_else(tmp_path: Path) -> None:
    """close() closed the write descriptor under a writer waiting for the agent to read; the
    writer then wrote its frame to whatever reused the number: a server's registry database
    began with a tenant's frames (every create then failed), another client got foreign bytes.
    The number now stays the channel's, a pipe nobody reads, until no writer can use it."""
    from corral.tiers.linux.frames import T_STDIN

    to_agent_r, to_agent_w = os.pipe()
    from_agent_r, from_agent_w = os.pipe()
    channel = agent_protocol.AgentChannel(from_agent_r, to_agent_w)
    failed: list[BaseException] = []

    def writer() -> None:
        try:
            channel.send(T_STDIN, 1, b"F" * (1 << 20))  # more than the pipe holds: it waits mid-frame
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    time.sleep(0.3)
    os.close(from_agent_w)  # the agent is gone: the reader thread ends
    channel.close()
    reused = [os.open(tmp_path / f"reuse-{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(8)]
    try:
        while thread.is_alive():  # the agent reads again: the writer wakes up
            with contextlib.suppress(BlockingIOError):
                os.set_blocking(to_agent_r, False)
                os.read(to_agent_r, 1 << 16)
            time.sleep(0.01)
            thread.join(0.05)
        written = {path.name: path.stat().st_size for path in tmp_path.iterdir()}
        assert written == {f"reuse-{i}": 0 for i in range(8)}, written
        assert len(failed) == 1 and isinstance(failed[0], SandboxClosed), failed
        assert to_agent_w not in reused  # the channel's number was still its own
    finally:
        for fd in reused:
            os.close(fd)
        os.close(to_agent_r)


class _ForgedAgent:
    """The agent's end of a channel, answering each request with what a microVM guest's root may
    send in its agent's place (it owns the guest's end of the port)."""

    def __init__(self, answer: Callable[[int, int], list[tuple[int, bytes]]]) -> None:
        import socket

        from corral.tiers.linux.frames import HEADER

        self._header = HEADER
        host, self.guest = socket.socketpair()
        self.channel = agent_protocol.AgentChannel(os.dup(host.fileno()), os.dup(host.fileno()))
        host.close()
        self._answer = answer
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = self.guest.recv(n - len(data))
            if not more:
                raise EOFError
            data += more
        return data

    def _serve(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                kind, ident, length = self._header.unpack(self._read(self._header.size))
                self._read(length)
                for answer_kind, payload in self._answer(kind, ident):
                    self.guest.sendall(self._header.pack(answer_kind, ident, len(payload)) + payload)

    def close(self) -> None:
        self.guest.close()
        self.channel.close()


def test_a_forged_agent_answer_is_held_to_the_requests_bounds() -> None:
    """A microVM guest's root answers for its agent, and the host took what it sent: a listing of
    5.5 million forged entries (the owner at 1.8 GB), a read of max_bytes=1024 that returned
    32 MiB (a T_OK was appended unchecked), an unknown kind byte raising UnicodeDecodeError.  Each
    is now held to the request's bounds or is a FileError."""
    import struct

    from corral.tiers.base import MAX_LIST_ENTRIES
    from corral.tiers.linux.frames import T_DATA, T_FLIST, T_FREAD, T_FSTAT, T_OK

    def entry(kind: bytes, name: bytes) -> bytes:
        return struct.pack("<cQIq", kind, 1, 0o644, 0) + name + b"\0"

    many = b"".join(entry(b"f", b"n%d" % i) for i in range(MAX_LIST_ENTRIES + 5))
    answers: dict[str, list[tuple[int, bytes]]] = {
        "/many": [(T_DATA, many), (T_OK, b"")],
        "/huge": [(T_DATA, b"\0" * (32 << 20)), (T_OK, b"\0" * (32 << 20))],
        "/odd": [(T_OK, entry(b"\xff", b"odd") + entry(b"f", b"..") + entry(b"d", b"a/b") + entry(b"f", b"ok"))],
        "/cut": [(T_OK, struct.pack("<cQIq", b"f", 1, 0, 0) + b"no-end")],
    }
    asked: list[bytes] = []

    def answer(kind: int, ident: int) -> list[tuple[int, bytes]]:
        if kind == T_FREAD:
            return [(T_OK, b"x" * (1 << 20))]
        if kind == T_FSTAT:
            return [(T_OK, b"\x01")]
        assert kind == T_FLIST
        return answers[asked.pop(0)]

    agent = _ForgedAgent(answer)
    try:
        for path, errno_ in (("/many", errno.E2BIG), ("/huge", errno.E2BIG), ("/cut", errno.EPROTO)):
            asked.append(path)
            with pytest.raises(FileError) as refused:
                agent.channel.list_dir(path)
            assert refused.value.errno == errno_, (path, refused.value)
        asked.append("/odd")
        assert [(e.name, e.type) for e in agent.channel.list_dir("/odd")] == [("odd", "other"), ("ok", "file")]
        with pytest.raises(FileError, match="larger than the 1024 byte limit"):
            agent.channel.read_file("/f", 1024)
        with pytest.raises(FileError, match="malformed"):
            agent.channel.stat("/f")
    finally:
        agent.close()
