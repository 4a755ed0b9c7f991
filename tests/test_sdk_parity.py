"""The embedded and the remote SDK behave the same where they used to differ (issue 14, its bugs).

Each check runs against ``Sandbox.create()`` and against a sandbox of a real
``corral serve`` on loopback: ``files.read(max_bytes=)``, ``make_dir(mode=)``,
binary stdin, ``run_code``, ``sandbox_id``, and an unknown keyword argument to
``create`` (a typed ``InvalidSpec`` naming it, not Python's ``TypeError``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import FileError, InvalidSpec, Sandbox
from corral.client import RemoteSandbox

from .server_fixtures import KEYS, ServerProcess


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-parity", keys=KEYS) as srv:
        yield srv


@pytest.fixture(params=["embedded", "remote"])
def sandbox(request: pytest.FixtureRequest, server: ServerProcess) -> Iterator[Any]:
    if request.param == "embedded":
        sb: Any = Sandbox.create()
    else:
        sb = RemoteSandbox.create(url=server.url, api_key=KEYS["alice"])
    with sb:
        yield sb


def test_read_honours_max_bytes(sandbox: Any) -> None:
    sandbox.files.write("/tmp/f", b"x" * 100)
    assert sandbox.files.read("/tmp/f", format="bytes", max_bytes=100) == b"x" * 100
    with pytest.raises(FileError, match="larger than"):
        sandbox.files.read("/tmp/f", max_bytes=10)


def test_make_dir_honours_mode(sandbox: Any) -> None:
    sandbox.files.make_dir("/tmp/private", mode=0o700)
    assert sandbox.files.stat("/tmp/private").mode & 0o777 == 0o700


def test_a_file_mode_is_applied_or_refused_never_changed_silently(sandbox: Any) -> None:
    sandbox.files.write("/tmp/sticky-x", "x", mode=0o1750)
    assert sandbox.files.stat("/tmp/sticky-x").mode == 0o1750
    for bad in (0o4755, 0o2755, 0o6777):  # setuid / setgid: refused, not dropped
        with pytest.raises(InvalidSpec, match="setuid or setgid"):
            sandbox.files.write("/tmp/suid", "x", mode=bad)
        with pytest.raises(InvalidSpec, match="setuid or setgid"):
            sandbox.files.make_dir("/tmp/suid-dir", mode=bad)
    for bad in (-1, 0o10000, 2**33, "644", True, 0.5):
        with pytest.raises(InvalidSpec, match="not a file mode"):
            sandbox.files.write("/tmp/bad", "x", mode=bad)
        with pytest.raises(InvalidSpec, match="not a file mode"):
            sandbox.files.make_dir("/tmp/bad-dir", mode=bad)
    with pytest.raises(InvalidSpec, match="max_bytes"):
        sandbox.files.read("/tmp/sticky-x", max_bytes=-1)
    assert not sandbox.files.exists("/tmp/suid") and not sandbox.files.exists("/tmp/bad")
    assert not sandbox.files.exists("/tmp/suid-dir") and not sandbox.files.exists("/tmp/bad-dir")


def test_binary_stdin_arrives_byte_for_byte(sandbox: Any) -> None:
    payload = bytes(range(256)) * 4  # not UTF-8
    handle = sandbox.commands.start(["sh", "-c", "od -An -v -tx1 | tr -d ' \\n'"])
    handle.send_stdin(payload)
    handle.close_stdin()
    assert handle.wait().stdout == payload.hex()


def test_run_code_and_sandbox_id(sandbox: Any) -> None:
    assert sandbox.sandbox_id == sandbox.id
    first = sandbox.run_code("x = 20\nx + 1")
    assert first.text == "21" and first.error is None
    assert sandbox.run_code("x * 2").text == "40"  # one interpreter, state kept
    failed = sandbox.run_code("1 / 0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"


@pytest.mark.parametrize("where", ["embedded", "remote"])
def test_an_unknown_argument_is_named(where: str, server: ServerProcess) -> None:
    options: dict[str, Any] = {"url": server.url, "api_key": KEYS["alice"]} if where == "remote" else {}
    with pytest.raises(InvalidSpec, match="memroy"):
        Sandbox.create(memroy="1G", **options)
    if where == "embedded":
        with pytest.raises(InvalidSpec, match="idle_timeout"):
            Sandbox.create(idle_timeout=60)  # only a server tracks use (a lifetime works embedded)


def test_a_background_command_is_found_fed_and_killed_by_pid(sandbox: Any) -> None:
    handle = sandbox.commands.run("read line; echo got $line; exec sleep 60", background=True)
    pid = handle.pid
    assert isinstance(pid, int) and pid > 0
    running = sandbox.commands.list()
    assert [c.pid for c in running] == [pid] and running[0].argv[-1].startswith("read line")
    sandbox.commands.send_stdin(pid, "hi\n")
    outputs: list[bytes] = []
    probe = sandbox.commands.run("sleep 0.5; echo other")  # the sandbox goes on meanwhile
    assert probe.stdout == "other\n"
    assert sandbox.commands.kill(pid) is True
    result = handle.wait(on_output=lambda stream, chunk: outputs.append(chunk))
    assert result.stdout == "got hi\n" and result.exit_code == 137, result
    assert b"".join(outputs) == b"got hi\n"  # attached after the fact: what it printed, replayed
    assert sandbox.commands.kill(pid) is False
    assert sandbox.commands.list() == []


def test_one_class_whichever_transport(sandbox: Any, server: ServerProcess) -> None:
    assert type(sandbox) in (Sandbox, RemoteSandbox) and isinstance(sandbox, Sandbox)
    remote = sandbox.remote
    made = Sandbox.create(url=server.url, api_key=KEYS["alice"]) if remote else Sandbox.create()
    with made:
        assert type(made) is Sandbox and made.remote is remote  # no other class, no type-ignore
        again = Sandbox.connect(made.id, **({"url": server.url, "api_key": KEYS["alice"]} if remote else {}))
        assert type(again) is Sandbox and again.commands.run("echo same").stdout == "same\n"


def test_binary_stdin_to_run_and_to_a_background_command(sandbox: Any) -> None:
    payload = bytes(range(256))  # not UTF-8: base64 over the wire
    assert sandbox.commands.run("od -An -v -tx1 | tr -d ' \\n'", stdin=payload).stdout == payload.hex()
    handle = sandbox.commands.run("od -An -v -tx1 | tr -d ' \\n'", stdin=payload, background=True)
    handle.send_stdin(b"\xff")
    handle.close_stdin()  # by pid over REST too
    assert handle.wait().stdout == payload.hex() + "ff"


def test_a_background_command_takes_a_signal_by_pid(sandbox: Any) -> None:
    handle = sandbox.commands.run("trap 'echo got-term; exit 3' TERM; touch /tmp/trapped; "
                                  "while :; do sleep 0.05; done", background=True)
    deadline = time.monotonic() + 20  # until the trap is set (bounded in time, not in looks: under load
    while not sandbox.files.exists("/tmp/trapped"):  # 200 quick looks were over before the shell began)
        assert time.monotonic() < deadline, "the background shell never set its trap"
        time.sleep(0.02)
    found = sandbox.commands.connect(handle.pid)
    assert found.pid == handle.pid and not found.done
    found.send_signal(15)
    result = found.wait()
    assert (result.exit_code, result.stdout) == (3, "got-term\n")
    with pytest.raises(InvalidSpec, match="no running command"):
        sandbox.commands.connect(handle.pid)


def test_an_exposed_port_is_reached_both_ways(sandbox: Any, server: ServerProcess) -> None:
    import httpx

    sandbox.files.write("/workspace/hello.txt", "served")
    sandbox.commands.run("exec python3 -m http.server 8000 --bind 127.0.0.1 --directory /workspace",
                         background=True)
    exposed = sandbox.ports.expose(8000)
    assert exposed.sandbox_port == 8000 and exposed in sandbox.ports.list()
    # a browser's URL: the forward's own (embedded); none through a server with keys (a browser has no key)
    assert exposed.browser_url == (None if sandbox.remote else exposed.url)
    headers = {"Authorization": f"Bearer {KEYS['alice']}"} if sandbox.remote else {}
    deadline = 50
    for _ in range(deadline):  # until the server in the sandbox listens (bounded)
        try:
            response = httpx.get(exposed.url + "hello.txt", headers=headers, timeout=5)
            if response.status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    assert response.status_code == 200 and response.text == "served"
    if sandbox.remote:  # who reaches a server's port route is the server's decision (keys), not a uid list
        with pytest.raises(InvalidSpec, match="server's URL"):
            sandbox.ports.expose(8000, local_users=["nobody"])
    with pytest.raises(InvalidSpec, match="not a user of this host"):
        sandbox.ports.expose(8000, local_users=["no-such-user-corral"])
    sandbox.ports.close(exposed)
    assert sandbox.ports.list() == []
