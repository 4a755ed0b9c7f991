"""Sandboxes by id, embedded and through a server (issue 14, part 2 and its acceptance script).

Create with metadata, list by it, reach it from another process, run a background command and
kill it by pid, run code, kill by id; lifetimes and set_timeout end sandboxes on time.  Another
process drives an embedded sandbox through the process that owns it (corral.owner_link), so the
script says the same both ways; only the owner's uid (or root) may.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import InvalidSpec, Sandbox, SandboxNotFound
from corral.registry import LIFETIME_GRACE, gc

from .leaks import sandbox_leftovers
from .sandbox_wait import wait_until
from .server_fixtures import KEYS, ServerProcess


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-by-id", keys=KEYS) as srv:
        yield srv


@pytest.fixture(params=["embedded", "remote"])
def where(request: pytest.FixtureRequest, server: ServerProcess) -> dict[str, Any]:
    return {"url": server.url, "api_key": KEYS["alice"]} if request.param == "remote" else {}


FROM_AFAR = """
import json, sys
from corral import Sandbox
s = Sandbox.connect(sys.argv[1], **eval(sys.argv[2]))
said = [s.commands.run("echo from-afar").stdout.strip(), s.get_info().sandbox_id == sys.argv[1]]
parts = []
s.commands.run("echo out; echo err >&2", on_stdout=lambda t: parts.append(("o", t)),
               on_stderr=lambda t: parts.append(("e", t)))
