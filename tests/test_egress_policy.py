"""The egress policy and spec validation, without sandboxes (fast)."""

from __future__ import annotations

import ipaddress

import pytest

from corral.egress.policy import HostAddresses, Policy
from corral.errors import InvalidSpec
from corral.netrules import AllowRule, parse_ip, parse_range
from corral.spec import SandboxSpec
from corral.surface import build_spec


class FixedHostAddresses(HostAddresses):
    def __init__(self, *addresses: str) -> None:
        super().__init__()
        self._fixed = frozenset(ipaddress.ip_address(a) for a in addresses)

    def current(self) -> frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        return self._fixed


def policy(allow: list[str], unsafe: list[str] = (), answers: dict[str, list[str]] | None = None,
           host: tuple[str, ...] = ()) -> tuple[Policy, list[str]]:
    asked: list[str] = []

    def resolve(name: str) -> list[str]:
        asked.append(name)
        return (answers or {}).get(name, [])

    return Policy([AllowRule.parse(a) for a in allow], [parse_range(u) for u in unsafe], resolve,
                  FixedHostAddresses(*host)), asked


@pytest.mark.parametrize("spelling", ["169.254.169.254", "2852039166", "0xa9fea9fe", "0251.0376.0251.0376",
                                      "169.254.43518", "0xa9.0xfe.0xa9.0xfe", "[::ffff:169.254.169.254]",
                                      "::ffff:a9fe:a9fe", "169.254.169.254.", "64:ff9b::a9fe:a9fe",
                                      "2002:a9fe:a9fe::1", "::ffff:0:a9fe:a9fe", "[::ffff:0:169.254.169.254]"])
def test_every_spelling_of_the_metadata_address_is_normalized_and_refused(spelling: str) -> None:
    assert str(parse_ip(spelling)) == "169.254.169.254"
    decision = policy(["0.0.0.0/0", "::/0"])[0].decide(spelling, 80)
    assert not decision.allowed and decision.rule == "link-local" and decision.address == "169.254.169.254"


@pytest.mark.parametrize("address", [
    "64:ff9b:a9fe:a9fe::", "64:ff9b:a9:fea9:fe::", "64:ff9b:0:a9fe:a9:fe00::", "64:ff9b::7f:0:100:0",
    "::ffff:ffff:a9fe:a9fe", "::ffff:0:0:a9fe:a9fe", "2606:4700::5efe:a9fe:a9fe", "2606:4700::200:5efe:7f00:1",
])
def test_ipv6_forms_that_carry_an_internal_ipv4_address_are_refused(address: str) -> None:
    """NAT64's well-known prefix at RFC 6052's other lengths, the rest of ::/8 and ISATAP
    interface ids reached a metadata stand-in where a translator or router carried them (helper
    93); a public IPv6 address, and an ISATAP id naming a public IPv4 one, still pass."""
    p = policy(["0.0.0.0/0", "::/0"])[0]
    assert not p.decide(address, 80).allowed, address
    assert p.decide("2606:4700::1111", 80).allowed and p.decide("2606:4700::5efe:101:101", 80).allowed


@pytest.mark.parametrize("address,rule", [
    ("127.0.0.1", "loopback"), ("0.0.0.0", "this-network"), ("10.1.2.3", "rfc1918"), ("172.16.0.1", "rfc1918"),
    ("192.168.1.1", "rfc1918"), ("100.64.0.1", "cgnat"), ("224.0.0.1", "multicast"), ("240.0.0.1", "reserved"),
    ("255.255.255.255", "reserved"), ("::1", "loopback"), ("fd00:ec2::254", "ipv6-ula"), ("fe80::1", "ipv6-link-local"),
    ("::ffff:10.0.0.1", "rfc1918"), ("ff02::1", "multicast"), ("::", "unspecified"),
])
def test_refused_ranges_hold_whatever_the_allowlist_says(address: str, rule: str) -> None:
    decision = policy(["0.0.0.0/0", "::/0"])[0].decide(address, 443)
    assert (decision.allowed, decision.rule) == (False, rule)


def test_public_addresses_pass_and_host_addresses_do_not() -> None:
    p, _ = policy(["0.0.0.0/0", "::/0"], host=("93.184.216.34",))
    assert p.decide("1.1.1.1", 443).allowed
    assert p.decide("2606:4700::1111", 443).allowed
    assert p.decide("93.184.216.34", 443).rule == "host-address"


def test_unsafe_range_reenables_only_that_range() -> None:
    p, _ = policy(["10.0.0.0/8"], unsafe=["10.9.0.0/16"])
    assert p.decide("10.9.1.1", 80).allowed
    assert p.decide("10.8.1.1", 80).rule == "rfc1918"


def test_names_resolve_once_and_the_checked_address_is_returned() -> None:
    p, asked = policy(["api.example.com", "*.cdn.example.com"], answers={
        "api.example.com": ["169.254.169.254", "93.184.216.34"], "x.cdn.example.com": ["10.0.0.1"]})
    decision = p.decide("API.example.com.", 443)
    assert (decision.allowed, decision.address) == (True, "93.184.216.34")
    assert p.decide("x.cdn.example.com", 443).rule == "rfc1918"
    assert asked == ["api.example.com", "x.cdn.example.com"]
    assert p.decide("unlisted.example.org", 443).rule == "not-allowed"
    assert p.decide("cdn.example.com", 443).rule == "not-allowed"  # the wildcard needs a label
    assert asked == ["api.example.com", "x.cdn.example.com"]  # unlisted names are never looked up


