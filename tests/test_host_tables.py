"""Kernel tables global to the host, which no cgroup of the sandbox's charges: one sandbox must not fill them.

conntrack: in ``network="open"`` every flow a sandbox opens is tracked in the
host's own table (``nf_conntrack_max``, shared by the host and every sandbox).
Unbounded, one sandbox sprayed 30,000 entries in 0.3 s (the whole table in
~3 s), after which the host drops every new connection.  Each sandbox may hold
:data:`~corral.egress.open_net.CONNTRACK_LIMIT` flows; the rest are dropped and
audited.  Checked both ways: normal use works, the spray is held, and the host
and a second sandbox still open new connections.  About 4 s on 2 cores.

A destroyed sandbox's flows leave the table with it: a killed runsc or VM never
closes its connections, and the host kept each ESTABLISHED for 5 days (its
limit above died with its nft table), so sandboxes made one after another
filled the table.  Checked after ``close`` and after ``corral gc`` of a killed
owner, on every tier with ``open`` mode, while the test network (whose removal
would flush the entries by itself) still lives.  Those six: 20 s here idle, 110 s under load.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from corral import Sandbox
from corral.egress.open_net import CONNTRACK_LIMIT
from egress_net import TargetNet, ip_forwarding, target_net
from leaks import kill_9, run_gc
from tier_probe import skip_unless_tier

SPRAY = """python3 - <<'EOF'
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sent = 0
for port in range(1024, 1024 + {n}):
    try:
        s.sendto(b'x', ('{target}', port)); sent += 1
    except OSError:
        pass
print(sent)
EOF"""


@pytest.fixture
def net() -> Iterator[TargetNet]:
    with ip_forwarding() as sysctl, target_net(prefix="sg") as testnet:
        sysctl.write_text("1")
        yield testnet


def _tracked_to(address: str) -> int:
    """Entries of the host's conntrack table toward ``address`` (a test network's: only ours go there)."""
    with open("/proc/net/nf_conntrack") as table:
        return sum(1 for line in table if f" dst={address} " in line)


def test_one_open_sandbox_cannot_fill_the_hosts_conntrack_table(net: TargetNet) -> None:
    spray = CONNTRACK_LIMIT + 2000
    with Sandbox.create(network="open", unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        ok = sb.commands.run(f"curl -fsS -m 5 http://{net.target}:8080/before")
        assert ok.stdout == "hello from target\n", ok
        sent = sb.commands.run(SPRAY.format(n=spray, target=net.target), timeout=60)
        assert sent.exit_code == 0 and int(sent.stdout) == spray, sent  # the datagrams left the process
        tracked = _tracked_to(net.target)
        assert CONNTRACK_LIMIT - 10 <= tracked <= CONNTRACK_LIMIT + 10, tracked
        assert "conntrack-limit" in {e.rule for e in sb.network.audit()}
        # the held sandbox itself gets no new flow; the host and another sandbox do
        held = sb.commands.run(f"curl -sS -m 2 http://{net.target}:8080/held")
        assert held.exit_code != 0, held
        assert urllib.request.urlopen(f"http://{net.target}:8080/host", timeout=5).status == 200
        with Sandbox.create(network="open", unsafe_allow_ranges=[f"{net.target}/32"]) as other:
            fine = other.commands.run(f"curl -fsS -m 5 http://{net.target}:8080/other")
            assert fine.stdout == "hello from target\n", fine
    assert {"/before", "/host", "/other"} <= {h["path"] for h in net.hits()}
    assert "/held" not in {h["path"] for h in net.hits()}


HELD = 20

HOLD = """import socket, time
held = [socket.create_connection(('{target}', 8080), timeout=10) for _ in range({n})]
print(len(held), flush=True)
time.sleep(600)
"""


def _flows_of(address: str, state: str = "") -> list[str]:
    """Entries of the host's conntrack table ``address`` is an end of (``state``: TCP ones in it)."""
    with open("/proc/net/nf_conntrack") as table:
        return [line for line in table if f"src={address} " in line and f" {state} " in line]


def _wait_held(address: str) -> None:
    """Until the host tracks the sandbox's ``HELD`` connections ESTABLISHED: they work."""
    deadline = time.monotonic() + 60
    while len(_flows_of(address, "ESTABLISHED")) < HELD and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_flows_of(address, "ESTABLISHED")) == HELD, _flows_of(address)


@pytest.fixture(params=["process", "gvisor", "microvm"])
def open_tier(request: pytest.FixtureRequest, state_dir: Path) -> str:
    if request.param != "process":
        skip_unless_tier(request.param, state_dir)
    return str(request.param)


def test_a_closed_open_sandbox_leaves_no_conntrack_entry(net: TargetNet, open_tier: str) -> None:
    sb = Sandbox.create(tier=open_tier, network="open", unsafe_allow_ranges=[f"{net.target}/32"], memory="256M")
    try:
        assert sb.network.open_net is not None
        address = sb.network.open_net.sandbox_addr
        ok = sb.commands.run(f"curl -fsS -m 10 http://{net.target}:8080/tracked")
        assert ok.stdout == "hello from target\n", ok
        sb.commands.run(["python3", "-c", HOLD.format(target=net.target, n=HELD)], background=True, timeout=600)
        _wait_held(address)
    finally:
        sb.close()
    assert _flows_of(address) == []


OWNER = """import time
from corral import Sandbox
sb = Sandbox.create(tier='{tier}', network='open', unsafe_allow_ranges=['{target}/32'], memory='256M')
sb.commands.run(['python3', '-c', {hold!r}], background=True, timeout=600)
print(sb.id, sb.network.open_net.sandbox_addr, flush=True)
time.sleep(600)
"""


def test_an_open_sandbox_of_a_killed_owner_leaves_no_conntrack_entry_after_gc(
        net: TargetNet, open_tier: str) -> None:
    code = OWNER.format(tier=open_tier, target=net.target, hold=HOLD.format(target=net.target, n=HELD))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert owner.stdout is not None
        sandbox_id, address = owner.stdout.readline().split()
        _wait_held(address)
    finally:
        kill_9(owner)
    run_gc(sandbox_id)
    assert _flows_of(address) == []
