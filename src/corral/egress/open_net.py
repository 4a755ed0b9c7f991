"""``network="open"``: a namespace of its own, a veth pair, NAT, and an nftables table of our own.

Names derive from the sandbox id (``crl-<10 hex>``, ``crl<10 hex>h``/``s``,
``inet crl_<10 hex>``), so the janitor can find and delete them from the id
alone even if the owner died half-way through creating them.  The table refuses
the same ranges as the proxy (minus the operator's unsafe ranges), every address
of the host (input chain), all IPv6, and any source but the sandbox's own address.  Every refused packet is logged to an
NFLOG group this sandbox's owner holds (:mod:`corral.egress.nflog`), which makes
it one audit event; per-rule counters tell how many went unlogged (rate limit).
Only our own table is ever created, read or deleted.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import random
import re
import socket
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import HostNotSupported
from ..host import conntrack, netns
from ..host.rtnl import Rtnl
from ..netrules import IPNetwork
from .audit import AuditLog
from .nflog import NflogListener, limit_object, log_statement
from .policy import REFUSED_RANGES

log = logging.getLogger(__name__)

#: sandbox addresses: /30s in a CGNAT block hosts rarely use
POOL = ipaddress.IPv4Network("100.127.0.0/16")


@dataclass(frozen=True)
class OpenNames:
    netns: str
    host_if: str
    sandbox_if: str
    table: str
    #: a microVM's tap and the bridge joining it to the veth (inside the namespace: they go with it)
    tap: str = ""
    bridge: str = ""

    @classmethod
    def for_sandbox(cls, sandbox_id: str) -> OpenNames:
        tag = re.sub(r"[^0-9a-f]", "", sandbox_id)[-10:]
        return cls(f"crl-{tag}", f"crl{tag}h", f"crl{tag}s", f"crl_{tag}", f"crl{tag}t", f"crl{tag}b")


def _host_nameservers() -> list[str]:
    try:
        text = Path("/etc/resolv.conf").read_text()
    except OSError:
        return []
    servers = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                if ipaddress.ip_address(parts[1]).version == 4 and not ipaddress.ip_address(parts[1]).is_loopback:
                    servers.append(parts[1])
            except ValueError:
                continue
    return servers


def _free_slot() -> ipaddress.IPv4Network:
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for _ in range(200):
        slot = ipaddress.IPv4Network((int(POOL.network_address) + 4 * random.randrange(POOL.num_addresses // 4), 30))
        if f" {slot.network_address + 1}/" not in used:
            return slot
    raise OSError("no free /30 in 100.127.0.0/16 for the sandbox's veth pair")


#: flows one sandbox may hold in the host's conntrack table at once (new ones beyond are dropped
#: and audited as ``conntrack-limit``).  The table is the host's, shared by every sandbox and the
#: host itself and not charged to any cgroup: unbounded, one sandbox spraying UDP to distinct ports
#: filled it at ~90,000 entries/s (262144 in ~3 s) and the host then dropped every new connection
CONNTRACK_LIMIT = 4096

#: what a kernel sends by itself when a link comes up (IPv6 neighbour discovery, multicast
#: listener reports): dropped without an audit event, as they are no attempt by the sandbox,
#: which cannot send them itself (no CAP_NET_RAW in a namespace the host owns)
KERNEL_CHATTER = ("icmpv6 type { nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert, "
                  "mld-listener-report, mld2-listener-report } drop")


def ruleset(names: OpenNames, sandbox_addr: str, unsafe: Sequence[IPNetwork], nameservers: Sequence[str],
            group: int, conntrack_limit: int = CONNTRACK_LIMIT) -> str:
    refused_v4 = [(str(net), rule) for net, rule in REFUSED_RANGES if net.version == 4]
    unsafe_v4 = [str(n) for n in unsafe if n.version == 4]
    sandbox = f'iifname "{names.host_if}"'

    def refuse(match: str, label: str, verdict: str) -> list[str]:
        # two rules: the first logs (rate-limited), the second refuses every packet, limited or not
        head = " ".join(part for part in ("   ", sandbox, match) if part)
        return [f"{head} {log_statement(group, names.table, label)}", f'{head} counter {verdict} comment "{label}"']

    lines = [
        f"table inet {names.table} {{",
        limit_object(),
        # before forward and input alike (conntrack made the entry at priority -200; a packet
        # dropped here leaves it unconfirmed, so it never enters the host's table)
        "  chain prerouting {",
        "    type filter hook prerouting priority filter - 1; policy accept;",
        *refuse(f"ct state new ct count over {conntrack_limit}", "conntrack-limit", "drop"),
        "  }",
        # what comes to the sandbox: after every sandbox's own refusals (below), so that another
        # sandbox's attempt to reach this one is refused and audited by the sender's table (at
        # one priority the tables' order is the kernel's: this drop ate it, unaudited, when the
        # target's table was the newer)
        "  chain forward_in {",
        "    type filter hook forward priority filter - 1; policy accept;",
        f'    oifname "{names.host_if}" ct state established,related accept',
        f'    oifname "{names.host_if}" drop',
        "  }",
        "  chain forward {",
        "    type filter hook forward priority filter - 2; policy accept;",
        f"    {sandbox} {KERNEL_CHATTER}",
        *refuse("meta nfproto ipv6", "ipv6", "drop"),
        # only the sandbox's own address may leave (and only it is masqueraded).  A process in
        # the process tier cannot forge a source (no CAP_NET_RAW over this namespace), but in
        # the gVisor tier the Sentry holds a packet socket on the veth: if it were compromised,
        # forged sources would otherwise be forwarded un-NATed
        *refuse(f"ip saddr != {sandbox_addr}", "spoofed-source", "drop"),
    ]
    for server in nameservers:
        lines.append(f'    iifname "{names.host_if}" ip daddr {server} meta l4proto {{ tcp, udp }} th dport 53 accept')
    if unsafe_v4:
        lines.append(f'    iifname "{names.host_if}" ip daddr {{ {", ".join(unsafe_v4)} }} accept')
    for net, rule in refused_v4:
        lines += refuse(f"ip daddr {net}", f"{rule} {net}", "reject with icmp type admin-prohibited")
    lines += [
        f'    iifname "{names.host_if}" accept',
        "  }",
        "  chain input {",
        "    type filter hook input priority filter - 1; policy accept;",
        f'    iifname "{names.host_if}" ct state established,related accept',
        f"    {sandbox} {KERNEL_CHATTER}",
    ]
    if unsafe_v4:
        lines.append(f'    iifname "{names.host_if}" ip daddr {{ {", ".join(unsafe_v4)} }} accept')
    lines += [
        *refuse("", "host-address", "reject"),
        "  }",
        "  chain postrouting {",
        "    type nat hook postrouting priority srcnat; policy accept;",
        f'    ip saddr {sandbox_addr} oifname != "{names.host_if}" masquerade',
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


def check_host() -> None:
    """Open mode routes the sandbox's packets: the host must forward IPv4 (we never switch it on)."""
    if not netns.NETNS_DIR.parent.is_dir() or subprocess.run(["which", "nft"], capture_output=True).returncode:
        raise HostNotSupported("network='open' needs iproute2 and nftables: apt-get install iproute2 nftables")
    try:
        forwarding = IP_FORWARD.read_text().strip() == "1"
    except OSError:
        forwarding = False
    if not forwarding:
        raise HostNotSupported(
            "network='open' needs IPv4 forwarding on the host, which is off: sysctl -w net.ipv4.ip_forward=1 "
            "(Corral's own nftables table then polices the sandbox's interface); or use network='allow'"
        )


TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def open_tap(name: str) -> int:
    """Create tap ``name`` in the calling thread's namespace and return its fd (not persistent:
    the device goes when the last fd to it is closed).  No ``IFF_VNET_HDR``: the VM's template
    negotiated its virtio-net features with a backend that has none, so no offload could be used."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    except BaseException:
        os.close(fd)
        raise
    return fd


class OpenNetwork:
    """The namespace, veth pair and nftables table of one ``open`` sandbox.

    ``guest_tap``: for a VM, whose own kernel takes the sandbox's address.  The
    namespace's end of the veth then keeps no address and is bridged to a tap
    whose fd (:attr:`tap_fd`) the VM's virtio-net device gets: the guest sits on
    the veth's link as the process tier's sandbox does, and the host's table
    sees its packets exactly as it sees theirs."""

    def __init__(self, sandbox_id: str, unsafe: Sequence[IPNetwork], log: AuditLog, *,
                 guest_tap: bool = False) -> None:
        check_host()
        self.names = OpenNames.for_sandbox(sandbox_id)
        self.nameservers = _host_nameservers()
        self.listener: NflogListener | None = None
        self.tap_fd: int | None = None
        self._guest_tap = guest_tap
        try:
            # the group is bound before the rules that log to it exist: none of their
            # messages is lost, and no one else can take the group in between
            self.listener = NflogListener(sandbox_id, log, self.names.table)
            slot = _free_slot()
            self.host_addr, self.sandbox_addr = str(slot.network_address + 1), str(slot.network_address + 2)
            self.prefix = slot.prefixlen
            self._make_links(self.host_addr)
            netns.nft_load(ruleset(self.names, self.sandbox_addr, unsafe, self.nameservers, self.listener.group))
            self.listener.start()
        except BaseException:
            self.close()
            raise

    def _make_links(self, host_addr: str) -> None:
        """The namespace, the veth pair, addresses and routes, by rtnetlink in-process (what ``ip
        netns add``, ``ip link add ... type veth peer ... netns``, ``ip addr``, ``ip link set up`` and
        ``ip route`` do: ten runs of ``ip``, ~20 ms here, before this)."""
        names = self.names
        host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            def inside() -> None:  # a thread in the new namespace
                with Rtnl() as rtnl:
                    rtnl.link_up()  # lo
                    rtnl.add_veth(names.sandbox_if, names.host_if, host_ns)
                    index = socket.if_nametoindex(names.sandbox_if)
                    if self._guest_tap:
                        # layer 2 only: the guest holds the address, the namespace none
                        try:
                            bridge = rtnl.add_bridge(names.bridge)
                            self.tap_fd = open_tap(names.tap)
                        except OSError as exc:  # a kernel without CONFIG_BRIDGE or CONFIG_TUN
                            raise HostNotSupported(
                                f"network='open' for a VM needs bridges and /dev/net/tun in the host kernel: {exc}"
                            ) from None
                        rtnl.set_master(index, bridge)
                        rtnl.set_master(socket.if_nametoindex(names.tap), bridge)
                        rtnl.link_up(bridge)
                        return
                    rtnl.add_address(f"{self.sandbox_addr}/30", index)
                    rtnl.link_up(index)
                    rtnl.add_default_route_via(host_addr, index)

            netns.new_netns(names.netns, inside)
        finally:
            os.close(host_ns)
        with Rtnl() as rtnl:
            index = socket.if_nametoindex(names.host_if)
            rtnl.add_address(f"{host_addr}/30", index)
            rtnl.link_up(index)

    def unlogged(self) -> list[tuple[str, int]]:
        """(rule comment, packets) refused without an audit event of their own (rate limit)."""
        assert self.listener is not None
        return self.listener.unlogged(netns.nft_counters("inet", self.names.table))

    def take_tap(self) -> int:
        """The tap's fd, for the VM: the caller closes it (once QEMU holds its own copy)."""
        assert self.tap_fd is not None
        fd, self.tap_fd = self.tap_fd, None
        return fd

    def close(self) -> None:
        if self.tap_fd is not None:
            os.close(self.tap_fd)
            self.tap_fd = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        reap(self.names)