def test_names_are_looked_up_only_when_a_rule_could_allow_where_they_lead() -> None:
    """A lookup is a channel out (the name's servers see it): an IP rule that can allow nothing
    (wholly inside a refused range) and a loopback name are no reason to look a name up. Before,
    any IP or CIDR rule had every name the sandbox asked for sent to the host's resolver."""
    answers = {"in.example.org": ["93.184.216.34"], "localhost": ["127.0.0.1"], "a.localhost": ["127.0.0.1"]}
    p, asked = policy(["allowed.example", "203.0.113.0/24", "10.1.0.0/16"], answers=answers)
    for name in ("data-0123.attacker.example", "localhost", "a.localhost"):
        assert not p.decide(name, 443).allowed
    assert asked == []
    assert p.decide("localhost", 80).rule == "loopback"
    # a usable CIDR rule: names are looked up to see whether they land in it (documented)
    p, asked = policy(["93.184.216.0/24"], answers=answers)
    assert p.decide("in.example.org", 443).allowed and asked == ["in.example.org"]
    assert p.decide("localhost", 443).rule == "loopback" and asked == ["in.example.org"]
    # re-enabled ranges make their rules usable, loopback names included
    p, asked = policy(["10.1.0.0/16", "localhost"], unsafe=["10.1.0.0/16", "127.0.0.1/32"], answers=answers)
    assert p.decide("localhost", 80).allowed and asked == ["localhost"]


def test_ports_and_ip_rules() -> None:
    p, _ = policy(["api.example.com:443", "93.184.216.0/24", "[2606:4700::1111]:53"],
                  answers={"api.example.com": ["93.184.216.34"]})
    assert p.decide("api.example.com", 443).allowed
    assert p.decide("api.example.com", 80).allowed  # the CIDR rule covers its address on any port
    assert p.decide("93.184.217.1", 80).rule == "not-allowed"
    assert p.decide("2606:4700::1111", 53).allowed
    assert p.decide("2606:4700::1111", 54).rule == "not-allowed"
    assert p.decide("api.example.com", 0).rule == "bad-port"


@pytest.mark.parametrize("bad", ["", "http://x.example", "a b", "*.", "x.example:99999", "10.0.0.0/33", "[::1"])
def test_bad_allow_entries_are_rejected_by_name(bad: str) -> None:
    with pytest.raises(InvalidSpec, match="allow"):
        AllowRule.parse(bad)


def test_spec_network_fields() -> None:
    spec = build_spec(allow=["api.example.com"], secrets=["TOKEN@api.example.com"])
    assert spec.network == "allow" and spec.secrets[0].hosts == ("api.example.com",)
    assert SandboxSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(InvalidSpec, match="needs network='allow'"):
        SandboxSpec(network="none", allow=("x.example",))
    with pytest.raises(InvalidSpec, match="use network='allow'"):
        SandboxSpec(network="open", secrets=("T@x.example",))
    with pytest.raises(InvalidSpec, match="unsafe allow range"):
        SandboxSpec(network="allow", unsafe_allow_ranges=("10.0.0.0/99",))
    with pytest.raises(InvalidSpec, match="given twice"):
        SandboxSpec(network="allow", secrets=("T@x.example",), env={"T": "1"})
    with pytest.raises(InvalidSpec, match="expected a list"):
        SandboxSpec(network="allow", allow="x.example")  # type: ignore[arg-type]
    with pytest.raises(InvalidSpec, match="network 'wide'"):
        SandboxSpec(network="wide")


def test_a_failed_read_of_the_host_addresses_lets_none_of_them_through() -> None:
    """Before: a read that failed (``ip`` could not be spawned, or timed out) made the list empty,
    and for the next five seconds a host address the allowlist covered was let through."""
    host = ipaddress.ip_address("93.184.216.34")
    reads: list[frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address] | None] = [frozenset({host}), None, None]
    addresses = HostAddresses(read=lambda: reads.pop(0) if reads else frozenset({host}))
    p = Policy([AllowRule.parse("93.184.216.0/24")], (), lambda _: [], addresses)
    assert p.decide("93.184.216.34", 443).rule == "host-address"
    assert p.decide("93.184.216.35", 443).allowed  # (the allowed direction: not the host's)
    addresses._refresh()  # a failed read keeps what was read before
    assert addresses.current() == frozenset({host})
    assert p.decide("93.184.216.34", 443).rule == "host-address"
    # never read: every address may be the host's, so none passes
    unknown = Policy([AllowRule.parse("93.184.216.0/24")], (), lambda _: [], HostAddresses(read=lambda: None))
    decision = unknown.decide("93.184.216.35", 443)
    assert (decision.allowed, decision.rule) == (False, "host-addresses-unknown")


def test_the_host_addresses_read_names_the_loopback() -> None:
    from corral.egress.policy import _read_host_addresses

    assert ipaddress.ip_address("127.0.0.1") in (_read_host_addresses() or ())
