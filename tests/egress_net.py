"""A throwaway test network: a namespace with a veth pair to the host, targets inside it.

Addresses (a random free 10.a.b.0/24):
  .1  the host's end of the veth
  .2  the allowed target: HTTP :8080 (with /git/ smart HTTP), HTTPS :8443 (own test CA)
  .3  another RFC1918 server: HTTP :8080
  169.254.169.254:PORT  a fake metadata server, routed from the host (policy rule for
                        that one TCP port only) for as long as the network lives
Also a listener on the host's loopback.  Every name here starts with ``prefix`` (``crl``);
:meth:`TargetNet.close` removes all of it and checks that it is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from corral.host import netns

METADATA = "169.254.169.254"
HERE = Path(__file__).parent


def _free_subnet() -> tuple[int, int]:
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for _ in range(100):
        a, b = random.randrange(200, 250), random.randrange(1, 254)
        if f" 10.{a}.{b}." not in used:
            return a, b
    raise RuntimeError("no free 10.x.y.0/24")


def make_ca(directory: Path, hosts: list[str]) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for ``hosts`` (names or IPs): (ca.pem, cert.pem, key.pem)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "corral test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False).sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def make_git_repo(root: Path) -> None:
    work = root / "work"
    work.mkdir()
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    (work / "README").write_text("cloned through the egress proxy\n")
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "README"], ["git", "commit", "-qm", "first"]):
        subprocess.run(argv, cwd=work, env=env, check=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(root / "repo.git")], check=True)


@dataclass
class TargetNet:
    suffix: str = field(default_factory=netns.new_suffix)
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="crl-testnet-")))
    #: first letters of the namespace's and the veth's names (tests of separate areas use their own)
    prefix: str = "crl"

    def __post_init__(self) -> None:
        self.ns = f"{self.prefix}-t{self.suffix}"
        self.host_if, self.ns_if = f"{self.prefix}{self.suffix}h", f"{self.prefix}{self.suffix}n"
        a, b = _free_subnet()
        self.host_side, self.target, self.other = f"10.{a}.{b}.1", f"10.{a}.{b}.2", f"10.{a}.{b}.3"
        self.metadata_port = random.randrange(20000, 30000)
        self.table = random.randrange(20000, 30000)
        self.log = self.tmp / "hits.jsonl"
        self.log.touch()
        # what a killed test run leaves is found again by this file (reap_dead_target_nets)
        (self.tmp / "owner.json").write_text(json.dumps({
            "pid": os.getpid(), "ns": self.ns, "host_if": self.host_if, "table": self.table,
            "rule": self._metadata_rule()}))
        self._server: subprocess.Popen[str] | None = None
        self._rule: list[str] = []
        self.loopback_hits: list[str] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _metadata_rule(self) -> list[str]:
        return ["to", f"{METADATA}/32", "ipproto", "tcp", "dport", str(self.metadata_port),
                "lookup", str(self.table), "priority", str(self.table)]

    def _start(self) -> None:
        self.ca, cert, key = make_ca(self.tmp, ["target.test", self.target])
        (self.tmp / "git").mkdir()
        make_git_repo(self.tmp / "git")
        netns.create_netns(self.ns)
        netns.create_veth(self.host_if, self.ns_if, self.ns, f"{self.host_side}/24", f"{self.target}/24",
                          (f"{self.other}/24", f"{METADATA}/32"))
        subprocess.run(["ip", "route", "add", f"{METADATA}/32", "via", self.target, "dev", self.host_if,
                        "table", str(self.table)], check=True)
        self._rule = self._metadata_rule()
        subprocess.run(["ip", "rule", "add", *self._rule], check=True)
        config = {
            "log": str(self.log), "git_root": str(self.tmp / "git"),
            "servers": [
                {"name": "target", "addr": self.target, "port": 8080},
                {"name": "target-tls", "addr": self.target, "port": 8443, "cert": str(cert), "key": str(key)},
                {"name": "other", "addr": self.other, "port": 8080},
                {"name": "metadata", "addr": METADATA, "port": self.metadata_port},
            ],
        }
        (self.tmp / "config.json").write_text(json.dumps(config))
        self._server = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, sys.executable, str(HERE / "egress_targets.py"),
             str(self.tmp / "config.json")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._server.stdout is not None
        assert self._server.stdout.readline().strip() == "ready"
        hits = self.loopback_hits

        class Loopback(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._loopback = ThreadingHTTPServer(("127.0.0.1", 0), Loopback)
        self.loopback_port = self._loopback.server_address[1]
        threading.Thread(target=self._loopback.serve_forever, daemon=True).start()

    def resolver(self) -> Any:
        """Names for the tests: target.test, other.test, metadata.test, rebind.test (rebinding)."""
        answers = {"target.test": [self.target], "other.test": [self.other], "metadata.test": [METADATA],
                   "loop.test": ["127.0.0.1"]}
        rebind_count = [0]

        def resolve(name: str) -> list[str]:
            if name == "rebind.test":
                rebind_count[0] += 1
                return [self.target] if rebind_count[0] == 1 else [METADATA]
            return answers.get(name, [])

        return resolve

    def hits(self, server: str | None = None) -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in self.log.read_text().splitlines() if line]
        return [h for h in lines if server is None or h["server"] == server]

    def close(self) -> None:
        if self._server is not None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            self._server.wait(timeout=10)
        if hasattr(self, "_loopback"):
            self._loopback.shutdown()
            self._loopback.server_close()
        if self._rule:
            subprocess.run(["ip", "rule", "del", *self._rule], check=False)
        subprocess.run(["ip", "route", "flush", "table", str(self.table)], check=False, capture_output=True)
        netns.delete_netns(self.ns)
        netns.delete_link(self.host_if)
        subprocess.run(["rm", "-rf", str(self.tmp)], check=False)
        assert not netns.netns_exists(self.ns) and not netns.link_exists(self.host_if)


def reap_dead_target_nets() -> None:
    """Target networks of test runs that were killed (their close() never ran): namespace, veth,
    policy rule and route table, found by the owner file each one writes."""
    for owner_file in Path(tempfile.gettempdir()).glob("crl-testnet-*/owner.json"):
        try:
            owner = json.loads(owner_file.read_text())
        except (OSError, ValueError):
            continue
        if Path(f"/proc/{owner['pid']}").exists():
            continue
        subprocess.run(["ip", "rule", "del", *owner["rule"]], check=False, capture_output=True)
        subprocess.run(["ip", "route", "flush", "table", str(owner["table"])], check=False, capture_output=True)
        netns.delete_netns(owner["ns"])
        netns.delete_link(owner["host_if"])
        subprocess.run(["rm", "-rf", str(owner_file.parent)], check=False)


def udp_sink(net: TargetNet, timeout: float) -> tuple[subprocess.Popen[str], int]:
    """A UDP listener on the target address that prints each datagram it gets until ``timeout``
    seconds pass without one (read it with ``communicate``); returns it and its port.  Skips the
    test where strict reverse-path filtering would drop forged sources before our rules see them."""
    strict = max(int(Path(f"/proc/sys/net/ipv4/conf/{c}/rp_filter").read_text()) for c in ("all", "default"))
    if strict == 1:
        pytest.skip("strict rp_filter on this host drops forged sources before our rule sees them")
    port = 20000 + os.getpid() % 10000
    listener = subprocess.Popen(
        ["ip", "netns", "exec", net.ns, sys.executable, "-c", (
            "import socket\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"s.bind(('{net.target}', {port})); s.settimeout({timeout})\n"
            "print('ready', flush=True)\n"
            "try:\n"
            "    while True:\n"
            "        print(s.recvfrom(100)[0].decode(), flush=True)\n"
            "except OSError:\n"
            "    pass\n"
        )], stdout=subprocess.PIPE, text=True)
    assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
    return listener, port


IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


@contextlib.contextmanager
def target_net(prefix: str = "crl") -> Iterator[TargetNet]:
    """A :class:`TargetNet` with the library's resolver and upstream CA pointed at it, both undone after."""
    from corral.egress import network as egress

    testnet = TargetNet(prefix=prefix)
    previous = egress.configure(resolver=testnet.resolver(), upstream_cafile=str(testnet.ca))
    try:
        yield testnet
    finally:
        egress.configure(**previous.__dict__)
        testnet.close()