SIOCGIFADDR = 0x8915


def _sandbox_address(names: OpenNames) -> str | None:
    """The sandbox's address, from its host end's (the /30's first, the sandbox's the second): the
    janitor has only the names.  None once the veth is gone (its flows were deleted before it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            answer = fcntl.ioctl(sock, SIOCGIFADDR, struct.pack("256s", names.host_if.encode()))
        except OSError:  # ENODEV: no such link; EADDRNOTAVAIL: a creation that died before the address
            return None
    return str(ipaddress.IPv4Address(answer[20:24]) + 1)


def reap(names: OpenNames) -> None:
    """Delete what exists of one sandbox's open network (idempotent; by exact name only).

    First the host's conntrack entries of the sandbox's address, once nothing of it runs (its
    owner and the janitor call this after its cgroup is killed) and while the veth still holds
    the /30: a killed runsc or VM never closes its connections, so the host's table kept every
    one ESTABLISHED for 5 days, past the per-sandbox limit that died with the table (64 such
    sandboxes fill the host's table); and a later sandbox given the /30 would get their packets."""
    address = _sandbox_address(names)
    if address is not None:
        try:
            conntrack.delete_flows_of(address)
        except OSError as exc:  # the rest of the teardown goes on: a link left would hold the /30
            log.warning("open network %s: deleting the conntrack entries of %s failed: %s", names.netns,
                        address, exc)
    netns.nft_delete_table("inet", names.table)
    netns.delete_netns(names.netns)
    netns.delete_link(names.host_if)
