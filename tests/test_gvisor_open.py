"""``network="open"`` in the gVisor tier: gVisor's netstack on the open mode's veth, the host's policy.

The namespace, veth, NAT, nftables table and NFLOG audit are the process tier's
(``OpenNetwork``); what is gVisor's is that runsc's netstack owns the veth, and
that runsc is started with ``/proc/sys/net/core`` hidden in the sandbox's
namespace (this runsc takes any namespace for the root one otherwise).  Each
check goes both ways, on the shared test network (``egress_net``; this area's
names start with ``gvn``): the allowed target answers, refused attempts fail at
once, reach nothing and are audited one event each.

Cost: ~8 gVisor sandboxes and one test network, ~9 s on 2 quiet cores.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral.egress.open_net import OpenNames
from corral.host import mounts, netns
from corral.tiers.gvisor.net import ROOT_TEST, root_test_misfires

from .egress_net import METADATA, TargetNet, assert_open_refusals_audited, target_net, udp_sink
from .leaks import processes_naming, run_gc, sandbox_leftovers
from .tier_probe import skip_unless_tier


@pytest.fixture(scope="module", autouse=True)
def _gvisor_available(state_dir: Path) -> None:
    skip_unless_tier("gvisor", state_dir)


@pytest.fixture(scope="module")
def net() -> Iterator[TargetNet]:
    with target_net(prefix="gvn") as testnet:
        yield testnet


def _network_leftovers(sandbox_id: str) -> list[str]:
    names = OpenNames.for_sandbox(sandbox_id)
    found = []
    if netns.netns_exists(names.netns):
        found.append(f"netns {names.netns}")
    if netns.link_exists(names.host_if):
        found.append(f"veth {names.host_if}")
    if netns.nft_table_exists("inet", names.table):
        found.append(f"table {names.table}")
    return found


def _hide_mounts() -> list[str]:
    """The launcher's tmpfs, if it ever showed in the host's mount namespace."""
    return [point for point, rest in mounts.mountinfo() if "corral-hide" in rest]


def test_open_mode_reaches_the_allowed_target_and_refuses_and_audits_the_rest(
        net: TargetNet, forwarding_on: None) -> None:
    with Sandbox.create(tier="gvisor", network="open", memory="256M",
                        unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        assert sb.commands.run(["uname", "-r"]).stdout.strip() != os.uname().release  # gVisor answers
        # gVisor's netstack holds the veth's address; the host's kernel in the namespace no longer does
        links = sb.commands.run("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").stdout.split()
        assert sorted(links) == sorted(["lo", OpenNames.for_sandbox(sb.id).sandbox_if]), links
        ok = sb.commands.run(f"curl -fsS -m 30 http://{net.target}:8080/gvn-ok")
        assert ok.stdout == "hello from target\n", ok
        ok_tls = sb.commands.run(f"curl -fsS -m 30 --cacert /dev/stdin https://{net.target}:8443/gvn-ok-tls",
                                 stdin=net.ca.read_bytes())
        assert ok_tls.exit_code == 0, ok_tls
        assert sb.network.audit() == []
        assert_open_refusals_audited(sb, net, "gvn-no")
        # the host's loopback: 127.0.0.1 in gVisor is gVisor's own loopback, never the host's
        loop = sb.commands.run(f"curl -sS -m 5 http://127.0.0.1:{net.loopback_port}/gvn-loop")
        assert loop.exit_code == 7 and net.loopback_hits == [], loop
        # allowed again: no new event
        assert sb.commands.run(f"curl -fsS -m 30 http://{net.target}:8080/gvn-ok2").exit_code == 0
        assert len(sb.network.audit()) == 5
        # the hidden /proc/sys/net/core was runsc's alone: never in the host's mounts, and the
        # namespace's own directory is intact for everyone else
        assert _hide_mounts() == []
        # nor does it outlive runsc's launch: the Sentry and the gofer pivot into mount namespaces of
        # their own, without it (the launcher's private namespace goes when `runsc run` exits)
        for pid in processes_naming(sb.id):
            try:
                assert "corral-hide" not in Path(f"/proc/{pid}/mountinfo").read_text(), pid
            except FileNotFoundError:
                continue  # ended meanwhile
        assert netns.in_netns(OpenNames.for_sandbox(sb.id).netns, ROOT_TEST.exists) == root_test_misfires(
            OpenNames.for_sandbox(sb.id).netns)
    hits = [h["path"] for h in net.hits() if h["path"].startswith("/gvn-")]
    assert hits == ["/gvn-ok", "/gvn-ok-tls", "/gvn-ok2"], hits
    assert _network_leftovers(sb.id) == []


def test_without_an_unsafe_range_the_private_target_is_refused_too(net: TargetNet, forwarding_on: None) -> None:
    # the same target as above, but no operator range: the RFC1918 rule applies to it
    with Sandbox.create(tier="gvisor", network="open", memory="256M") as sb:
        result = sb.commands.run(f"curl -sS -m 5 http://{net.target}:8080/gvn-private")
        assert result.exit_code == 7, result
        assert [(e.destination, e.rule) for e in sb.network.audit()] == [(f"{net.target}:8080", "rfc1918")]
    assert not [h for h in net.hits() if h["path"] == "/gvn-private"]


def test_two_open_sandboxes_each_audit_only_their_own_refusals(net: TargetNet, forwarding_on: None) -> None:
    with Sandbox.create(tier="gvisor", network="open") as a, Sandbox.create(tier="gvisor", network="open") as b:
        assert a.commands.run(f"curl -sS -m 5 http://{net.other}:8080/gvn-a").exit_code == 7
        assert b.commands.run(f"curl -sS -m 5 http://{METADATA}:{net.metadata_port}/gvn-b").exit_code == 7
        assert [(e.sandbox_id, e.destination) for e in a.network.audit()] == [(a.id, f"{net.other}:8080")]
        assert [(e.sandbox_id, e.destination) for e in b.network.audit()] == [
            (b.id, f"{METADATA}:{net.metadata_port}")]


def test_close_leaves_no_namespace_table_veth_runsc_state_process_or_mount(
        forwarding_on: None, state_dir: Path) -> None:
    sb = Sandbox.create(tier="gvisor", network="open")
    sb.commands.run(["true"])
    run_dir = state_dir / "sandboxes" / sb.id
    assert (run_dir / "runsc").is_dir()
    assert len(_network_leftovers(sb.id)) == 3
    sb.kill()
    assert _network_leftovers(sb.id) == []
    assert not run_dir.exists()
    assert processes_naming(sb.id) == []
    assert sandbox_leftovers(sb.id, state_dir) == []
    assert _hide_mounts() == []


def test_owner_killed_then_gc_leaves_nothing(forwarding_on: None, state_dir: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", (
            "import time\n"
            "from corral import Sandbox\n"
            "sb = Sandbox.create(tier='gvisor', network='open')\n"
            "sb.commands.run(['sh', '-c', 'sleep 600 &'])\n"
            "print(sb.id, flush=True)\n"
            "time.sleep(600)\n"
        )],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy(),
    )
    try:
        assert owner.stdout is not None and owner.stderr is not None
        sandbox_id = owner.stdout.readline().strip()
        assert sandbox_id.startswith("sb-"), owner.stderr.read()[-3000:]
        assert processes_naming(sandbox_id)
        assert len(_network_leftovers(sandbox_id)) == 3
    finally:
        owner.kill()  # SIGKILL: no cleanup code of the owner runs
        owner.wait()
    run_gc(sandbox_id)
    assert _network_leftovers(sandbox_id) == []
    assert sandbox_leftovers(sandbox_id, state_dir) == []
    assert processes_naming(sandbox_id) == []
    assert _hide_mounts() == []


def _udp_frame(dst_mac: bytes, src_mac: bytes, src: str, dst: str, port: int, payload: bytes) -> bytes:
    """An Ethernet frame carrying one IPv4 UDP datagram (UDP checksum 0: none, allowed over IPv4)."""
    udp = struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0,
                         socket.inet_aton(src), socket.inet_aton(dst))
    total = sum(struct.unpack("!10H", header))
    total = (total & 0xFFFF) + (total >> 16)
    checksum = ~((total & 0xFFFF) + (total >> 16)) & 0xFFFF
    return dst_mac + src_mac + b"\x08\x00" + header[:10] + struct.pack("!H", checksum) + header[12:] + udp


def test_a_forged_source_is_dropped_and_audited(net: TargetNet, forwarding_on: None) -> None:
    """What a compromised Sentry could do with its packet socket on the veth, done from the host
    in the sandbox's namespace: a datagram with the sandbox's own source reaches the (allowed)
    target, the same datagram with a forged source does not, and is audited."""
    listener, port = udp_sink(net, timeout=3)
    with Sandbox.create(tier="gvisor", network="open", memory="256M",
                        unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        names = OpenNames.for_sandbox(sb.id)
        own = sb.commands.run(["python3", "-c", (
            "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"s.connect(('{net.target}', {port})); print(s.getsockname()[0])")]).stdout.strip()
        host_mac = bytes.fromhex(Path(f"/sys/class/net/{names.host_if}/address").read_text().strip().replace(":", ""))

        def inject() -> None:
            with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as raw:
                raw.bind((names.sandbox_if, 0))
                sandbox_mac = raw.getsockname()[4]  # (/sys/class/net shows the host's namespace)
                for source, payload in ((own, b"own-source"), ("198.51.100.7", b"forged-source")):
                    raw.send(_udp_frame(host_mac, sandbox_mac, source, net.target, port, payload))

        netns.in_netns(names.netns, inject)
        received = listener.communicate(timeout=10)[0].split()
        events = [(e.protocol, e.destination, e.rule) for e in sb.network.audit()]
    assert received == ["own-source"], received
    assert events == [("udp", f"{net.target}:{port}", "spoofed-source")], events


def test_without_the_hiding_step_this_runsc_refuses_and_nothing_is_left(
        forwarding_on: None, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the step exists (runsc 20240729 on a kernel with a per-namespace rmem_default), and a
    failed create cleans up: no namespace, veth, table, run dir or process."""
    from corral.egress import open_net
    from corral.errors import SandboxClosed
    from corral.tiers.gvisor import tier as gvisor

    if not _root_test_misfires_here():
        pytest.skip("this kernel has no rmem_default in a new namespace: runsc needs no hiding step")
    made: list[str] = []
    real_init = open_net.OpenNetwork.__init__

    def recording_init(self: open_net.OpenNetwork, sandbox_id: str, *args: object, **kwargs: object) -> None:
        made.append(sandbox_id)
        real_init(self, sandbox_id, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(open_net.OpenNetwork, "__init__", recording_init)
    monkeypatch.setattr(gvisor, "root_test_misfires", lambda name: False)
    try:
        Sandbox.create(tier="gvisor", network="open").kill()
        refused = ""  # a runsc whose root-namespace test works: nothing to show here
    except SandboxClosed as exc:
        refused = str(exc)
    if refused == "":
        pytest.skip("this runsc starts in the namespace without the step")
    assert "root network namespace" in refused, refused
    assert len(made) == 1
    assert _network_leftovers(made[0]) == []
    assert sandbox_leftovers(made[0], state_dir) == [] and processes_naming(made[0]) == []


def _root_test_misfires_here() -> bool:
    """The kernel's side, asked of a throwaway namespace."""
    name = f"gvn-probe-{os.getpid()}"
    try:
        return netns.new_netns(name, ROOT_TEST.exists)
    finally:
        netns.delete_netns(name)
