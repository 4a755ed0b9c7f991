"""An owner holding thousands of descriptors (a server with many sandboxes, connections and
egress tunnels) keeps working: nothing of Corral's waits with ``select(2)``, which cannot watch
a descriptor numbered 1024 or above (Python raises ValueError; libnftables, built with fortify,
aborted the whole process: ``*** bit out of range 0 - FD_SETSIZE on fd_set ***``).

Run in a child process, so that the old abort fails this test instead of ending pytest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

OWNER = r"""
import os, sys
from corral import Sandbox
held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]  # 0..1100 are taken now
# an allow sandbox: its nftables table is loaded, its counters read and its table removed by
# libnftables (in this process), whose netlink socket would be numbered above 1024
with Sandbox.create(allow=["example.invalid"]) as sb:
    assert sb.commands.run("true").exit_code == 0
    sb.network.audit()
    # 8 MiB through the agent's pipe: the writer waits for room many times
    sb.files.write("/tmp/big", b"x" * (8 << 20))
    assert sb.commands.run("stat -c %s /tmp/big").stdout == f"{8 << 20}\n"
# a wasm sandbox: its worker is waited for through a pidfd
with Sandbox.create(tier="wasm") as wasm:
    assert wasm.commands.run(["python3", "-c", "print(6 * 7)"]).stdout == "42\n"
print("done", max(held))
"""


def test_an_owner_holding_over_a_thousand_descriptors_makes_and_ends_sandboxes(tmp_path: Path) -> None:
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[0] == "done" and int(r.stdout.split()[1]) > 1024
