"""Sandboxes by id, embedded and through a server (issue 14, part 2 and its acceptance script).

Create with metadata, list by it, reach it from another process, run a background command and
kill it by pid, run code, kill by id; lifetimes and set_timeout end sandboxes on time.  The one
difference, asserted as such: an embedded sandbox belongs to the process that made it, so
another process gets a typed InvalidState, not the sandbox.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import InvalidSpec, InvalidState, Sandbox

from .server_fixtures import KEYS, ServerProcess


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-by-id", keys=KEYS) as srv:
        yield srv


@pytest.fixture(params=["embedded", "remote"])
def where(request: pytest.FixtureRequest, server: ServerProcess) -> dict[str, Any]:
    return {"url": server.url, "api_key": KEYS["alice"]} if request.param == "remote" else {}


def wait_until(condition: Any, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def acceptance_script(where: dict[str, Any]) -> list[Any]:
    """Issue 14's check, step by step; returns what each step said (ids replaced by names)."""
    said: list[Any] = []
    label = {"run": secrets.token_hex(4)}
    sb = Sandbox.create(metadata=label, **where)
    other = Sandbox.create(metadata={"run": "someone-else"}, **where)
    try:
        said.append(["listed", [i.sandbox_id == sb.sandbox_id for i in Sandbox.list(metadata=label, **where)]])
        said.append(["metadata", sb.get_info().metadata == label, type(sb).__name__])
        # from another process
        script = ("import sys\nfrom corral import Sandbox, InvalidState\n"
                  "try:\n    s = Sandbox.connect(sys.argv[1], **eval(sys.argv[2]))\n"
                  "    print(s.commands.run('echo from-afar').stdout.strip())\n"
                  "except InvalidState as exc:\n    print('InvalidState', 'belongs to live process' in str(exc))\n")
        out = subprocess.run([sys.executable, "-c", script, sb.id, repr(where)], capture_output=True, text=True,
                             timeout=60, env=os.environ.copy())
        said.append(["another process", out.stdout.strip()])
        handle = sb.commands.run("echo started; exec sleep 60", background=True)
        said.append(["background", [c.pid == handle.pid for c in sb.commands.list()]])
        said.append(["killed by pid", sb.commands.kill(handle.pid), handle.wait().exit_code, sb.commands.list()])
        first, second = sb.create_code_context(), sb.create_code_context()
        sb.run_code("n = 2 ** 10", context=first)
        sb.run_code("n = 7", context=second)
        said.append(["contexts", sb.run_code("n", context=first).text, sb.run_code("n", context=second).text])
        said.append(["js", sb.run_code("[1, 2, 3].map((x) => x * 2)", language="js").text])
        said.append(["killed by id", Sandbox.kill(sb.id, **where), Sandbox.list(metadata=label, **where),
                     Sandbox.kill(sb.id, **where), sb.is_running()])
    finally:
        sb.kill()
        other.kill()
    return said


def test_the_acceptance_script_gives_the_same_results_both_ways(server: ServerProcess) -> None:
    embedded = acceptance_script({})
    remote = acceptance_script({"url": server.url, "api_key": KEYS["alice"]})
    # the one difference, asserted as such: an embedded sandbox is driven by the process that owns it
    assert embedded.pop(2) == ["another process", "InvalidState True"]
    assert remote.pop(2) == ["another process", "from-afar"]
    assert embedded == remote == [
        ["listed", [True]], ["metadata", True, "Sandbox"], ["background", [True]],
        ["killed by pid", True, 137, []], ["contexts", "1024", "7"], ["js", "[ 2, 4, 6 ]"],
        ["killed by id", True, [], False, False]]


def test_a_lifetime_and_set_timeout_end_the_sandbox(where: dict[str, Any]) -> None:
    brief = Sandbox.create(lifetime=1, **where)
    extended = Sandbox.create(**where)
    try:
        extended.set_timeout(1.5)
        assert extended.get_info().end_at is not None
        assert wait_until(lambda: not brief.is_running()), "the lifetime did not end it"
        assert wait_until(lambda: not extended.is_running()), "set_timeout did not end it"
    finally:
        brief.kill()
        extended.kill()


def test_bad_lifecycle_input_is_typed(where: dict[str, Any]) -> None:
    for bad in ({"metadata": {"k": 5}}, {"metadata": "x"}, {"lifetime": -1}, {"lifetime": True}):
        with pytest.raises(InvalidSpec):
            Sandbox.create(**bad, **where)
    with Sandbox.create(**where) as sb, pytest.raises(InvalidSpec):
        sb.set_timeout(0)


def test_another_processes_sandbox_is_not_killed_by_id_while_its_owner_lives(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time\nfrom corral import Sandbox\n"
                              "sb = Sandbox.create()\nprint(sb.id, flush=True)\ntime.sleep(120)\n"],
                             stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert owner.stdout is not None
        sandbox_id = owner.stdout.readline().strip()
        with pytest.raises(InvalidState, match="belongs to live process"):
            Sandbox.kill(sandbox_id)
        owner.kill()
        owner.wait()
        assert Sandbox.kill(sandbox_id) is True  # its owner is dead: reaped
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
