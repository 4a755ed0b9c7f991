"""What a command inside can do to the agent that carries out its owner's requests.

The agent serves the owner alone: a command (the default user's above all) must not be able to
stop, end or speak for it.  Two ways it could, both found by attacking it:

* gVisor has no fsuid, so each file request runs in a child of the agent that takes the default
  user's ids.  With all three of its uids the user's, the user's commands could signal it: a
  SIGSTOP held the agent (it waits for the child) and every later call failed.
* The agent opened the paths the owner names without ``O_NOCTTY``: a terminal the sandbox linked
  at such a path became the agent's controlling terminal, and on the microVM (whose agent leads
  a session, not pid 1 of a namespace) the sandbox's ^C then ended the agent and the sandbox.
* A relay started again by pid 1 (``network="allow"``, test_egress_relay.py) held pid 1's
  descriptors: a running command's stdin never ended.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral.errors import FileError

from .tier_probe import skip_unless_tier

sys.path.insert(0, str(Path(__file__).parent))
from egress_net import TargetNet, target_net

#: as the default user: try to stop every agent process but pid 1 (the file requests' children)
#: and to open their descriptors, until /tmp/stop appears; prints what each attempt met
STOPPER = r"""
import errno, json, os, signal, time
seen, kills, opens = set(), {}, {}
deadline = time.monotonic() + 60
while not os.path.exists("/tmp/stop") and time.monotonic() < deadline:
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in (1, os.getpid()) or pid in seen:
            continue
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if comm.read().strip() not in ("agent", "corral-agent"):
                    continue
            os.kill(int(pid), signal.SIGSTOP)
            kills["sent"] = kills.get("sent", 0) + 1
        except PermissionError:
            kills["EPERM"] = kills.get("EPERM", 0) + 1
        except (FileNotFoundError, ProcessLookupError):
            continue
        seen.add(pid)
        try:
            os.close(os.open(f"/proc/{pid}/fd/1", os.O_WRONLY | os.O_NONBLOCK))
            opens["opened"] = opens.get("opened", 0) + 1
        except OSError as exc:
            opens[errno.errorcode[exc.errno]] = opens.get(errno.errorcode[exc.errno], 0) + 1
print(json.dumps({"children": len(seen), "kills": kills, "opens": opens}))
"""


def attack_file_request_children(sb: Sandbox, reads: int) -> None:
    """The default user's STOPPER against the children of ``reads`` 20 MB file reads: each read
    comes back whole and in time, every signal was EPERM, no descriptor opened, the sandbox
    answers, and the children still act as the user."""
    assert sb.commands.run("head -c 20000000 /dev/urandom > /tmp/big").exit_code == 0
    sb.files.write("/tmp/stopper.py", STOPPER)
    stopper = sb.commands.run("python3 /tmp/stopper.py", background=True, timeout=90)
    time.sleep(0.5)
    for _ in range(reads):  # each read is a child of the agent for ~0.1 s
        started = time.monotonic()
        assert len(sb.files.read("/tmp/big", format="bytes", max_bytes=32 << 20)) == 20_000_000
        assert time.monotonic() - started < 20
    sb.files.write("/tmp/stop", "")
    result = stopper.wait()
    assert result.exit_code == 0, result
    met = json.loads(result.stdout)
    assert met["children"] >= 1, met  # the children were there to be attacked
    assert met["kills"] == {"EPERM": met["children"]}, met
    assert "opened" not in met["opens"], met
    assert sb.commands.run("echo alive").stdout == "alive\n"
    # the children still act as the user: what they make is the user's
    sb.files.write("/tmp/mine", "x")
    assert sb.commands.run("stat -c %u /tmp/mine").stdout == "1000\n"


def test_the_users_commands_cannot_stop_or_reach_gvisors_file_request_children(state_dir: Path) -> None:
    skip_unless_tier("gvisor", state_dir)
    with Sandbox.create(tier="gvisor") as sb:
        attack_file_request_children(sb, 30)


#: as the default user: link a terminal it holds where the owner will read, wait, then ^C and
#: hang up on it
TERMINAL = r"""
import os, pty, time
master, slave = pty.openpty()
os.symlink(os.ttyname(slave), "/tmp/ttylink")
open("/tmp/linked", "w").close()
deadline = time.monotonic() + 30
while not os.path.exists("/tmp/read") and time.monotonic() < deadline:
    time.sleep(0.05)
