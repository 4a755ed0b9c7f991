"""A brokered secret echoed back by its bound host, compressed or encoded, never reaches the sandbox.

The echoing target runs in this module's own network namespace (names start with
``cecho``).  What the sandbox received is judged from the files it wrote, read
back unredacted (``read_file`` of the tier, not ``sb.files.read``, which redacts).
Costs about 10-15 s on 2 cores (process tier; gVisor and microVM add their own).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.util
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from corral import Sandbox
from corral.egress.echo_forms import EchoMatcher, EchoStream
from corral.egress.echo_guard import Cut, ResponseGuard
from corral.secrets import SecretBinding, materialize
from echo_payloads import FORMS, decode_echo, echo_body, ordinary_body
from egress_net import TargetNet, target_net

from .tier_probe import skip_unless_tier

# '+', '/' and '~' make the URL, base64 and base64url forms differ from the raw one
SECRET = "sk-echo-7Hq2+/Zx9~0123456789abcdef"
CODINGS = ("chunked", "gzip", "deflate")  # chunked: identity, 5 bytes a chunk, each its own write
CLIENTS = {
    "curl": 'curl -fsS --compressed -H "X-Key: $API_TOKEN" -o {out} "{url}"',
    "requests": "python3 -c \"import os,requests,sys;r=requests.get(sys.argv[1],headers={{'X-Key':"
                "os.environ['API_TOKEN']}});r.raise_for_status();open(sys.argv[2],'wb').write(r.content)\" "
                "'{url}' {out}",
    "node": "node -e \"fetch(process.argv[1],{{headers:{{'X-Key':process.env.API_TOKEN}}}}).then(r=>r.arrayBuffer())"
            ".then(b=>require('fs').writeFileSync(process.argv[2],Buffer.from(b)))\" '{url}' {out}",
}


@pytest.fixture(scope="module")
def net() -> Iterator[TargetNet]:
    with target_net(prefix="cecho") as testnet:
        yield testnet


def _url(scheme: str, path: str, coding: str, chunk: int = 5) -> str:
    port = 8443 if scheme == "https" else 8080
    query = f"chunk={chunk}" if coding == "chunked" else f"ce={coding}&chunk={chunk + 2}"
    return f"{scheme}://target.test:{port}/{path}?{query}"


def _sandbox(net: TargetNet, **spec: Any) -> Sandbox:
    return Sandbox.create(allow=["target.test", "other.test"], secrets=["API_TOKEN@target.test"],
                          unsafe_allow_ranges=[f"{net.target}/32", f"{net.other}/32"],
                          secret_values={"API_TOKEN": SECRET}, **spec)


def _raw_file(sb: Sandbox, path: str) -> bytes:
    return sb._tier_sandbox().read_file(path, 16 << 20)  # unredacted: what the sandbox really holds


def _assert_no_secret(body: bytes, placeholder: str, what: str) -> None:
    """Every encoding's line, decoded the way a program in the sandbox would decode it, holds the
    placeholder (base64: a mask of the same length) and not the value."""
    assert SECRET.encode() not in body, what
    decoded = decode_echo(body)
    assert set(decoded) == set(FORMS), (what, body[:300])
    for name, value in decoded.items():
        assert SECRET.encode() not in value, (what, name, value)
        if name.startswith("base64"):
            assert b"*" * (len(SECRET) - 2) in value, (what, name, value)
        else:
            assert placeholder.encode() in value, (what, name, value)


def test_echoed_secret_in_every_encoding_never_reaches_the_sandbox(net: TargetNet) -> None:
    """curl, requests and Node; HTTP and intercepted HTTPS; chunked identity, gzip and deflate
    (sent whatever the proxy asked for); 15 encodings of the value in each body."""
    with _sandbox(net) as sb:
        placeholder = sb.network.env["API_TOKEN"]
        script = ["mkdir -p /tmp/echo"]
        names = []
        for client, template in CLIENTS.items():
            for scheme in ("http", "https"):
                for coding in CODINGS:
                    name = f"{client}-{scheme}-{coding}"
                    names.append(name)
                    script.append(template.format(out=f"/tmp/echo/{name}", url=_url(scheme, f"echoenc/{name}", coding))
                                  + f" || echo FAILED {name}")
        run = sb.commands.run("\n".join(script), timeout=120)
        assert run.exit_code == 0 and "FAILED" not in run.stdout, run
        for name in names:
            _assert_no_secret(_raw_file(sb, f"/tmp/echo/{name}"), placeholder, name)
        # the host did get the real value, and was asked for an unencoded answer
        hits = [h for h in net.hits() if h["path"].startswith("/echoenc/")]
        assert len(hits) == len(names)
        assert {h["headers"]["X-Key"] for h in hits} == {SECRET}
        assert {h["headers"].get("Accept-Encoding") for h in hits} == {"identity"}
        events = [e for e in sb.network.audit() if e.kind == "secret-echo"]
    where = {(e.destination, e.protocol) for e in events}
    assert where == {("target.test:8080", "http"), ("target.test:8443", "https")}, where
    rules = {e.rule for e in events}
    for encoding in ("raw", "base64", "base64url", "hex", "url-encoding", "json-escape", "html-entity"):
        for coding in ("", " inside gzip", " inside deflate"):
            assert f"secret API_TOKEN echoed as {encoding}{coding}" in rules, (encoding, coding, rules)


def test_ordinary_bodies_pass_unchanged(net: TargetNet) -> None:
    """No false positive corrupts ordinary data from a bound host (decoded for the scan and served
    decoded), and a host with no secret bound is not scanned at all: its gzip arrives as sent."""
    expected = hashlib.sha256(ordinary_body()).hexdigest()
    with _sandbox(net) as sb:
        lines = []
        for client, template in CLIENTS.items():
            for scheme in ("http", "https"):
                for coding in CODINGS:
                    out = f"/tmp/{client}-{scheme}-{coding}"
                    lines.append(template.format(out=out, url=_url(scheme, "ordinary", coding, 4093)) + f" && sha256sum {out}")
        # curl without --compressed: a bound host's body is served decoded, another host's as sent
        lines.append('curl -fsS -o /tmp/bound.raw "http://target.test:8080/ordinary?ce=gzip" && sha256sum /tmp/bound.raw')
        lines.append('curl -fsS -o /tmp/other.gz "http://other.test:8080/ordinary?ce=gzip" && sha256sum /tmp/other.gz')
        run = sb.commands.run("\n".join(lines), timeout=120)
        assert run.exit_code == 0, run
        sums = dict(reversed(line.split()) for line in run.stdout.splitlines())
        assert len(sums) == len(lines)
        other = sums.pop("/tmp/other.gz")
        assert set(sums.values()) == {expected}, sums
        assert gzip.decompress(_raw_file(sb, "/tmp/other.gz")) == ordinary_body()
        assert other == hashlib.sha256(_raw_file(sb, "/tmp/other.gz")).hexdigest()
        assert [e for e in sb.network.audit() if e.kind == "secret-echo"] == []


def test_what_cannot_be_scanned_is_refused_and_audited(net: TargetNet) -> None:
    """A coding this host has no decoder for gets a 502 before any byte of the body (br or zstd
    without their modules; decoded and masked with them); a corrupt gzip body is cut off."""
    with _sandbox(net) as sb:
        placeholder = sb.network.env["API_TOKEN"]
        for coding, module in (("br", "brotli"), ("zstd", "zstandard")):
            got = sb.commands.run(f'curl -sS -o /tmp/{coding} -w "%{{http_code}}" -H "X-Key: $API_TOKEN" '
                                  f'"http://target.test:8080/echoenc?ce={coding}"')
            if importlib.util.find_spec(module) is None:
                assert got.stdout == "502", got
                assert b"cannot be checked for brokered secrets" in _raw_file(sb, f"/tmp/{coding}")
            else:
                assert got.stdout == "200", got
                _assert_no_secret(_raw_file(sb, f"/tmp/{coding}"), placeholder, coding)
        bad = sb.commands.run('curl -sS -H "X-Key: $API_TOKEN" "https://target.test:8443/echoenc?ce=bad-gzip"')
        assert bad.exit_code != 0 and SECRET not in bad.stdout, bad
        refused = [(e.destination, e.rule) for e in sb.network.audit() if e.kind == "refused"]
    expected = [("target.test:8080", f"unscannable-encoding:{c}") for c, m in (("br", "brotli"), ("zstd", "zstandard"))
                if importlib.util.find_spec(m) is None]
    assert refused == [*expected, ("target.test:8443", "malformed-response")], refused


def _guard_output(response: bytes, step: int, **kw: Any) -> tuple[bytes, list[str]]:
    secret = materialize([SecretBinding("API_TOKEN", ("h",))], {"API_TOKEN": SECRET})
    found: list[str] = []
    guard = ResponseGuard(EchoMatcher(secret), lambda form, where: found.append(where), **kw)
    out = b""
    for i in range(0, len(response), step):
        out += b"".join(guard.feed(response[i:i + step]))
        if guard.done:
            break
    if not guard.done:
        out += b"".join(guard.finish())
    return out, found


def _dechunk(body: bytes) -> bytes:
    out = b""
    while True:
        size, _, body = body.partition(b"\r\n")
        if int(size, 16) == 0:
            return out
        out, body = out + body[:int(size, 16)], body[int(size, 16) + 2:]


def test_every_split_of_every_form_is_caught() -> None:
    """The scanner fed one byte at a time and at every split point of the value's forms; the guard
    with each framing and coding, one byte per read; a value in a response header; no echo after
    101 Switching Protocols (it cannot be rewritten there: the connection is cut)."""
    secret = materialize([SecretBinding("API_TOKEN", ("h",))], {"API_TOKEN": SECRET})
    matcher = EchoMatcher(secret)
    body = echo_body(SECRET)
    for split in range(1, len(body)):
        stream = EchoStream(matcher, lambda form: None)
        out = b"".join((stream.feed(body[:split]), stream.feed(body[split:]), stream.finish()))
        assert SECRET.encode() not in out and all(SECRET.encode() not in v for v in decode_echo(out).values())
    ordinary = ordinary_body()
    stream = EchoStream(matcher, lambda form: None)
    pieces = [stream.feed(ordinary[i:i + 4093]) for i in range(0, len(ordinary), 4093)]
    assert b"".join([*pieces, stream.finish()]) == ordinary
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 3]), body[i:i + 3]) for i in range(0, len(body), 3))
    for head, payload in (
            (b"Content-Length: %d" % len(body), body),
            (b"Transfer-Encoding: chunked", chunked + b"0\r\nX-Trailer: 1\r\n\r\n"),
            (b"Content-Encoding: gzip\r\nContent-Length: %d" % len(gzip.compress(body)), gzip.compress(body)),
            (b"Content-Encoding: deflate", zlib.compress(body)),  # until close
            (b"Content-Encoding: deflate", zlib.compress(body)[2:-4]),  # raw deflate, as some servers send
            (b"Content-Encoding: gzip, gzip", gzip.compress(gzip.compress(body)))):
        out, found = _guard_output(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n\r\n" + payload, 1)
        got_head, _, got = out.partition(b"\r\n\r\n")
        assert b"Transfer-Encoding: chunked" in got_head and b"Content-Encoding" not in got_head, got_head
        assert SECRET.encode() not in _dechunk(got)
        assert len(decode_echo(_dechunk(got))) == len(FORMS) and len(found) == 7, (head, found)
    out, found = _guard_output(b"HTTP/1.0 200 OK\r\nX-Echo: " + base64.b64encode(SECRET.encode()) + b"\r\n\r\nok", 4,
                               http11_client=False)
    assert out.endswith(b"Connection: close\r\n\r\nok") and found == ["base64 in the head"], (out, found)
    with pytest.raises(Cut):
        _guard_output(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n\x81\x20" + SECRET.encode(), 2)


@pytest.mark.parametrize("tier", ["gvisor", "microvm"])
def test_every_tier_with_allow_scans_echoes_too(tier: str, net: TargetNet, state_dir: Path) -> None:
    """gVisor (its socket bound in) and the microVM (through its egress bridge) reach the same
    proxy: gzip and chunked echoes over HTTP and HTTPS (curl only: a microVM command costs TCG time)."""
    skip_unless_tier(tier, state_dir)
    with _sandbox(net, tier=tier, memory="256M") as sb:
        placeholder = sb.network.env["API_TOKEN"]
        script = [CLIENTS["curl"].format(out=f"/tmp/{s}-{c}", url=_url(s, f"echoenc/{tier}", c))
                  for s in ("http", "https") for c in ("gzip", "chunked")]
        run = sb.commands.run(" && ".join(script), timeout=120)
        assert run.exit_code == 0, run
        for s in ("http", "https"):
            for c in ("gzip", "chunked"):
                _assert_no_secret(_raw_file(sb, f"/tmp/{s}-{c}"), placeholder, f"{tier} {s} {c}")
        assert {e.protocol for e in sb.network.audit() if e.kind == "secret-echo"} == {"http", "https"}


def test_a_response_head_dribbled_a_byte_at_a_time_costs_the_owner_little_cpu() -> None:
    """The guard reads the response heads of hosts the owner bound a secret to, in the owner's
    process (charged to no sandbox).  Each piece of an unfinished head was appended to a copy of
    all before it and the whole searched again: a 62 KiB head a byte at a time took 1.24 s of the
    owner's CPU; now only the new bytes are searched (0.05 s)."""
    head = (b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-Pad-%05d: %s\r\n" % (i, b"a" * 40) for i in range(1150))
            + b"Content-Length: 2\r\n\r\nok")
    assert 60 << 10 < len(head) < 64 << 10  # under the guard's bound on a head
    started = time.process_time()
    out, found = _guard_output(head, 1)
    took = time.process_time() - started
    assert found == [] and b"X-Pad-01149: " in out and _dechunk(out.partition(b"\r\n\r\n")[2]) == b"ok", out[-200:]
    assert took < 0.4, f"{took:.2f} s of CPU for one dribbled head"
