"""Per-attempt audit of what the kernel refuses: ``open`` mode's table, and direct attempts in ``allow``.

Real namespaces, real nftables rules, real NFLOG messages.  Each check goes both
ways: a refused attempt yields exactly one event naming its destination and
rule, and an allowed one yields none.  The test network's names start with
``aud`` (this area's prefix).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from corral import Sandbox
from corral.egress.audit import AuditLog
from corral.egress.nflog import NflogListener, parse_messages, parse_packet
from egress_net import METADATA, TargetNet, assert_open_refusals_audited, attempts, target_net

CLI = [sys.executable, "-c", "import sys; from corral.cli import main; sys.exit(main(sys.argv[1:]))"]

@pytest.fixture(scope="module")
def net() -> Iterator[TargetNet]:
    with target_net(prefix="aud") as testnet:
        yield testnet


def test_parser_reads_ipv4_ipv6_and_fragments() -> None:
    tcp4 = bytes([0x45, 0, 0, 60, 0, 0, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 2, 169, 254, 169, 254]) + bytes(
        [0x30, 0x39, 0, 80]) + bytes(16)
    assert parse_packet(tcp4) == ("tcp", "169.254.169.254", 80)
    later_fragment = tcp4[:6] + bytes([0x20, 0x10]) + tcp4[8:]
    assert parse_packet(later_fragment) == ("tcp", "169.254.169.254", None)
    udp6 = bytes([0x60, 0, 0, 0, 0, 8, 17, 64]) + bytes(16) + bytes.fromhex("fd000ec2" + "0" * 20 + "0254")
    udp6 += bytes([0, 53, 0, 53, 0, 8, 0, 0])
    assert parse_packet(udp6) == ("udp", "fd00:ec2::254", 53)
    hop_by_hop = udp6[:6] + bytes([0]) + udp6[7:40] + bytes([17, 0]) + bytes(6) + udp6[40:]
    assert parse_packet(hop_by_hop) == ("udp", "fd00:ec2::254", 53)
    assert parse_packet(b"") is None and parse_packet(b"\x45\x00") is None
    assert parse_messages(b"\x10\x00") == ([], [])  # truncated: ignored, not raised


def test_group_allocation_and_a_taken_group() -> None:
    first = NflogListener("sb-a", AuditLog(), "a")
    try:
        with pytest.raises(OSError):
            NflogListener("sb-b", AuditLog(), "b", group=first.group)
        second = NflogListener("sb-c", AuditLog(), "c")
        assert second.group != first.group
        second.close()
        second.close()  # idempotent
    finally:
        first.close()
    again = NflogListener("sb-d", AuditLog(), "d", group=first.group)  # released with the socket
    again.close()


def test_open_mode_audits_each_refused_attempt(net: TargetNet, forwarding_on: None) -> None:
    with Sandbox.create(network="open", unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        ok = sb.commands.run(f"curl -fsS -m 5 http://{net.target}:8080/audit-open-ok")
        assert ok.stdout == "hello from target\n", ok
        assert sb.network.audit() == []
        events = assert_open_refusals_audited(sb, net, "audit-open")
        assert all(e.sandbox_id == sb.id and e.time > 0 for e in events)
        # allowed again: still nothing new
        assert sb.commands.run(f"curl -fsS -m 5 http://{net.target}:8080/audit-open-ok2").exit_code == 0
        assert len(sb.network.audit()) == 5
    assert not [h for h in net.hits() if h["path"].startswith("/audit-open-") and "ok" not in h["path"]]


def test_a_flood_is_refused_whole_but_logged_within_the_rate_limit(net: TargetNet, forwarding_on: None) -> None:
    with Sandbox.create(network="open") as sb:
        # one packet first, so the sandbox knows its gateway's MAC address: packets queued while
        # it asks could be dropped in the sandbox (never reaching our rules) and spoil the count
        flood = sb.commands.run(
            "python3 -c \"import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"s.sendto(b'x', ('{net.host_side}', 9))\ntime.sleep(0.5)\n"
            f"for i in range(400):\n    s.sendto(b'x', ('{net.other}', 9))\"")
        assert flood.exit_code == 0, flood
        events = sb.network.audit()
    logged = [e for e in events if e.kind == "refused" and e.rule == "rfc1918"]
    unlogged = [e for e in events if e.kind == "refused-unlogged"]
    assert 50 <= len(logged) < 400, len(logged)  # the burst, plus what the rate allowed meanwhile
    assert [(e.rule, e.destination) for e in unlogged] == [("rfc1918", "10.0.0.0/8")]
    assert len(logged) + int(unlogged[0].protocol.removeprefix("nft:")) == 400


def test_allow_mode_direct_attempts_fail_fast_and_are_audited(net: TargetNet) -> None:
    before = len(net.hits("metadata"))
    port = net.metadata_port
    with Sandbox.create(allow=["target.test"], unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        links = sb.commands.run("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort").stdout.split()
        assert links == ["lo"]
        raw = sb.commands.run(attempts(f"tcp {METADATA} {port}", f"udp {METADATA} 53", f"icmp {METADATA} 0",
                                       f"tcp {net.target} 8080"), timeout=30)
        lines = raw.stdout.splitlines()
        assert len(lines) == 4 and all(" failed " in line for line in lines), raw
        assert all(float(line.split()[-1]) < 1.0 for line in lines), lines  # refused at once, no timeout
        events = sb.network.audit()
        seen = [(e.kind, e.protocol, e.destination, e.address, e.rule) for e in events]
        assert seen == [
            ("refused", "tcp", f"{METADATA}:{port}", METADATA, "raw-socket"),
            ("refused", "udp", f"{METADATA}:53", METADATA, "raw-socket"),
            ("refused", "icmp", METADATA, METADATA, "raw-socket"),
            ("refused", "tcp", f"{net.target}:8080", net.target, "raw-socket"),
        ], seen
        # the proxy still works, over HTTP and HTTPS, and adds no event
        sb.files.write("/tmp/testca.pem", net.ca.read_bytes())
        for cmd in ("curl -fsS http://target.test:8080/audit-allow-ok",
                    "curl -fsS --cacert /tmp/testca.pem https://target.test:8443/audit-allow-ok-tls"):
            ok = sb.commands.run(cmd, timeout=30)
            assert ok.exit_code == 0 and ok.stdout.startswith("hello from target"), (cmd, ok)
        assert len(sb.network.audit()) == 4
    assert len(net.hits("metadata")) == before


def test_cli_audit_prints_kernel_refusals(net: TargetNet, forwarding_on: None) -> None:
    proc = subprocess.run(
        [*CLI, "run", "--allow", "example.com", "--audit", "--", "sh", "-c",
         attempts(f"tcp {METADATA} {net.metadata_port}", f"udp {net.other} 53")],
        capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    audit = [line for line in proc.stderr.splitlines() if line.startswith("corral audit:")]
    assert len(audit) == 2, proc.stderr
    assert f"{METADATA}:{net.metadata_port}" in audit[0] and "[tcp]" in audit[0] and "rule=raw-socket" in audit[0]
    assert f"{net.other}:53" in audit[1] and "[udp]" in audit[1]
    proc = subprocess.run(
        [*CLI, "run", "--network", "open", "--audit", "--json", "--", "curl", "-sS", "-m", "5",
         f"http://{METADATA}:{net.metadata_port}/audit-cli"], capture_output=True, text=True, timeout=60)
    import json

    events = json.loads(proc.stdout)["audit"]
    assert [(e["protocol"], e["destination"], e["rule"]) for e in events] == [
        ("tcp", f"{METADATA}:{net.metadata_port}", "link-local")], proc.stdout


@pytest.mark.parametrize("target_first", [True, False])
def test_an_open_sandboxs_attempt_at_another_is_refused_and_audited_whichever_came_first(
        net: TargetNet, forwarding_on: None, target_first: bool) -> None:
    """Sandbox A connecting to sandbox B's address: refused at once and audited in A's log as
    ``cgnat``, whichever was made first. Before, when A was made first, B's table (the newer)
    dropped A's packets before A's own table saw them: a silent timeout, and nothing audited."""
    first = Sandbox.create(network="open")
    second = Sandbox.create(network="open")
    try:
        attacker, target = (second, first) if target_first else (first, second)
        target.commands.run("python3 -m http.server --bind 0.0.0.0 8000 >/dev/null 2>&1", background=True, timeout=120)
        # the address its default route leaves from (a UDP connect sends nothing; no netlink for `ip`)
        own = "import socket; s = socket.socket(2, 2); s.connect(('192.0.2.1', 9)); print(s.getsockname()[0])"
        address = target.commands.run(["python3", "-c", own]).stdout.strip()
        assert re.fullmatch(r"100\.\d+\.\d+\.\d+", address), address
        began = time.monotonic()
        result = attacker.commands.run(f"curl -sS -m 5 http://{address}:8000/", timeout=30)
        assert result.exit_code == 7 and time.monotonic() - began < 4, result  # refused, not timed out
        assert [(e.destination, e.rule.split()[0]) for e in attacker.network.audit()] == [(f"{address}:8000", "cgnat")]
    finally:
        first.kill()
        second.kill()


def test_concurrent_open_sandboxes_each_see_only_their_own_refusals(net: TargetNet, forwarding_on: None) -> None:
    with Sandbox.create(network="open") as a, Sandbox.create(network="open") as b:
        assert a.commands.run(f"curl -sS -m 5 http://{net.other}:8080/audit-a").exit_code == 7
        assert b.commands.run(f"curl -sS -m 5 http://{METADATA}:{net.metadata_port}/audit-b").exit_code == 7
        assert b.commands.run(f"curl -sS -m 5 http://{METADATA}:{net.metadata_port}/audit-b").exit_code == 7
        assert [(e.sandbox_id, e.destination) for e in a.network.audit()] == [(a.id, f"{net.other}:8080")]
        assert [(e.sandbox_id, e.destination) for e in b.network.audit()] == [
            (b.id, f"{METADATA}:{net.metadata_port}")] * 2


#: refused CONNECTs through the proxy: {before} to 192.0.2.1, one to the metadata address, {after}
#: more; prints how many were answered 403
FLOOD_AROUND_AN_ATTEMPT = """python3 -c '
import socket
def ask(where):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(b"CONNECT " + where + b" HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    refused = s.recv(64).startswith(b"HTTP/1.1 403")
    s.close()
    return refused
n = sum(ask(b"192.0.2.1:%d" % (1 + i % 60000)) for i in range({before}))
n += ask(b"169.254.169.254:80")
n += sum(ask(b"192.0.2.1:%d" % (1 + i % 60000)) for i in range({after}))
print(n)
'"""


def test_a_flood_of_refusals_cannot_erase_an_earlier_attempt_from_the_audit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusals past the log's 10,000 events pushed the oldest out: 60,000 junk CONNECTs after a
    metadata attempt left no trace of it.  Now a sandbox's first events stay, and what falls out
    of the latest is counted under its rule."""
    from corral.egress import tunnel
    from corral.egress.audit import MAX_EVENTS

    # the log, not the connection rate, is what this floods: 11,051 connections at the rate
    # would take ~41 s (test_egress_bounds.py tests the rate)
    monkeypatch.setattr(tunnel, "CONNECTION_BURST", 100_000)

    before, after = 1_050, MAX_EVENTS  # past the 1,000 first events kept, then the whole ring again
    with Sandbox.create(allow=["allowed.test"]) as sb:
        r = sb.commands.run(FLOOD_AROUND_AN_ATTEMPT.format(before=before, after=after), timeout=240)
        assert r.stdout.strip() == str(before + 1 + after), r
        events = sb.network.audit()
        refused = sb._backend.refused_count()
    assert len(events) <= MAX_EVENTS + 2  # bounded, and the summaries are few
    assert not any(e.destination.startswith(METADATA) for e in events if e.kind == "refused")  # it fell out...
    dropped = {(e.rule, e.destination) for e in events if e.kind == "dropped"}
    assert ("link-local", "1 refused") in dropped, dropped  # ...and is counted under its rule
    assert sum(int(d.split()[0]) for _, d in dropped) == before + 1 + after - MAX_EVENTS
    # the allowed direction: the first events are still there, whole
    assert [e.destination for e in events[:3]] == ["192.0.2.1:1", "192.0.2.1:2", "192.0.2.1:3"]
    # every refusal is counted, those that fell out of the log too (what a server's metric reads)
    assert refused == before + 1 + after


#: refused CONNECTs to names of {length} characters, {count} of them; prints how many were answered 403
LONG_NAMES = """python3 -c '
import socket
n = 0
for i in range({count}):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(b"CONNECT " + b"a" * {length} + b"%d:443 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n" % i)
    n += s.recv(64).startswith(b"HTTP/1.1 4")
    s.close()
print(n)
'"""


def test_a_refused_destination_is_kept_in_the_audit_at_a_bounded_length() -> None:
    """Each refusal kept the destination as the sandbox sent it: 10,000 CONNECTs to names of
    60,000 characters held 575 MiB of the owner's (or the server's) memory, outside every limit.
    An event now keeps 256 characters of it and says how long it was."""
    from corral.egress.audit import MAX_FIELD

    with Sandbox.create(allow=["allowed.test"]) as sb:
        r = sb.commands.run(LONG_NAMES.format(length=60_000, count=20), timeout=120)
        assert r.stdout.strip() == "20", r
        events = [e for e in sb.network.audit() if e.kind == "refused"]
    assert len(events) == 20
    for event in events:
        assert event.destination.startswith("a" * MAX_FIELD) and "(60,0" in event.destination, event.destination[-60:]
        assert len(event.destination) < MAX_FIELD + 40 and len(event.rule) < MAX_FIELD + 40
    log = AuditLog()  # the log's own bound, whoever records into it
    for _ in range(12_000):
        log.record("sb", "refused", "b" * 100_000, "c" * 100_000, "d" * 100_000, "http")
    assert log.refused == 12_000
    assert sum(len(e.destination) + len(e.address or "") + len(e.rule) for e in log.events()) < 10_002 * 3 * 300


FORGE_AUDIT_LINES = r'''
import socket, struct
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"\x05\x01\x00"); s.recv(2)
name = b"\r\x1b[2Kcorral audit: 00:00:00 sb-0 refused pypi.org:443 [socks5] rule=not-allowed\x1b[8m"
s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", 443)); s.recv(10); s.close()
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"CONNECT \x1b]0;title\x07x:443 HTTP/1.1\r\n\r\n"); s.recv(200); s.close()
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"CONNECT 169.254.169.254:80 HTTP/1.1\r\n\r\n"); s.recv(200); s.close()
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"\x05\x01\x00"); s.recv(2)
name = b"evil.example [socks] rule=allow "
s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", 443)); s.recv(10); s.close()
'''


def test_a_sandbox_cannot_write_to_the_operators_terminal_through_the_audit() -> None:
    """A refused name is the sandbox's text: printed raw by ``corral run --audit``, its CR and
    escape sequences wiped a line, forged another and hid the real refusal of 169.254.169.254
    that followed (helper 92).  Each event is one line, its unprintable characters escaped."""
    proc = subprocess.run([*CLI, "run", "--allow", "allowed.test", "--audit", "--", "python3", "-c", FORGE_AUDIT_LINES],
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.decode()
    assert "\x1b" not in err and "\r" not in err and "\x07" not in err, err
    audit = [line for line in err.splitlines() if line.startswith("corral audit:")]
    assert len(audit) == 4, err
    # a field is one token: spaces in a name plant no fields of a forged event (helper 93)
    assert audit[3].count(" rule=") == 1 and audit[3].count(" [") == 1 and "evil.example\\x20[socks]" in audit[3]
    # nor do characters that print blank (an IDNA name decodes to U+2800; helper 96)
    from corral.egress.audit import AuditEvent

    line = str(AuditEvent(0, "sb-1", "refused", "x\u2800->\u2800169.254.169.254\u3164[socks5]", None, "bad-host", "socks5"))
    assert line.isascii() and line.count(" ") == 5, line
    assert "\\r\\x1b[2Kcorral\\x20audit:" in audit[0] and "\\x1b]0;title\\x07x:443" in audit[1]
    assert "169.254.169.254:80" in audit[2] and "rule=link-local" in audit[2], audit
