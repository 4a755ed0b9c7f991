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


def test_the_acceptance_script(where: dict[str, Any]) -> None:
    label = {"run": secrets.token_hex(4)}
    sb = Sandbox.create(metadata=label, **where)
    other = Sandbox.create(metadata={"run": "someone-else"}, **where)
    try:
        assert [i.sandbox_id for i in Sandbox.list(metadata=label, **where)] == [sb.sandbox_id]
        assert sb.get_info().metadata == label
        # from another process
        script = ("import sys\nfrom corral import Sandbox, InvalidState\n"
                  "try:\n    s = Sandbox.connect(sys.argv[1], **eval(sys.argv[2]))\n"
                  "    print(s.commands.run('echo from-afar').stdout.strip())\n"
                  "except InvalidState as exc:\n    print('InvalidState', 'belongs to live process' in str(exc))\n")
        out = subprocess.run([sys.executable, "-c", script, sb.id, repr(where)], capture_output=True, text=True,
                             timeout=60, env=os.environ.copy())
        expected = "from-afar" if where else "InvalidState True"
        assert out.stdout.strip() == expected, out.stderr
        handle = sb.commands.run("exec sleep 60", background=True)
        assert sb.commands.kill(handle.pid) is True
        assert sb.run_code("2 ** 10").text == "1024"
        assert Sandbox.kill(sb.id, **where) is True
        assert Sandbox.list(metadata=label, **where) == []
        assert Sandbox.kill(sb.id, **where) is False
    finally:
        sb.kill()
        other.kill()


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