os.write(master, b"\x03")
time.sleep(0.5)
os.close(slave)
os.close(master)
time.sleep(0.5)
"""

#: the controlling terminal (field 7 of /proc/PID/stat) of every agent process, as root
AGENT_TERMINALS = ("for p in $(pgrep -x corral-agent; pgrep -x agent); do "
                   "sed 's/.*) //' /proc/$p/stat | cut -d' ' -f5; done")


@pytest.mark.parametrize("tier", ["process", "gvisor", "microvm"])
def test_a_terminal_linked_where_the_owner_reads_never_becomes_the_agents(tier: str, state_dir: Path) -> None:
    skip_unless_tier(tier, state_dir)
    with Sandbox.create(tier=tier) as sb:
        link_a_terminal_where_the_owner_reads(sb)


def link_a_terminal_where_the_owner_reads(sb: Sandbox) -> None:
    """TERMINAL as the default user, the owner's read of its link refused, no terminal the agent's,
    and the sandbox answering after the ^C (also checked after the long sessions of
    test_session_containment.py)."""
    sb.files.write("/tmp/terminal.py", TERMINAL)
    attacker = sb.commands.run("python3 /tmp/terminal.py", background=True, timeout=60)
    deadline = time.monotonic() + 30
    while not sb.files.exists("/tmp/linked"):
        assert time.monotonic() < deadline, "the link was never made"
        time.sleep(0.05)
    with pytest.raises(FileError):  # not a file to read
        sb.files.read("/tmp/ttylink")
    terminals = sb.commands.run(AGENT_TERMINALS, user="root").stdout.split()
    assert terminals and set(terminals) == {"0"}, terminals
    sb.files.write("/tmp/read", "")
    assert attacker.wait().exit_code == 0
    for _ in range(3):
        assert sb.commands.run("echo alive", timeout=30).stdout == "alive\n"
    assert sb.files.read("/tmp/terminal.py") == TERMINAL


@pytest.fixture(scope="module")
def net() -> Iterator[TargetNet]:
    with target_net(prefix="arl") as testnet:
        yield testnet


@pytest.mark.parametrize("tier", ["process", "gvisor"])
def test_a_relay_started_again_holds_nothing_of_pid_1s(tier: str, net: TargetNet, state_dir: Path) -> None:
    """A relay root killed is started again by pid 1 (test_egress_relay.py): the new one held pid
    1's descriptors, a running command's stdin among them, which then never saw its end (and on
    gVisor close_range(n, ~0U) closed nothing: EINVAL)."""
    skip_unless_tier(tier, state_dir)
    fetch = "curl -fsS --max-time 10 http://target.test:8080/relay"
    with Sandbox.create(tier=tier, allow=["target.test"], unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        relay = sb.commands.run("for p in /proc/[0-9]*; do [ $(stat -c %u $p) = 65533 ] && basename $p; done")
        assert len(relay.stdout.split()) == 1, relay
        reader = sb.commands.start("cat", timeout=60)
        reader.send_stdin("before ")
        assert sb.commands.run(f"kill -9 {relay.stdout.strip()}", user="root").exit_code == 0
        deadline = time.monotonic() + 15
        while (r := sb.commands.run(fetch, timeout=30)).exit_code != 0:
            assert time.monotonic() < deadline, r
            time.sleep(0.2)
        reader.send_stdin("after")
        reader.close_stdin()
        ended = reader.wait()
        assert (ended.exit_code, ended.stdout) == (0, "before after"), ended  # (held: the timeout)
