"""``network="allow"``'s namespace: loopback for the proxy's relay, and a way out that refuses and audits.

The proxy is the only way out of an ``allow`` sandbox.  With no interface but
loopback (``bwrap --unshare-net``) a direct connect fails in the routing lookup,
before any hook could see it, so nothing can audit it.  Here instead the *host*
creates the namespace (owned by the initial user namespace: nothing in the
sandbox has CAP_NET_ADMIN or CAP_NET_RAW over it, so it cannot change routes or
rules, or open raw sockets) with:

* ``lo`` only, as before: the agent's relay listens on 127.0.0.1/::1 port 3128;
* default routes (IPv4 and IPv6) *through* ``lo``, and an address on it from
  the documentation ranges as the source, so that a direct attempt passes the
  routing lookup and reaches the ``output`` hook.  No other interface is made:
  creating and destroying a veth pair costs far more (the kernel here has no
  dummy interfaces);
* an nftables table whose ``output`` chain accepts what goes to the sandbox's
  own addresses (``fib daddr type local``) and logs (NFLOG, rate limited) and
  refuses everything else: TCP with a reset, the rest with ICMP
  admin-prohibited, so every attempt fails at once (ECONNREFUSED, EPERM);
* ``ping_group_range`` opened, so that a ping is an attempt that reaches the
  hook (and the audit) instead of failing at socket() with nothing to log.

Nothing can be forwarded: the namespace has no link to the host.  Names derive
from the sandbox id like ``open`` mode's, and deleting the namespace deletes
the table with it, so the janitor's reap is the same.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import HostNotSupported
from ..host import netns
from ..host.rtnl import Rtnl
from .audit import AuditLog
from .nflog import NflogListener, limit_object, log_statement
from .open_net import OpenNames

#: the rule every direct attempt is refused by (the sandbox's way out is the proxy)
RULE = "raw-socket"
#: a fresh namespace has every NFLOG group free: groups are per namespace
GROUP = 1
#: source addresses for the way out that is not one: documentation ranges, never routed anywhere
ADDRESSES = ("192.0.2.2/32", "2001:db8::2/128")


def ruleset(table: str, group: int) -> str:
    log = log_statement(group, table, RULE)
    return "\n".join([
        f"table inet {table} {{",
        limit_object(),
        "  chain output {",
        "    type filter hook output priority filter; policy accept;",
        "    fib daddr type local accept",
        f"    {log}",
        f'    meta l4proto tcp counter reject with tcp reset comment "{RULE}"',
        f'    counter reject with icmpx type admin-prohibited comment "{RULE}"',
        "  }",
        "}",
    ]) + "\n"


class AllowNetwork:
    """The namespace and NFLOG listener of one ``allow`` sandbox; :meth:`close` releases both."""

    def __init__(self, sandbox_id: str, log: AuditLog) -> None:
        self.names = OpenNames.for_sandbox(sandbox_id)
        self._sandbox_id = sandbox_id
        self._log = log
        self.listener: NflogListener | None = None
        try:
            self.listener = netns.new_netns(self.names.netns, self._setup_inside)
            self.listener.start()
        except OSError as exc:
            self.close()
            raise HostNotSupported(
                f"network='allow' refuses and audits direct attempts in a namespace of its own, which failed: "
                f"{exc}. It needs nftables (libnftables or the nft command) and a kernel with nf_tables, "
                f"nft_fib, nft_reject, nft_log and nfnetlink_log: apt-get install nftables"
            ) from exc
        except BaseException:
            self.close()
            raise

    def _setup_inside(self) -> NflogListener:
        """Runs in a thread inside the namespace: /proc/sys/net, rtnetlink, nft and the socket are its."""
        Path("/proc/sys/net/ipv4/ping_group_range").write_text("0 2147483647\n")
        with Rtnl() as rtnl:
            rtnl.link_up()  # lo
            for address in ADDRESSES:
                rtnl.add_address(address)
            rtnl.add_default_route(4)
            rtnl.add_default_route(6)
        listener = NflogListener(self._sandbox_id, self._log, self.names.table, group=GROUP)
        try:
            netns.nft_load(ruleset(self.names.table, listener.group))
        except BaseException:
            listener.close()
            raise
        return listener

    def unlogged(self) -> list[tuple[str, int]]:
        """(rule, packets) refused without an audit event of their own (rate limit)."""
        assert self.listener is not None
        counters = netns.in_netns(self.names.netns, lambda: netns.nft_counters("inet", self.names.table))
        return self.listener.unlogged(counters)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        reap(self.names)


def reap(names: OpenNames) -> None:
    """Delete the namespace (its table goes with it); idempotent, by name only."""
    netns.delete_netns(names.netns)
