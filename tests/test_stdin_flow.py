"""A command's stdin is flow-controlled, as a pipe is (``STDIN_WINDOW``, agent.h).

The agent used to hold whatever stdin the host sent until the command read it, in the sandbox's
memory and without bound: a client streaming 400 MiB into a command of a 256 MiB sandbox got the
agent (pid 1) OOM-killed and the whole sandbox with it (every later call: ``SandboxClosed``).
Now the host keeps at most 1 MiB per command that the agent has not written to the command, and a
write waits for room: it ends with the command, at the command's timeout, or after
``WRITE_TIMEOUT`` without progress (``StdinNotTaken``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral.errors import StdinNotTaken
from corral.registry import gc
from corral.tiers.linux import agent as agent_protocol

from .server_fixtures import KEYS, ServerProcess

MIB = 1 << 20


@pytest.mark.parametrize("tier", ["process", "gvisor", "microvm"])
def test_stdin_larger_than_the_sandboxs_memory_streams_through_and_the_sandbox_lives(tier: str) -> None:
    with Sandbox.create(tier=tier, memory="256M") as sb:
        # the command reads nothing for a second: the writer waits for it instead of the agent
        # holding the lot
        handle = sb.commands.run("sleep 1; wc -c", background=True, timeout=180)
        chunk = b"x" * MIB
        for _ in range(320):
            handle.send_stdin(chunk)
        handle.close_stdin()
        assert handle.wait().stdout.strip() == str(320 * MIB)
        assert sb.commands.run("echo alive").stdout == "alive\n"


@pytest.mark.parametrize("tier", ["process", "wasm"])
def test_a_command_that_never_reads_its_stdin_still_ends_at_its_timeout(tier: str) -> None:
    # (wasm: a guest in time.sleep, which epoch interruption cannot end, held the host's blocking
    # write of its stdin, and so the run, for the whole 30 s)
    with Sandbox.create(tier=tier) as sb:
        started = time.monotonic()
        result = sb.commands.run(["python3", "-c", "import time; time.sleep(30)"], stdin=b"x" * (8 * MIB), timeout=2)
        assert result.timed_out and time.monotonic() - started < 10
        assert sb.commands.run(["python3", "-c", "print('alive')"]).stdout == "alive\n"


def test_stdin_for_a_command_that_closed_it_is_dropped_without_a_wait() -> None:
    with Sandbox.create() as sb:
        handle = sb.commands.run("exec 0<&-; sleep 3; echo done", background=True, timeout=30)
        started = time.monotonic()
        handle.send_stdin(b"x" * (8 * MIB))
        assert time.monotonic() - started < 2.5  # (it runs on for 3 s more)
        assert handle.wait().stdout == "done\n"


def test_stdin_nobody_takes_fails_in_time_and_the_command_and_sandbox_work_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_protocol, "WRITE_TIMEOUT", 1.0)
    with Sandbox.create() as sb:
        handle = sb.commands.run("sleep 2; wc -c", background=True, timeout=30)
        started = time.monotonic()
        with pytest.raises(StdinNotTaken, match="bytes were not sent"):
            handle.send_stdin(b"x" * (4 * MIB))
        assert time.monotonic() - started < 2
        handle.close_stdin()
        taken = int(handle.wait().stdout)
        assert MIB <= taken < 4 * MIB  # the window it was sent, and the pipe's part of it
        assert sb.commands.run("echo alive").stdout == "alive\n"


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-stdin", keys=KEYS) as srv:
        yield srv


def test_stdin_through_the_server_larger_than_the_sandbox_streams_through(server: ServerProcess) -> None:
    # the REST stdin route holds a body (up to the server's 32 MiB), the agent only its window:
    # six bodies of 30 MiB into a 64 MiB sandbox
    with server.client("alice") as client:
        made = client.post("/v1/sandboxes", json={"limits": {"memory": "64M"}})
        assert made.status_code == 201, made.text
        sandbox_id = made.json()["id"]
        try:
            started = client.post(f"/v1/sandboxes/{sandbox_id}/commands",
                                  json={"cmd": "sleep 1; wc -c > /tmp/n.part; mv /tmp/n.part /tmp/n", "timeout": 120})
            assert started.status_code == 201, started.text
            pid = started.json()["pid"]
            for last in [False] * 5 + [True]:
                fed = client.post(f"/v1/sandboxes/{sandbox_id}/commands/{pid}/stdin", params={"close": last},
                                  content=b"x" * (30 * MIB), timeout=120)
                assert fed.status_code == 204, fed.text
            deadline = time.monotonic() + 60
            while True:
                counted = client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "cat /tmp/n 2>/dev/null"})
                assert counted.status_code == 200, counted.text  # (the sandbox lives)
                if counted.json()["stdout"] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert counted.json()["stdout"].strip() == str(180 * MIB)
        finally:
            client.delete(f"/v1/sandboxes/{sandbox_id}")


def test_the_remote_sdk_sends_stdin_of_any_size(server: ServerProcess) -> None:
    # more than a request body holds (32 MiB) and more than the sandbox's memory, each way the
    # SDK sends stdin: in a run's call, over the exec stream, at a background start, by pid
    data = b"y" * (72 * MIB)
    with Sandbox.create(memory="64M", url=server.url, api_key=KEYS["alice"]) as sb:
        assert sb.commands.run("wc -c", stdin=data, timeout=120).stdout.strip() == str(72 * MIB)
        streamed = sb.commands.run("wc -c", stdin=data, timeout=120, on_stdout=lambda _: None)
        assert streamed.stdout.strip() == str(72 * MIB)
        handle = sb.commands.run("sleep 1; wc -c > /tmp/n.part; mv /tmp/n.part /tmp/n", background=True,
                                 stdin=data, timeout=120)
        handle.send_stdin(data)
        handle.close_stdin()
        deadline = time.monotonic() + 60
        while not sb.files.exists("/tmp/n") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sb.files.read("/tmp/n").strip() == str(144 * MIB)


def test_the_async_remote_sdk_sends_stdin_of_any_size(server: ServerProcess) -> None:
    import asyncio

    from corral import AsyncSandbox

    data = b"z" * (40 * MIB)

    async def session() -> None:
        async with await AsyncSandbox.create(url=server.url, api_key=KEYS["alice"], memory="64M") as sb:
            assert (await sb.commands.run("wc -c", stdin=data, timeout=120)).stdout.strip() == str(40 * MIB)
            handle = await sb.commands.run("wc -c > /tmp/n.part; mv /tmp/n.part /tmp/n", background=True,
                                           stdin=data, timeout=120)
            await handle.close_stdin()
            deadline = time.monotonic() + 60
            while not await sb.files.exists("/tmp/n") and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert (await sb.files.read("/tmp/n")).strip() == str(40 * MIB)

    asyncio.run(session())


def test_a_kill_on_the_exec_stream_is_not_held_behind_stdin_the_command_does_not_take(server: ServerProcess) -> None:
    """The exec stream's stdin is flow-controlled per stream (``stdin_window``, acks): before,
    stdin a command was slow to take filled the connection, a kill sent meanwhile waited behind
    it (here until the command's timeout), and so did the answer to the server's keepalive
    ping: the stream, and the command with it, died after 40 s (``sleep 45; wc -c`` with 32 MiB
    of stdin: SandboxClosed "keepalive ping timeout"; now its result after 45.4 s)."""
    with Sandbox.create(url=server.url, api_key=KEYS["alice"]) as sb:
        handle = sb.commands.start("exec sleep 100", timeout=30, on_stdout=lambda _: None)
        feeder = threading.Thread(target=handle.send_stdin, args=(b"x" * (32 * MIB),), daemon=True)
        feeder.start()
        time.sleep(1)  # a window's worth under way, the rest waiting for room
        killed = time.monotonic()
        handle.kill()
        result = handle.wait()
        assert result.exit_code == 137 and time.monotonic() - killed < 10, result
        feeder.join(10)
        assert not feeder.is_alive()  # the writer let go once the stream ended
        # the allowed direction on the same sandbox: all of it reaches a command that reads it
        streamed = sb.commands.run("wc -c", stdin=b"y" * (32 * MIB), timeout=60, on_stdout=lambda _: None)
        assert streamed.stdout.strip() == str(32 * MIB)


def test_the_async_sdks_kill_is_not_held_behind_stdin_either(server: ServerProcess) -> None:
    import asyncio

    from corral import AsyncSandbox

    async def session() -> None:
        async with await AsyncSandbox.create(url=server.url, api_key=KEYS["alice"]) as sb:
            handle = await sb.commands.start("exec sleep 100", timeout=30, on_stdout=lambda _: None)
            feeder = asyncio.ensure_future(handle.send_stdin(b"x" * (32 * MIB)))
            await asyncio.sleep(1)
            killed = time.monotonic()
            await handle.kill()
            result = await handle.wait()
            assert result.exit_code == 137 and time.monotonic() - killed < 10, result
            await asyncio.wait_for(feeder, 10)

    asyncio.run(session())


def test_stdin_through_an_owner_link_streams_through_and_says_what_was_not_taken(state_dir: Path) -> None:
    # another process's sandbox (Sandbox.connect): the owner writes the stdin its link receives
    script = ("import time\nfrom corral import Sandbox\nfrom corral.tiers.linux import agent\n"
              "agent.WRITE_TIMEOUT = 1.0\nsb = Sandbox.create(memory='64M')\nprint(sb.id, flush=True)\n"
              "time.sleep(120)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        sb = Sandbox.connect(owner.stdout.readline().strip())
        counter = sb.commands.run("sleep 1; wc -c > /tmp/n.part; mv /tmp/n.part /tmp/n", background=True, timeout=60)
        for _ in range(96):
            counter.send_stdin(b"x" * MIB)
        counter.close_stdin()
        deadline = time.monotonic() + 60
        while not sb.files.exists("/tmp/n") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sb.files.read("/tmp/n").strip() == str(96 * MIB)  # more than the sandbox's memory
        sleeper = sb.commands.run("sleep 30", background=True, timeout=60)
        sleeper.send_stdin(b"x" * (4 * MIB))  # the owner's write gives up after its 1 s
        time.sleep(3)
        with pytest.raises(StdinNotTaken, match="bytes were not sent"):
            sleeper.send_stdin(b"y")
        sleeper.kill()  # the link's controls go on
        assert sleeper.wait().signal == 9
        assert sb.commands.run("echo alive").stdout == "alive\n"
    finally:
        owner.kill()
        owner.wait()
        gc(state_dir)  # the killed owner's sandbox, as an operator's `corral gc` would


def test_through_an_owner_link_stdin_of_any_size_arrives_and_a_kill_is_not_held_behind_it(state_dir: Path) -> None:
    """Over an owner link, stdin went in one frame per call: 80 MiB in one ``send_stdin`` was
    over the owner's 96 MiB frame (base64), which refused it and stopped reading the call; the
    caller saw ``ConnectionLost`` after 60 s and the command its timeout.  And the owner wrote
    stdin on the call's control thread, so a kill behind stdin the command did not take waited
    for the command's timeout (124 after 29 s).  Now stdin goes in acknowledged 4 MiB frames
    within the owner's window, written on a thread of its own."""
    script = ("import time\nfrom corral import Sandbox\nsb = Sandbox.create(memory='128M')\n"
              "print(sb.id, flush=True)\ntime.sleep(120)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        sb = Sandbox.connect(owner.stdout.readline().strip())
        data = b"x" * (80 * MIB)
        counter = sb.commands.run("wc -c", background=True, timeout=60)
        counter.send_stdin(data)
        counter.close_stdin()
        assert counter.wait().stdout.strip() == str(80 * MIB)
        assert sb.commands.run("wc -c", stdin=data, timeout=60).stdout.strip() == str(80 * MIB)
        for background in (True, False):
            sleeper = (sb.commands.run("exec sleep 100", background=True, timeout=30) if background
                       else sb.commands.start("exec sleep 100", timeout=30))
            feeder = threading.Thread(target=sleeper.send_stdin, args=(data,), daemon=True)
            feeder.start()
            time.sleep(1)
            killed = time.monotonic()
            sleeper.kill()
            assert sleeper.wait().exit_code == 137 and time.monotonic() - killed < 10
            feeder.join(10)
            assert not feeder.is_alive()
        assert sb.commands.run("echo alive").stdout == "alive\n"
    finally:
        owner.kill()
        owner.wait()
        gc(state_dir)


def test_a_run_whose_command_takes_none_of_its_stdin_is_ended_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # run(stdin=...) gets the command all its input or ends it: not a result made from part of it,
    # nor a command left running until its timeout
    monkeypatch.setattr(agent_protocol, "WRITE_TIMEOUT", 1.0)
    with Sandbox.create() as sb:
        started = time.monotonic()
        with pytest.raises(StdinNotTaken):
            sb.commands.run("sleep 20; wc -c", stdin=b"x" * (4 * MIB), timeout=60)
        assert time.monotonic() - started < 10
        assert sb.commands.list() == []
        assert sb.commands.run("echo alive").stdout == "alive\n"
