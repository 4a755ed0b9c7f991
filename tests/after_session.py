"""The agent's and the sandbox's walls, checked again at the end of a long session.

Each guarantee below has its own test on a fresh sandbox (the test named with each check); the
team's rule is that it holds for the 300th command too, after timeouts, OOM kills, killed and
left background commands, PTY commands and file requests.  ``test_session_containment.py`` calls
:func:`recheck` on the sandbox its long session ran in, so the session is paid once.  The
attacking scripts are the fresh tests' own, imported from their modules.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from corral import Sandbox

from .egress_net import TargetNet
from .test_agent_reach import attack_file_request_children, link_a_terminal_where_the_owner_reads
from .test_egress_relay import AS_USER, FIND_RELAY, KILL_AND_BIND, kill_relay_while_the_user_binds_its_port
from .test_isolation import OPEN_FDS
from .test_side_channels import assert_hosts_proc_counters_masked, assert_own_device_nodes, watch_devices


def descriptors(sb: Sandbox, tier: str, wait_for_spare: Callable[[], object]) -> None:
    """A command starts with its stdio and nothing else, however it is run
    (``test_isolation.py::test_a_command_starts_with_its_stdio_and_no_other_descriptor``)."""
    seen = {}
    wait_for_spare()
    seen["in the placed spare"] = sb.commands.run(OPEN_FDS).stdout
    seen["right after it"] = sb.commands.run(OPEN_FDS).stdout
    seen["background"] = sb.commands.run(OPEN_FDS, background=True).wait().stdout
    seen["root"] = sb.commands.run(OPEN_FDS, user="root").stdout
    seen["terminal"] = sb.commands.start(OPEN_FDS, pty=(24, 80), timeout=30).wait().stdout.replace("\r\n", "\n")
    assert seen == dict.fromkeys(seen, "[]\n"), (tier, seen)


def devices(sb: Sandbox, tier: str) -> None:
    """inotify inside sees only the sandbox's own use of its devices, none of the host's, and no
    other sandbox's start (``test_side_channels.py``); as the user, then as root (one at a time:
    each watcher's own write at its end would be the other's "outside" event).  On the process
    tier the nodes are also still the devices they name."""
    for user in ("user", "root"):
        watch_devices(sb, tier, user)
        assert sb.commands.run("rm /tmp/stop /tmp/ready", user="root").exit_code == 0  # (root's own, once)
    if tier == "process":  # and they are still the devices they name, unchangeable even by root
        assert_own_device_nodes(sb)


def proc_counters(sb: Sandbox) -> None:
    """The process tier's /proc shows neither the host's command line nor its finest live counters,
    and ps, top, free and vmstat still work (``test_side_channels.py::test_the_process_tiers_proc_shows_no_host_wide_counter_nor_the_hosts_command_line``)."""
    assert_hosts_proc_counters_masked(sb)


def terminal(sb: Sandbox) -> None:
    """A terminal the user links where the owner reads never becomes the agent's controlling one
    (``test_agent_reach.py::test_a_terminal_linked_where_the_owner_reads_never_becomes_the_agents``)."""
    link_a_terminal_where_the_owner_reads(sb)


def file_request_children(sb: Sandbox) -> None:
    """gVisor's file-request children cannot be stopped or reached by the default user
    (``test_agent_reach.py::test_the_users_commands_cannot_stop_or_reach_gvisors_file_request_children``)."""
    attack_file_request_children(sb, 20)
    sb.files.remove("/tmp/big")
    sb.files.remove("/tmp/stop")


def _reaches(sb: Sandbox, net: TargetNet, path: str, user: str | None = None) -> None:
    got = sb.commands.run(f"curl -sS -m 10 http://{net.target}:8080/{path}", timeout=30, user=user)
    assert got.stdout == "hello from target\n", (path, user, got)
    assert path in {h["path"].lstrip("/") for h in net.hits()}


def relay(sb: Sandbox, net: TargetNet) -> None:
    """The egress relay runs as uid 65533, out of the user's reach; killed, it is back at once as
    65533 while its port stays pid 1's; the new one holds nothing of pid 1's (a running command's
    stdin still ends) (``test_egress_relay.py``, ``test_agent_reach.py``)."""
    sb.files.write("/tmp/as_user.py", AS_USER)
    sb.files.write("/tmp/kill_and_bind.py", KILL_AND_BIND)
    sb.files.write("/tmp/find_relay.py", FIND_RELAY + "print(relay())\n")
    found = sb.commands.run("python3 /tmp/find_relay.py", user="root", timeout=30)
    assert found.exit_code == 0 and found.stdout.strip().isdigit(), found
    pid = found.stdout.strip()
    uids = sb.commands.run(f"grep Uid /proc/{pid}/status", user="root").stdout.split()[1:]
    assert uids == ["65533"] * 4, uids
    got = sb.commands.run(f"python3 /tmp/as_user.py {pid} {net.target}", timeout=30)
    assert got.exit_code == 0, got
    report = json.loads(got.stdout)
    assert report["uid"] == 1000 and report["opened"] == [] and report["socket"] == "EACCES", report
    assert report["signals"] == {"0": "EPERM", "SIGSTOP": "EPERM", "SIGKILL": "EPERM"}, report
    _reaches(sb, net, "after-session-user")
    # root kills the relay while a command reads its stdin
    reader = sb.commands.start("cat", timeout=60)
    reader.send_stdin("before ")
    kill_relay_while_the_user_binds_its_port(sb)
    _reaches(sb, net, "after-session-kill-user")
    _reaches(sb, net, "after-session-kill-root", user="root")
    reader.send_stdin("after")
    reader.close_stdin()
    ended = reader.wait()
    assert (ended.exit_code, ended.stdout) == (0, "before after"), ended


def recheck(sb: Sandbox, tier: str, net: TargetNet | None = None,
            wait_for_spare: Callable[[], object] = lambda: None) -> dict[str, float]:
    """Every check that applies to ``tier``; the seconds each took."""
    checks: dict[str, Callable[[], None]] = {}
    if tier in ("process", "gvisor"):
        checks["descriptors"] = lambda: descriptors(sb, tier, wait_for_spare)
        checks["devices"] = lambda: devices(sb, tier)
    if tier == "process":
        checks["proc counters"] = lambda: proc_counters(sb)
    checks["terminal"] = lambda: terminal(sb)
    if tier == "gvisor":
        checks["file request children"] = lambda: file_request_children(sb)
    if net is not None:
        checks["relay"] = lambda: relay(sb, net)
    took = {}
    for name, check in checks.items():
        started = time.monotonic()
        check()
        took[name] = round(time.monotonic() - started, 2)
    print(f"after the session ({tier}), seconds per check: {took}")  # shown by pytest -rP
    return took
