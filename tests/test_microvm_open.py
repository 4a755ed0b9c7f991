"""``network="open"`` in the microVM tier: the guest's virtio-net on a tap bridged to the open mode's veth.

The namespace, veth, NAT, nftables table and NFLOG audit are the process tier's
(``OpenNetwork``); what is the VM's is a tap in that namespace, bridged to the
veth, whose fd QEMU's virtio-net device gets, and the guest taking the
sandbox's address on eth0 after the restore.  Every VM has that device: with
``none``/``allow`` its backend is a port on an empty QEMU hub, and a guest
(a sandbox created with ``user="root"``) that configures eth0 itself reaches nothing.
Each check goes both ways, on the shared test network (``egress_net``; this
area's names start with ``vmopen``).

Cost: ~9 microVMs (restored, ~0.5 s each) and one test network, ~40 s under TCG.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import Sandbox
from corral.egress.open_net import OpenNames
from corral.host import netns
from corral.tiers.microvm import MicroVMSandbox

from .egress_net import METADATA, TargetNet, assert_open_refusals_audited, target_net, udp_sink
from .leaks import run_gc, sandbox_leftovers
from .tier_probe import skip_unless_tier


@pytest.fixture(scope="module", autouse=True)
def _microvm_available(state_dir: Path) -> None:
    skip_unless_tier("microvm", state_dir)


@pytest.fixture(scope="module")
def net() -> Iterator[TargetNet]:
    with target_net(prefix="vmopen") as testnet:
        yield testnet


def _qemu_pid(sb: Sandbox) -> int:
    inner = sb._inner
    assert isinstance(inner, MicroVMSandbox)
    pid = inner.qemu_pid()
    assert isinstance(pid, int)
    return pid


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tap_holders(tap: str) -> list[str]:
    """Processes holding an fd on the tap (a tun fd's fdinfo names its interface)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fdinfo"):
                if f"iff:\t{tap}\n" in Path(f"/proc/{pid}/fdinfo/{fd}").read_text():
                    found.append(pid)
        except OSError:
            continue
    return found


def _network_leftovers(sandbox_id: str) -> list[str]:
    names = OpenNames.for_sandbox(sandbox_id)
    found = [f"tap {names.tap} held by {pid}" for pid in _tap_holders(names.tap)]
    if netns.netns_exists(names.netns):
        found.append(f"netns {names.netns}")
    if netns.link_exists(names.host_if):
        found.append(f"veth {names.host_if}")
    if netns.nft_table_exists("inet", names.table):
        found.append(f"table {names.table}")
    return found


def test_open_mode_reaches_the_allowed_target_and_refuses_and_audits_the_rest(
        net: TargetNet, forwarding_on: None) -> None:
    with Sandbox.create(tier="microvm", network="open", memory="256M",
                        unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        names = OpenNames.for_sandbox(sb.id)
        # the guest's kernel holds the sandbox's address; the namespace's veth end is only bridged
        addr = sb.commands.run("ip -4 -o addr show dev eth0 | awk '{print $4}'; ip route show default").stdout
        assert addr.startswith("100.127.") and "default via 100.127." in addr, addr
        assert sb.commands.run("cat /etc/resolv.conf").stdout.startswith("nameserver")
        ok = sb.commands.run(f"curl -fsS -m 10 http://{net.target}:8080/vmopen-ok")
        assert ok.stdout == "hello from target\n", ok
        sb.files.write("/tmp/ca.pem", net.ca.read_bytes())
        ok_tls = sb.commands.run(f"curl -fsS -m 20 --cacert /tmp/ca.pem https://{net.target}:8443/vmopen-ok-tls",
                                 timeout=60)
        assert ok_tls.exit_code == 0, ok_tls
        assert sb.network.audit() == []
        assert_open_refusals_audited(sb, net, "vmopen-no")
        # the host's loopback: 127.0.0.1 in the guest is the guest's own
        loop = sb.commands.run(f"curl -sS -m 5 http://127.0.0.1:{net.loopback_port}/vmopen-loop")
        assert loop.exit_code == 7 and net.loopback_hits == [], loop
        assert sb.commands.run(f"curl -fsS -m 10 http://{net.target}:8080/vmopen-ok2").exit_code == 0
        assert len(sb.network.audit()) == 5
        assert _tap_holders(names.tap) == [str(_qemu_pid(sb))]  # QEMU alone: the host closed its copy
    hits = [h["path"] for h in net.hits() if h["path"].startswith("/vmopen-")]
    assert hits == ["/vmopen-ok", "/vmopen-ok-tls", "/vmopen-ok2"], hits
    assert _network_leftovers(sb.id) == []


def test_two_open_vms_each_audit_only_their_own_refusals(net: TargetNet, forwarding_on: None) -> None:
    with Sandbox.create(tier="microvm", network="open", memory="256M") as a, \
            Sandbox.create(tier="microvm", network="open", memory="256M") as b:
        assert a.commands.run(f"curl -sS -m 5 http://{net.other}:8080/vmopen-a").exit_code == 7
        assert b.commands.run(f"curl -sS -m 5 http://{METADATA}:{net.metadata_port}/vmopen-b").exit_code == 7
        assert [(e.sandbox_id, e.destination) for e in a.network.audit()] == [(a.id, f"{net.other}:8080")]
        assert [(e.sandbox_id, e.destination) for e in b.network.audit()] == [
            (b.id, f"{METADATA}:{net.metadata_port}")]
    assert not [h for h in net.hits() if h["path"] in ("/vmopen-a", "/vmopen-b")]


#: guest root sends two UDP datagrams through a raw socket: its own source, then a forged one
FORGE = """
import socket, struct, sys
own, target, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
for source, payload in ((own, b"own-source"), ("198.51.100.7", b"forged-source")):
    udp = struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0,
                     socket.inet_aton(source), socket.inet_aton(target))
    raw.sendto(ip + udp, (target, 0))
print("sent")
"""


def test_a_forged_source_from_guest_root_is_dropped_and_audited(net: TargetNet, forwarding_on: None) -> None:
    """Commands are guest root (``user="root"``, raw sockets): a datagram with the sandbox's own source reaches the
    allowed target, the same with a forged source does not and is audited (`spoofed-source`)."""
    listener, port = udp_sink(net, timeout=5)
    with Sandbox.create(tier="microvm", network="open", memory="256M", user="root",
                        unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        own = sb.commands.run("ip -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1").stdout.strip()
        sent = sb.commands.run(["python3", "-c", FORGE, own, net.target, str(port)])
        assert sent.stdout == "sent\n", sent
        received = listener.communicate(timeout=15)[0].split()
        events = [(e.protocol, e.destination, e.rule) for e in sb.network.audit()]
    assert received == ["own-source"], received
    assert events == [("udp", f"{net.target}:{port}", "spoofed-source")], events


@pytest.mark.parametrize("mode", ["none", "allow"])
def test_without_open_the_network_device_is_a_black_hole(net: TargetNet, mode: str) -> None:
    """Guest root brings eth0 up on the target's subnet itself and sends: frames are handed to the
    device (the qdisc's counter; the driver counts a frame only once it reclaims the buffer, lazily)
    and reach nothing (QEMU's hub has no other port): no answer, no neighbour, nothing received."""
    kind: dict[str, Any] = {"none": {}, "allow": {"allow": [f"{net.target}:8080"],
                                                 "unsafe_allow_ranges": [f"{net.target}/32"]}}[mode]
    with Sandbox.create(tier="microvm", network=mode, memory="256M", user="root", **kind) as sb:
        guest = net.target.rsplit(".", 1)[0] + ".77"
        script = (f"ip addr add {guest}/24 dev eth0 && ip link set eth0 up && "
                  f"curl -sS -m 3 --noproxy '*' http://{net.target}:8080/vmopen-hole; echo curl=$?; "
                  "tc -s qdisc show dev eth0 | awk '/Sent/ {print $4}'; cat /sys/class/net/eth0/statistics/rx_packets; "
                  "ip neigh show dev eth0")
        result = sb.commands.run(script, timeout=60)
        lines = result.stdout.split()
        assert lines[0] in ("curl=7", "curl=28"), result  # no answer: refused (ARP failed) or timed out
        assert int(lines[1]) > 0 and int(lines[2]) == 0, result  # sent, and nothing ever came back
        assert lines[3] == net.target and lines[4] in ("INCOMPLETE", "FAILED"), result  # no ARP answer
        if mode == "allow":  # the proxy's way still works
            assert sb.commands.run(f"curl -fsS -m 10 http://{net.target}:8080/vmopen-proxied").exit_code == 0
    assert [h["path"] for h in net.hits() if h["path"].startswith("/vmopen-hole")] == []


def test_close_leaves_no_namespace_table_veth_tap_process_or_mount(forwarding_on: None, state_dir: Path) -> None:
    sb = Sandbox.create(tier="microvm", network="open", memory="256M")
    pid = _qemu_pid(sb)
    assert len(_network_leftovers(sb.id)) == 4  # tap (held by QEMU), netns, veth, table
    sb.kill()
    assert not _alive(pid)
    assert _network_leftovers(sb.id) == []
    assert sandbox_leftovers(sb.id, state_dir) == []


OWNER = """
import time
from corral import Sandbox
sb = Sandbox.create(tier="microvm", network="open", memory="256M")
print(sb.id, sb._inner.qemu_pid(), flush=True)
time.sleep(600)
"""


def test_owner_killed_then_gc_leaves_nothing(forwarding_on: None, state_dir: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=os.environ.copy())
    try:
        assert owner.stdout is not None and owner.stderr is not None
        line = owner.stdout.readline().split()
        assert len(line) == 2, owner.stderr.read()[-3000:]
        sandbox_id, pid = line[0], int(line[1])
        assert _alive(pid)
        assert len(_network_leftovers(sandbox_id)) == 4
    finally:
        owner.kill()  # SIGKILL: no cleanup code of the owner runs
        owner.wait()
    assert _alive(pid), "QEMU died with its owner: gc is not exercised"
    run_gc(sandbox_id)
    assert not _alive(pid)
    assert _network_leftovers(sandbox_id) == []
    assert sandbox_leftovers(sandbox_id, state_dir) == []