said.append(sorted(parts))
s.files.write("afar.txt", "written afar")
said.append(s.files.read("afar.txt"))
h = s.commands.run("exec sleep 60", background=True)
said.append([c.pid == h.pid for c in s.commands.list()])
said.append([s.commands.kill(h.pid), h.wait().exit_code])
said.append(s.run_code("6 * 7").text)
child = s.fork(1)[0]  # embedded: a snapshot taken by the owner, a fork this process owns
said.append(child.files.read("afar.txt"))
child.kill()
print(json.dumps(said))
"""


def acceptance_script(where: dict[str, Any]) -> list[Any]:
    """Issue 14's check, step by step; returns what each step said (ids replaced by names)."""
    said: list[Any] = []
    label = {"run": secrets.token_hex(4)}
    sb = Sandbox.create(metadata=label, **where)
    other = Sandbox.create(metadata={"run": "someone-else"}, **where)
    try:
        said.append(["listed", [i.sandbox_id == sb.sandbox_id for i in Sandbox.list(metadata=label, **where)]])
        said.append(["metadata", sb.get_info().metadata == label, type(sb).__name__])
        # from another process: commands (streamed, background, by pid), files, code
        out = subprocess.run([sys.executable, "-c", FROM_AFAR, sb.id, repr(where)], capture_output=True,
                             text=True, timeout=90, env=os.environ.copy())
        said.append(["another process", json.loads(out.stdout or "null") or out.stderr[-2000:]])
        said.append(["written afar", sb.files.read("afar.txt"), sb.commands.list()])
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
    assert embedded == remote == [
        ["listed", [True]], ["metadata", True, "Sandbox"],
        ["another process", ["from-afar", True, [["e", "err\n"], ["o", "out\n"]], "written afar", [True], [True, 137],
                             "42", "written afar"]],
        ["written afar", "written afar", []], ["background", [True]],
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


OWNER = "import time\nfrom corral import Sandbox\nsb = Sandbox.create()\nprint(sb.id, flush=True)\n" \
        "while sb.is_running():\n    time.sleep(0.05)\nprint('ended', flush=True)\n"


def test_another_processes_sandbox_is_killed_by_id_through_its_owner(state_dir: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert owner.stdout is not None
        sandbox_id = owner.stdout.readline().strip()
        link = state_dir / "owners" / f"{owner.pid}.sock"
        assert stat.S_IMODE(link.stat().st_mode) == 0o600 and stat.S_IMODE(link.parent.stat().st_mode) == 0o700
        assert Sandbox.kill(sandbox_id) is True
        assert owner.stdout.readline().strip() == "ended"  # the owner sees its sandbox gone
        assert owner.wait(30) == 0
        assert not link.exists(), "the owner's link outlived it"
        assert Sandbox.kill(sandbox_id) is False
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_a_killed_owners_sandbox_and_link_are_reaped(state_dir: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert owner.stdout is not None
        sandbox_id = owner.stdout.readline().strip()
        link = state_dir / "owners" / f"{owner.pid}.sock"
        assert link.exists()
    finally:
        owner.kill()
        owner.wait()
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(sandbox_id)  # a dead owner's sandbox is not driven: it is reaped
    assert Sandbox.kill(sandbox_id) is True
    assert not link.exists()


def test_only_the_owners_uid_may_use_its_link(state_dir: Path) -> None:
    """The denied direction: an unprivileged uid of this host cannot reach the link (the
    directory is 0700 root's); root, the owner's uid, can (the acceptance script above)."""
    with Sandbox.create() as sb:
        link = state_dir / "owners" / f"{os.getpid()}.sock"
        probe = ("import os, socket, sys\nos.setgid(65534)\nos.setuid(65534)\n"
                 "s = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1])\n    print('connected')\n"
                 "except PermissionError:\n    print('denied')\n")
        out = subprocess.run([sys.executable, "-c", probe, str(link)], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "denied", out.stderr
        assert sb.is_running()


def test_the_janitor_ends_a_sandbox_whose_stopped_owner_missed_its_lifetime(state_dir: Path) -> None:
    """The owner's timer ends a sandbox at its lifetime; if the owner cannot (stopped here with
    SIGSTOP), ``gc`` does, LIFETIME_GRACE later, and the owner then finds it gone."""
    script = ("import os, signal, time\nfrom corral import Sandbox\nsb = Sandbox.create(lifetime=1)\n"
              "print(sb.id, flush=True)\nos.kill(os.getpid(), signal.SIGSTOP)\n"
              "time.sleep(1.5)\nprint('running' if sb.is_running() else 'gone', flush=True)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env=os.environ.copy())
    try:
        assert owner.stdout is not None
        sandbox_id = owner.stdout.readline().strip()
        assert wait_until(lambda: Path(f"/proc/{owner.pid}/stat").read_text().split(")")[1].split()[0] == "T")
        assert sandbox_id not in gc(state_dir)  # within its lifetime: left alone
        time.sleep(1 + LIFETIME_GRACE)
        assert sandbox_id in gc(state_dir)
        assert sandbox_leftovers(sandbox_id, state_dir) == []
        os.kill(owner.pid, signal.SIGCONT)
        assert owner.stdout.readline().strip() == "gone"
        assert owner.wait(30) == 0
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_a_large_file_crosses_the_owner_link_and_an_oversized_write_is_typed() -> None:
    script = ("import time\nfrom corral import Sandbox\nsb = Sandbox.create()\n"
              "sb.commands.run('head -c 100M /dev/urandom > big; sha256sum big > big.sum')\n"
              "print(sb.id, flush=True)\ntime.sleep(120)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env=os.environ.copy())
    try:
        assert owner.stdout is not None
        sb = Sandbox.connect(owner.stdout.readline().strip())
        data = sb.files.read("big", format="bytes")  # 133 MiB of base64 in one answer
        assert len(data) == 100 << 20
        assert hashlib.sha256(data).hexdigest() == sb.files.read("big.sum").split()[0]
        with pytest.raises(InvalidSpec, match="over"):
            sb.files.write("huge", b"x" * (80 << 20))  # over the link's 96 MiB request cap
        assert sb.commands.run("test -e huge").exit_code == 1
    finally:
        owner.kill()
        owner.wait()


CALLER = """
import sys
from corral import Sandbox
sb = Sandbox.connect(sys.argv[1])
if sys.argv[2] == "stream":
    sb.commands.run("sleep 1000", timeout=600, on_stdout=print)
else:
    sb.commands.run("sleep 1000", timeout=600)
"""


@pytest.mark.parametrize("how", ["blocking", "stream"])
def test_a_command_another_process_runs_through_the_owner_ends_when_that_process_dies(how: str) -> None:
    """Through the owner's link, a caller that died left its command running to its timeout
    (days at most); now its hang-up kills it, as the server's exec does."""
    with Sandbox.create() as sb:
        caller = subprocess.Popen([sys.executable, "-c", CALLER, sb.id, how], env=os.environ.copy())
        try:
            wait_until(sb.commands.list, 30)
            assert [c.argv for c in sb.commands.list()] == [["/bin/sh", "-c", "sleep 1000"]]
        finally:
            caller.kill()
            caller.wait(10)
        wait_until(lambda: not sb.commands.list(), 10)
        assert sb.commands.list() == []
        assert sb.commands.run("pgrep -c -x sleep || true").stdout == "0\n"


USERS_FROM_AFAR = """
import json, sys
from corral import Sandbox
said = []
for sid in sys.argv[1:]:
    s = Sandbox.connect(sid)
    for user in (None, "user", "root"):
        said.append(s.commands.run("id -u", user=user).stdout.strip())
    said.append(s.commands.run("id -u", user="user", background=True).wait().stdout.strip())
    try:
        s.commands.run("id -u", user="admin")
    except Exception as exc:
        said.append(type(exc).__name__)
print(json.dumps(said))
"""


def test_a_commands_user_crosses_the_owner_link() -> None:
    """Another process's ``commands.run(..., user=...)`` on a sandbox this one owns ran as the
    sandbox's own user whatever was asked: ``user="user"`` in a ``user="root"`` sandbox ran as
    root (a caller dropping to uid 1000 for untrusted code got root inside).  Now the user asked
    for is the one the command runs as, foreground and background, and a bad one is typed."""
    with Sandbox.create(user="root") as as_root, Sandbox.create() as as_user:
        out = subprocess.run([sys.executable, "-c", USERS_FROM_AFAR, as_root.id, as_user.id], capture_output=True,
                             text=True, timeout=90, env=os.environ.copy())
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout) == ["0", "1000", "0", "1000", "InvalidSpec",
                                          "1000", "1000", "0", "1000", "InvalidSpec"]