@contextlib.contextmanager
def ip_forwarding() -> Iterator[Path]:
    """Open mode needs IPv4 forwarding: the sysctl, put back as it was afterwards (tests set it)."""
    before = IP_FORWARD.read_text().strip()
    try:
        yield IP_FORWARD
    finally:
        IP_FORWARD.write_text(before)


# one attempt per line of output: "<what> failed <errno> <seconds>" (or OPEN)
ATTEMPTS = """python3 - <<'EOF'
import socket, sys, time
def attempt(what, make):
    start = time.monotonic()
    try:
        make()
        print(what, 'OPEN')
    except OSError as e:
        print(what, 'failed', e.errno, round(time.monotonic() - start, 3))
for line in sys.argv[1:] or [{lines}]:
    kind, host, port = line.split()
    if kind == 'tcp':
        attempt(line, lambda: socket.create_connection((host, int(port)), timeout=5))
    elif kind == 'udp':
        attempt(line, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', (host, int(port))))
    else:  # an ICMP echo request on a ping socket (what ping(8) uses without privileges)
        ping = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
        attempt(line, lambda: ping.sendto(bytes([8, 0, 247, 255, 0, 0, 0, 0]), (host, 0)))
EOF"""


def attempts(*lines: str) -> str:
    return ATTEMPTS.format(lines=", ".join(repr(line) for line in lines))


def assert_open_refusals_audited(sb: Any, net: TargetNet, tag: str) -> list[Any]:
    """The open mode's walls, the same in every tier: private ranges, the metadata address and the
    host's own address each refused at once (a reset or admin-prohibited, not a time-out), a UDP
    datagram too, and each attempt audited once, in order, with its rule.  Returns the events."""
    refused = [f"http://{net.other}:8080/{tag}-1", f"http://{net.other}:8080/{tag}-2",
               f"http://{METADATA}:{net.metadata_port}/{tag}-3",
               f"http://{net.host_side}:{net.loopback_port}/{tag}-4"]
    for url in refused:
        started = time.monotonic()
        result = sb.commands.run(f"curl -sS -m 5 {url}")
        assert result.exit_code == 7 and time.monotonic() - started < 3, (url, result)
    # sendto() succeeds (the packet leaves the sandbox; the host refuses it): audited all the same
    assert sb.commands.run(attempts(f"udp {net.other} 53")).exit_code == 0
    events: list[Any] = sb.network.audit()
    seen = [(e.kind, e.protocol, e.destination, e.address, e.rule) for e in events]
    assert seen == [
        ("refused", "tcp", f"{net.other}:8080", net.other, "rfc1918"),
        ("refused", "tcp", f"{net.other}:8080", net.other, "rfc1918"),
        ("refused", "tcp", f"{METADATA}:{net.metadata_port}", METADATA, "link-local"),
        ("refused", "tcp", f"{net.host_side}:{net.loopback_port}", net.host_side, "host-address"),
        ("refused", "udp", f"{net.other}:53", net.other, "rfc1918"),
    ], seen
    return events
