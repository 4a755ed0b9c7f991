"""Egress policy end to end: real namespaces, real servers, real clients inside real sandboxes.

Every refusal is checked both ways: the target is reachable from the host (so
the refusal is the policy's, not a broken route) and no request reached it.
Costs about 15 s on 2 cores (a handful of sandboxes, one test network).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from corral import Sandbox
from corral.commands import check_call
from egress_net import METADATA, TargetNet, ip_forwarding, target_net
from sandbox_wait import wait_until


@pytest.fixture(scope="module")
def net() -> Iterator[TargetNet]:
    with target_net() as testnet:
        yield testnet


def test_allowed_target_works_from_every_client(net: TargetNet) -> None:
    allow = ["target.test", f"{net.target}:8080"]
    with Sandbox.create(allow=allow, unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        sb.files.write("/tmp/testca.pem", net.ca.read_bytes())
        ca = "SSL_CERT_FILE=/tmp/testca.pem"
        checks = {
            "curl-http": "curl -fsS http://target.test:8080/c1",
            "curl-https": "curl -fsS --cacert /tmp/testca.pem https://target.test:8443/c2",
            "curl-ip": f"curl -fsS http://{net.target}:8080/c3",
            "curl-socks5": "curl -fsS --proxy socks5h://127.0.0.1:3128 http://target.test:8080/c4",
            "py-http": "python3 -c \"import urllib.request as u;print(u.urlopen('http://target.test:8080/p1').read().decode(),end='')\"",
            "py-requests": "python3 -c \"import requests;print(requests.get('http://target.test:8080/r1').text,end='')\"",
            "py-requests-https": "REQUESTS_CA_BUNDLE=/tmp/testca.pem python3 -c "
                                 "\"import requests;print(requests.get('https://target.test:8443/r2').text,end='')\"",
            "py-https": f"{ca} python3 -c \"import urllib.request as u;print(u.urlopen('https://target.test:8443/p2').read().decode(),end='')\"",
        }
        for name, cmd in checks.items():
            result = sb.commands.run(cmd, timeout=30)
            assert result.exit_code == 0, (name, result)
            assert result.stdout.startswith("hello from target"), (name, result.stdout)
        paths = {h["path"] for h in net.hits()}
        assert {"/c1", "/c2", "/c3", "/c4", "/p1", "/p2", "/r1", "/r2"} <= paths
        clone = sb.commands.run("git clone -q http://target.test:8080/git/repo.git /tmp/repo && cat /tmp/repo/README",
                                timeout=60)
        assert clone.exit_code == 0, clone
        assert clone.stdout == "cloned through the egress proxy\n"
        assert sb.network.audit() == []
        fetch = ("node -e \"fetch(process.argv[1]).then(r=>r.text()).then(t=>process.stdout.write(t),"
                 "e=>{console.error(String(e.cause||e));process.exit(3)})\" ")
        for url in ("http://target.test:8080/n1", "https://target.test:8443/n2"):
            node = sb.commands.run(f"NODE_EXTRA_CA_CERTS=/tmp/testca.pem {fetch} {url}", timeout=30)
            assert node.stdout.startswith("hello from target"), (url, node)
        refused = sb.commands.run(f"{fetch} http://{METADATA}:{net.metadata_port}/n3", timeout=30)
        assert refused.exit_code == 3 and "403" in refused.stderr, refused
        assert [e.rule for e in sb.network.audit()] == ["link-local"]


def test_everything_else_is_refused_and_audited(net: TargetNet) -> None:
    # control: from the host, without the proxy, every target answers
    for url in (f"http://{METADATA}:{net.metadata_port}/control", f"http://{net.other}:8080/control",
                f"http://127.0.0.1:{net.loopback_port}/control"):
        assert urllib.request.urlopen(url, timeout=5).status == 200
    before = len(net.hits("metadata")), len(net.hits("other")), len(net.loopback_hits)
    port = net.metadata_port
    allow = ["target.test", "metadata.test", "rebind.test", "loop.test", "other.test", "*.anything.example",
             f"{METADATA}", f"{net.other}", "127.0.0.1", f"{net.host_side}", f"{net.target}:8080"]
    with Sandbox.create(allow=allow, unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        refused = {
            f"http://{METADATA}:{port}/ip": "link-local",
            f"http://metadata.test:{port}/name": "link-local",
            f"http://2852039166:{port}/decimal": "link-local",
            f"http://0xa9fea9fe:{port}/hex": "link-local",
            f"http://0251.0376.0251.0376:{port}/octal": "link-local",
            f"http://169.254.43518:{port}/short": "link-local",
            f"http://[::ffff:169.254.169.254]:{port}/mapped": "link-local",
            f"http://[::ffff:a9fe:a9fe]:{port}/mapped-hex": "link-local",
            f"http://{net.other}:8080/rfc1918": "rfc1918",
            "http://other.test:8080/rfc1918-name": "rfc1918",
            f"http://loop.test:{net.loopback_port}/loopback": "loopback",
            f"http://{net.host_side}:8080/host-side": "rfc1918",
            f"http://{net.target}:9/port-not-listed": "not-allowed",
            "http://unlisted.test/": "not-allowed",
        }
        for url, rule in refused.items():
            result = sb.commands.run(f"curl -sS -w ' %{{http_code}}' '{url}'", timeout=30)
            assert result.stdout.endswith(f"refused by rule {rule}\n 403"), (url, result)
        # https through CONNECT and SOCKS5 are refused the same way
        assert sb.commands.run(f"curl -sS -k https://{METADATA}:{port}/").exit_code != 0
        socks = "curl -sS --proxy socks5h://127.0.0.1:3128"
        assert sb.commands.run(f"{socks} http://metadata.test:{port}/").exit_code != 0
        assert sb.commands.run(f"curl -sS --proxy socks5://127.0.0.1:3128 http://{net.other}:8080/").exit_code != 0
        # DNS rebinding: the first answer is the target, the second the metadata address
        first = sb.commands.run("curl -sS http://rebind.test:8080/rebind-1")
        assert first.stdout == "hello from target\n", first
        second = sb.commands.run(f"curl -sS -o /dev/null -w '%{{http_code}}' http://rebind.test:{port}/rebind-2")
        assert second.stdout == "403"
        # raw sockets, UDP and ICMP around the proxy fail at once: the namespace refuses all but loopback
        raw = sb.commands.run(
            "python3 - <<'EOF'\n"
            "import socket\n"
            "def attempt(make, what):\n"
            "    try:\n"
            "        make()\n"
            "        print(what, 'OPEN')\n"
            "    except OSError as e:\n"
            "        print(what, 'failed', e.errno)\n"
            f"attempt(lambda: socket.create_connection(('{net.target}', 8080), timeout=3), 'tcp-target')\n"
            f"attempt(lambda: socket.create_connection(('{METADATA}', {port}), timeout=3), 'tcp-metadata')\n"
            "udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"attempt(lambda: udp.sendto(b'x', ('{net.target}', 53)), 'udp')\n"
            "attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP), 'icmp-raw')\n"
            "ping = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)\n"
            f"attempt(lambda: ping.sendto(bytes([8, 0, 247, 255, 0, 0, 0, 0]), ('{METADATA}', 0)), 'icmp-ping')\n"
            "EOF", timeout=30)
        assert raw.exit_code == 0, raw
        assert "OPEN" not in raw.stdout and raw.stdout.count("failed") == 5, raw.stdout
        events = sb.network.audit()
    direct = [e for e in events if e.rule == "raw-socket"]
    assert [(e.protocol, e.destination) for e in direct] == [
        ("tcp", f"{net.target}:8080"), ("tcp", f"{METADATA}:{port}"), ("udp", f"{net.target}:53"),
        ("icmp", METADATA)]  # the raw socket was never created: nothing was sent
    events = [e for e in events if e.rule != "raw-socket"]
    assert len(net.hits("metadata")) == before[0], net.hits("metadata")
    assert len(net.hits("other")) == before[1]
    assert len(net.loopback_hits) == before[2]
    assert [h["path"] for h in net.hits("target") if h["path"].startswith("/rebind")] == ["/rebind-1"]
    by_path = {e.destination: e for e in events}
    assert all(e.kind == "refused" and e.sandbox_id == sb.id for e in events)
    assert by_path[f"169.254.169.254:{port}"].rule == "link-local"
    assert by_path[f"metadata.test:{port}"].address == METADATA
    assert by_path[f"rebind.test:{port}"].address == METADATA
    assert by_path["unlisted.test:80"].rule == "not-allowed"
    assert {e.protocol for e in events} >= {"http", "http-connect", "socks5"}
    rules = {e.rule for e in events}
    assert {"link-local", "rfc1918", "loopback", "not-allowed"} <= rules


def test_unsafe_range_reenables_exactly_that_range(net: TargetNet) -> None:
    port = net.metadata_port
    with Sandbox.create(allow=[METADATA, net.other], unsafe_allow_ranges=[f"{METADATA}/32"]) as sb:
        ok = sb.commands.run(f"curl -fsS http://{METADATA}:{port}/reenabled")
        assert ok.stdout == "hello from metadata\n", ok
        still = sb.commands.run(f"curl -sS -o /dev/null -w '%{{http_code}}' http://{net.other}:8080/")
        assert still.stdout == "403"


def _host_service() -> tuple[ThreadingHTTPServer, list[str]]:
    """A service of the host's on every address (as a host's own services listen), serving, and
    the paths asked of it."""
    hits: list[str] = []

    class HostService(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "13")
            self.end_headers()
            self.wfile.write(b"host service\n")

        def log_message(self, *args: object) -> None:
            pass

    service = ThreadingHTTPServer(("0.0.0.0", 0), HostService)
    threading.Thread(target=service.serve_forever, daemon=True).start()
    return service, hits


def test_the_hosts_own_routes_and_nat_cannot_take_an_allowed_connection_inside(net: TargetNet) -> None:
    """An allowed address the host takes for itself by a ``local`` route (AnyIP, a cloud's
    forwarded load-balancer address; on no interface) reached the host's services, and one the
    host's NAT rewrote on its output path (kube-proxy's external addresses) reached an internal
    server: the policy had checked the address before the host's routing and NAT acted on it.
    Now both are refused, and a NAT to an address the policy allows still works."""
    third = random.randrange(1, 250)
    local_ip, nat_refused, nat_allowed = f"11.{third}.77.7", f"11.{third}.77.9", f"11.{third}.77.10"
    service, hits = _host_service()
    port = service.server_address[1]
    table = f"crl_nat_{net.suffix}"
    nat = (f"table ip {table} {{ chain out {{ type nat hook output priority -100; "
           f"ip daddr {nat_refused} tcp dport 80 dnat to {net.other}:8080; "
           f"ip daddr {nat_allowed} tcp dport 80 dnat to {net.target}:8080; }}; }}")
    route_local = ["local", f"{local_ip}/32", "dev", "lo", "table", "local"]
    route_nat = [f"11.{third}.77.8/29", "dev", net.host_if]
    subprocess.run(["ip", "route", "add", *route_local], check=True)
    subprocess.run(["ip", "route", "add", *route_nat], check=True)
    subprocess.run(["nft", "-f", "-"], input=nat, text=True, check=True)
    try:
        # the host itself reaches its service there: a refusal below is the policy's
        with urllib.request.urlopen(f"http://{local_ip}:{port}/from-the-host", timeout=5) as answer:
            assert answer.read() == b"host service\n"
        allow = [local_ip, nat_refused, nat_allowed]
        with Sandbox.create(allow=allow, unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
            code = "curl -sS -o /dev/null -w '%{http_code}' "
            assert sb.commands.run(f"{code} http://{local_ip}:{port}/http").stdout == "403"
            socks = sb.commands.run(f"curl -sS --proxy socks5h://127.0.0.1:3128 http://{local_ip}:{port}/socks")
            assert socks.exit_code == 97, socks  # the proxy's "not allowed"
            assert sb.commands.run(f"{code} http://{nat_refused}/nat-refused").stdout == "403"
            allowed = sb.commands.run(f"curl -fsS http://{nat_allowed}/nat-allowed")
            assert allowed.stdout.startswith("hello from target"), allowed
            assert [e.rule for e in sb.network.audit()] == ["local-route", "local-route", "rfc1918 via-host-nat"]
        assert hits == ["/from-the-host"]
        assert "/nat-refused" not in {h["path"] for h in net.hits("other")}
        assert "/nat-allowed" in {h["path"] for h in net.hits("target")}
    finally:
        subprocess.run(["nft", "delete", "table", "ip", table], check=False)
        subprocess.run(["ip", "route", "del", *route_nat], check=False)
        subprocess.run(["ip", "route", "del", *route_local], check=False)
        service.shutdown()
        service.server_close()


def _listening(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def test_the_kernel_refuses_what_the_proxy_cannot_see_of_the_hosts_nat_and_routing(net: TargetNet) -> None:
    """What the proxy asks the kernel (the route, conntrack) misses a NAT in a conntrack zone and a
    route a packet mark selects (the transparent-proxy recipe): both reached inside. The proxy's
    sockets are now made under an id the host-wide table ``corral_upstream`` knows, which refuses
    them after NAT and routing; an allowed public address is untouched."""
    third = random.randrange(1, 250)
    public, zoned, marked = f"11.{third}.78.30", f"11.{third}.78.31", f"11.{third}.78.32"
    table, route_table = f"crl_guard_{net.suffix}", str(net.table + 1)
    service, hits = _host_service()
    port = service.server_address[1]
    host = f"""table ip {table} {{
      chain raw_out {{ type filter hook output priority raw; ip daddr {zoned} ct zone set 7; }}
      chain raw_pre {{ type filter hook prerouting priority raw; ip saddr {net.other} tcp sport 8080 ct zone set 7; }}
      chain nat_out {{ type nat hook output priority -100; ip daddr {zoned} tcp dport 80 dnat to {net.other}:8080; }}
      chain route_out {{ type route hook output priority mangle; ip daddr {marked} meta mark set 0x77; }}
    }}"""
    subnet = [f"11.{third}.78.0/24", "dev", net.host_if]
    mark_rule = ["fwmark", "0x77", "lookup", route_table, "priority", route_table]
    subprocess.run(["ip", "netns", "exec", net.ns, "ip", "addr", "add", f"{public}/32", "dev", net.ns_if], check=True)
    subprocess.run(["ip", "route", "add", *subnet], check=True)
    subprocess.run(["ip", "rule", "add", *mark_rule], check=True)
    subprocess.run(["ip", "route", "add", "local", marked, "dev", "lo", "table", route_table], check=True)
    subprocess.run(["nft", "-f", "-"], input=host, text=True, check=True)
    server = subprocess.Popen(["ip", "netns", "exec", net.ns, sys.executable, "-m", "http.server", "--bind", public,
                               "8090", "--directory", str(net.tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: _listening(public, 8090), 10)
        with Sandbox.create(allow=[public, zoned, f"{marked}:{port}"]) as sb:
            reached = sb.commands.run(f"curl -sS -m 10 -o /dev/null -w '%{{http_code}}' http://{public}:8090/", timeout=60)
            assert reached.stdout == "200", reached
            zone = sb.commands.run(f"curl -sS -m 20 -o /dev/null -w '%{{http_code}}' http://{zoned}/zone", timeout=40)
            assert zone.stdout == "502", zone  # refused at once by the kernel
            mark = sb.commands.run(f"curl -sS -m 20 -o /dev/null -w '%{{http_code}}' http://{marked}:{port}/mark", timeout=40)
            assert mark.stdout in ("502", "000"), mark  # dropped as it would leave by lo
        assert "/zone" not in {h["path"] for h in net.hits("other")}
        assert hits == []
    finally:
        server.kill()
        server.wait()
        subprocess.run(["nft", "delete", "table", "ip", table], check=False)
        subprocess.run(["ip", "route", "del", "local", marked, "dev", "lo", "table", route_table], check=False)
        subprocess.run(["ip", "rule", "del", *mark_rule], check=False)
        subprocess.run(["ip", "route", "del", *subnet], check=False)
        service.shutdown()
        service.server_close()


def test_network_none_has_only_loopback(net: TargetNet) -> None:
    with Sandbox.create() as sb:
        result = sb.commands.run("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '; env | grep -ci proxy")
        assert result.stdout.split() == ["lo", "0"]
        raw = sb.commands.run(f"curl -sS -m 3 http://{net.target}:8080/none; "
                              f"python3 -c \"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
                              f".sendto(b'x', ('{net.target}', 53))\"")
        assert "Network is unreachable" in raw.stderr and raw.exit_code != 0, raw
        assert sb.network.audit() == []
    assert not [h for h in net.hits() if h["path"] == "/none"]


CLI = [sys.executable, "-c", "import sys; from corral.cli import main; sys.exit(main(sys.argv[1:]))"]
SECRET = "sk-live-0123456789abcdef-REAL"


def test_secret_reaches_only_its_host_and_never_the_sandbox(net: TargetNet) -> None:
    with Sandbox.create(allow=["target.test", "other.test"], secrets=["API_TOKEN@target.test"],
                        unsafe_allow_ranges=[f"{net.target}/32", f"{net.other}/32"],
                        secret_values={"API_TOKEN": SECRET}) as sb:
        placeholder = sb.network.env["API_TOKEN"]
        assert placeholder != SECRET and SECRET not in placeholder
        inside = sb.commands.run("echo $API_TOKEN")
        assert inside.stdout.strip() == placeholder
        auth = '-H "Authorization: Bearer $API_TOKEN"'
        for cmd in (f"curl -fsS {auth} http://target.test:8080/s-http",
                    f"curl -fsS {auth} https://target.test:8443/s-https",  # intercepted: trusts the sandbox CA
                    "python3 -c \"import os,urllib.request as u;r=u.Request('https://target.test:8443/s-py',"
                    "headers={'X-Key': os.environ['API_TOKEN']});print(u.urlopen(r).read().decode(),end='')\"",
                    "python3 -c \"import os,requests;print(requests.get('https://target.test:8443/s-req',"
                    "headers={'X-Key': os.environ['API_TOKEN']}).text)\"",
                    "node -e \"fetch('https://target.test:8443/s-node',{headers:{'X-Key':process.env.API_TOKEN}})"
                    ".then(r=>r.text()).then(t=>process.stdout.write(t))\"",
                    "node -e \"fetch('http://target.test:8080/s-node-http',{headers:{'X-Key':process.env.API_TOKEN}})"
                    ".then(r=>r.text()).then(t=>process.stdout.write(t))\"",
                    f"curl -fsS {auth} http://other.test:8080/s-other"):
            result = sb.commands.run(cmd, timeout=30)
            assert result.exit_code == 0, (cmd, result)
        got = {h["path"]: h["headers"] for h in net.hits()}
        assert got["/s-http"]["Authorization"] == f"Bearer {SECRET}"
        assert got["/s-https"]["Authorization"] == f"Bearer {SECRET}"
        assert got["/s-py"]["X-Key"] == SECRET
        assert got["/s-req"]["X-Key"] == SECRET
        assert got["/s-node"]["X-Key"] == got["/s-node-http"]["X-Key"] == SECRET
        assert got["/s-other"]["Authorization"] == f"Bearer {placeholder}"
        # git trusts the sandbox CA through GIT_SSL_CAINFO (the intercepted tunnel to a bound host)
        ls_remote = sb.commands.run("git ls-remote https://target.test:8443/git/repo.git", timeout=60)
        assert ls_remote.exit_code == 0 and "refs/heads/main" in ls_remote.stdout, ls_remote
        # a bound host echoing the value back cannot put it in the sandbox: the proxy swaps the
        # placeholder back in (every other encoding: test_egress_echo.py)
        for url in ("http://target.test:8080/echo", "https://target.test:8443/echo"):
            echo = sb._tier_sandbox().start(sb._local().request(check_call(
                f'curl -fsS -H "X-Key: $API_TOKEN" {url}', 30, None, None)), lambda _s, _c: None).wait()
            assert echo.stdout == f"you sent {placeholder}\n", (url, echo)
        assert [h["headers"]["X-Key"] for h in net.hits() if h["path"] == "/echo"] == [SECRET, SECRET]
        assert [e.rule for e in sb.network.audit() if e.kind == "secret-echo"] == [
            "secret API_TOKEN echoed as raw", "secret API_TOKEN echoed as raw"]
        withheld = [e for e in sb.network.audit() if e.kind == "secret-withheld"]
        assert [e.destination for e in withheld] == ["other.test:8080"]
        # the CA key never enters the sandbox; the real value is nowhere inside
        dump = "env; cat /proc/1/environ /etc/ssl/certs/ca-certificates.crt /.corral/egress-ca.crt; ls -la /.corral"
        raw = b""
        handle = sb._tier_sandbox().start(sb._local().request(check_call(dump, 30, None, None)),
                                          lambda _s, chunk: None)
        raw_result = handle.wait()
        raw = (raw_result.stdout + raw_result.stderr).encode()
        assert SECRET.encode() not in raw and b"PRIVATE KEY" not in raw
        assert b"BEGIN CERTIFICATE" in raw
        # a real value that does show up (here, planted by the caller) is redacted on the way out
        sb.files.write("leak.txt", f"token={SECRET}\n")
        assert sb.files.read("leak.txt") == "token=[REDACTED:API_TOKEN]\n"
        streamed: list[str] = []
        shown = sb.commands.run("cat leak.txt; cat leak.txt >&2", on_stdout=streamed.append)
        assert shown.stdout == shown.stderr == "token=[REDACTED:API_TOKEN]\n"
        assert SECRET not in "".join(streamed)


def test_secret_values_come_from_env_or_file_never_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from corral.errors import InvalidSpec
    from corral.secrets import SecretBinding, materialize

    with pytest.raises(InvalidSpec, match="never from the command line"):
        SecretBinding.parse("TOKEN=abc@host")
    with pytest.raises(InvalidSpec, match="no value found"):
        materialize([SecretBinding("CORRAL_TEST_ABSENT", ("h",))])
    monkeypatch.setenv("CORRAL_TEST_TOKEN", "from-env-value")
    secrets_file = tmp_path / "secrets"
    secrets_file.write_text("# comment\nOTHER=from-file-value\n")
    secrets_file.chmod(0o600)
    got = materialize([SecretBinding.parse("CORRAL_TEST_TOKEN@a.example"), SecretBinding.parse("OTHER@b.example")],
                      secrets_file=secrets_file)
    assert [s.value for s in got] == ["from-env-value", "from-file-value"]
    assert got[0].placeholder != materialize([got[0].binding])[0].placeholder  # fresh per sandbox
    secrets_file.chmod(0o644)
    with pytest.raises(InvalidSpec, match="world-readable"):
        materialize([], secrets_file=secrets_file)


def test_cli_allow_secret_and_audit(net: TargetNet) -> None:
    import os
    import subprocess

    port = net.metadata_port
    script = (f"curl -fsS -H \"X-Key: $CLI_TOKEN\" http://{net.target}:8080/cli-ok; "
              f"curl -sS http://{METADATA}:{port}/cli-refused; echo token=$CLI_TOKEN")
    proc = subprocess.run(
        [*CLI, "run", "--allow", f"{net.target}:8080",
         "--unsafe-allow-range", f"{net.target}/32", "--secret", f"CLI_TOKEN@{net.target}", "--audit",
         "--", "sh", "-c", script],
        env={**os.environ, "CLI_TOKEN": "cli-secret-value-42"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "hello from target" in proc.stdout
    assert "token=corral-placeholder-" in proc.stdout and "cli-secret-value-42" not in proc.stdout
    assert [h["headers"]["X-Key"] for h in net.hits() if h["path"] == "/cli-ok"] == ["cli-secret-value-42"]
    audit = [line for line in proc.stderr.splitlines() if line.startswith("corral audit:")]
    assert len(audit) == 1 and f"{METADATA}:{port}" in audit[0] and "rule=link-local" in audit[0], proc.stderr
    bad = subprocess.run([*CLI, "run", "--secret", "X=1@h", "--", "true"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 125 and "never from the command line" in bad.stderr


@pytest.fixture
def forwarding() -> Iterator[Path]:
    with ip_forwarding() as sysctl:
        yield sysctl


def _leftovers(sandbox_id: str) -> list[str]:
    from corral.egress.open_net import OpenNames
    from corral.host import netns

    names = OpenNames.for_sandbox(sandbox_id)
    found = []
    if netns.netns_exists(names.netns):
        found.append(names.netns)
    if netns.link_exists(names.host_if):
        found.append(names.host_if)
    if netns.nft_table_exists("inet", names.table):
        found.append(names.table)
    return found


def test_open_mode_nat_with_ssrf_ranges_refused(net: TargetNet, forwarding: Path) -> None:
    from corral.errors import HostNotSupported

    forwarding.write_text("0")
    with pytest.raises(HostNotSupported, match="ip_forward"):
        Sandbox.create(network="open")
    forwarding.write_text("1")
    with Sandbox.create(network="open", unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        links = sb.commands.run("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").stdout.split()
        assert links[0] == "lo" and links[1].startswith("crl") and len(links) == 2
        ok = sb.commands.run(f"curl -fsS -m 5 http://{net.target}:8080/open-ok")
        assert ok.stdout == "hello from target\n", ok
        for url in (f"http://{net.other}:8080/open-refused", f"http://{METADATA}:{net.metadata_port}/open-refused",
                    f"http://{net.host_side}:{net.loopback_port}/open-refused"):
            refused = sb.commands.run(f"curl -sS -m 5 {url}")
            assert refused.exit_code == 7, (url, refused)  # rejected at once, not timed out
        rules = {e.rule for e in sb.network.audit()}
        assert {"rfc1918", "link-local", "host-address"} <= rules
        assert not [h for h in net.hits() if h["path"] == "/open-refused"]
        assert len(_leftovers(sb.id)) == 3
    assert _leftovers(sb.id) == []


def test_nothing_survives_kill_9_of_the_owner_and_gc(net: TargetNet, forwarding: Path, state_dir: Path) -> None:
    import os
    import signal
    import subprocess

    from corral.registry import gc

    forwarding.write_text("1")
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom corral import Sandbox\n"
         "a = Sandbox.create(network='open')\n"
         f"b = Sandbox.create(allow=['{net.target}:8080'], unsafe_allow_ranges=['{net.target}/32'])\n"
         "assert b.commands.run('curl -fsS http://%s:8080/kill9' % sys.argv[1]).exit_code == 0\n"
         "print(a.id, b.id, flush=True)\ntime.sleep(600)\n", net.target],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert owner.stdout is not None and owner.stderr is not None
    ids = owner.stdout.readline().split()
    if len(ids) != 2:
        owner.kill()
        gc(state_dir)  # what the failed owner made must not leak into later tests
        raise AssertionError(f"owner failed before printing its ids: {owner.stderr.read()[-3000:]}")
    assert len(_leftovers(ids[0])) == 3
    assert _leftovers(ids[1]) == [f"crl-{ids[1][-10:]}"]  # allow mode's namespace (its table is inside)
    assert (state_dir / "sandboxes" / ids[1] / "egress" / "proxy.sock").exists()
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    reaped = gc(state_dir)
    assert set(ids) <= set(reaped)
    assert _leftovers(ids[0]) == [] and _leftovers(ids[1]) == []
    assert not (state_dir / "sandboxes" / ids[1]).exists()


def test_streamed_output_is_redacted_across_chunk_boundaries() -> None:
    from corral.secrets import Redactor, SecretBinding, StreamRedactor, materialize

    secret = materialize([SecretBinding("TOKEN", ("h.example",))], {"TOKEN": "abcdef123456"})
    out: list[tuple[str, bytes]] = []
    stream = StreamRedactor(Redactor(secret), lambda name, data: out.append((name, data)))
    for chunk in (b"x=abc", b"def12", b"3456 and a", b"bc", b" end ab"):
        stream.feed("stdout", chunk)
    stream.feed("stderr", b"abcdef")
    stream.flush()
    stdout = b"".join(d for n, d in out if n == "stdout")
    assert stdout == b"x=[REDACTED:TOKEN] and abc end ab"
    assert b"".join(d for n, d in out if n == "stderr") == b"abcdef"
    assert out[0] == ("stdout", b"x=")  # "abc" was held back: it could have begun the value
    assert all(b"abc" not in d for n, d in out[:2] if n == "stdout")


def _agent_reading(pipe: int) -> int:
    """The pid of the sandbox's agent: the process whose standard input is ``pipe``'s other end."""
    inode = f"pipe:[{os.fstat(pipe).st_ino}]"
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "fd/0") == inode and \
                    (proc / "comm").read_text().strip() == "agent":  # /.corral/agent
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError("no agent reads the channel")


def test_the_relay_listens_before_the_first_command_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox's first command finds the egress relay listening on 127.0.0.1:3128.  The relay
    used to bind in a child the agent forked at start while the agent went on to run commands: one
    first command in 30 was refused on a loaded host.  Here every ``bind`` of the agent and its
    children is held 300 ms (strace's delay injection, attached before the agent is let go), so a
    command run before the relay listens is refused every time."""
    from corral.tiers.linux import agent
    from corral.tiers.linux.frames import T_GO

    tracers: list[subprocess.Popen[bytes]] = []
    send = agent.AgentChannel.send

    def send_after_tracing(channel: agent.AgentChannel, kind: int, ident: int, payload: bytes = b"") -> None:
        if kind == T_GO and not tracers:
            pid = _agent_reading(channel._wfd)
            tracers.append(subprocess.Popen(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=bind",
                                             "-e", "inject=bind:delay_enter=300000", "-p", str(pid)]))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and "TracerPid:\t0\n" in Path(f"/proc/{pid}/status").read_text():
                time.sleep(0.01)
            assert "TracerPid:\t0\n" not in Path(f"/proc/{pid}/status").read_text(), "strace did not attach"
        send(channel, kind, ident, payload)

    monkeypatch.setattr(agent.AgentChannel, "send", send_after_tracing)
    try:
        with Sandbox.create(network="allow", allow=["example.test"]) as sb:
            assert tracers, "the process tier sends GO through AgentChannel.send"
            first = sb.commands.run(["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/3128 && echo listening"], timeout=20)
            assert first.stdout == "listening\n", first
    finally:
        for tracer in tracers:
            tracer.kill()
            tracer.wait()
