"""Kernel tables global to the host, which no cgroup of the sandbox's charges: one sandbox must not fill them.

conntrack: in ``network="open"`` every flow a sandbox opens is tracked in the
host's own table (``nf_conntrack_max``, shared by the host and every sandbox).
Unbounded, one sandbox sprayed 30,000 entries in 0.3 s (the whole table in
~3 s), after which the host drops every new connection.  Each sandbox may hold
:data:`~corral.egress.open_net.CONNTRACK_LIMIT` flows; the rest are dropped and
audited.  Checked both ways: normal use works, the spray is held, and the host
and a second sandbox still open new connections.  About 4 s on 2 cores.
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from corral import Sandbox
from corral.egress.open_net import CONNTRACK_LIMIT
from egress_net import TargetNet, ip_forwarding, target_net

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
