"""What a sandbox's tunnels through the egress proxy make the host hold (``egress/proxy.py``).

The proxy runs in the owner, which no cgroup bounds, and its upstream sockets draw on the host's
one TCP pool (``net.ipv4.tcp_mem``).  A sandbox that opens every tunnel it may to a server that
sends without end, and reads nothing, held 1.3 GB of it in the owner's upstream sockets alone
(512 tunnels; the pool's hard limit is 2.2 GiB here); now 256 tunnels, 8 of them at full speed.
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from corral import Sandbox
from corral.egress.tunnel import BULK_TUNNELS, MAX_CONNECTIONS, OWNER_TUNNELS
from egress_net import TargetNet, target_net
from sandbox_wait import lines_written, wait_until

PORT = 9000

#: in the target's namespace: sends to every connection until it closes (small send buffers:
#: the far end's memory is not what is measured)
SENDER = r"""
import socket, sys, threading
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1024)
chunk = b"x" * (1 << 20)
def feed(conn, limit):
    sent = 0
    try:
        while limit is None or sent < limit:
            conn.sendall(chunk); sent += len(chunk)
    except OSError:
        pass
    conn.close()
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    limit = 64 << 20 if conn.recv(1) == b"n" else None  # "n": 64 MiB then close; else endless
    threading.Thread(target=feed, args=(conn, limit), daemon=True).start()
"""

#: opens tunnels until refused and reads nothing from them
OPEN_TUNNELS = """python3 -c '
import socket, time
tunnels = []
for _ in range({n}):
    s = socket.socket(); s.settimeout(10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", 3128))
    s.sendall(b"CONNECT {target}:{port} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    if not s.recv(64).startswith(b"HTTP/1.1 200"):
        break
    s.sendall(b"e")
    tunnels.append(s)
print(len(tunnels), flush=True)
time.sleep(120)
' >/tmp/tunnels 2>&1 &"""


#: downloads 64 MiB through a tunnel (the sender's "n": 64 MiB, then it closes) and prints the count
DOWNLOAD = """python3 -c '
import socket
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"CONNECT {target}:{port} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
head = b""
while not head.endswith(b"\\r\\n\\r\\n"): head += s.recv(1)
s.sendall(b"n"); n = 0
while chunk := s.recv(1 << 20): n += len(chunk)
print(n)
'"""


@pytest.fixture(scope="module")
def net() -> Iterator[TargetNet]:
    with target_net("ceb") as testnet:
        sender = subprocess.Popen(["ip", "netns", "exec", testnet.ns, sys.executable, "-c", SENDER, testnet.target,
                                   str(PORT)], stdout=subprocess.PIPE, text=True)
        try:
            assert sender.stdout is not None and sender.stdout.readline().strip() == "ready"
            yield testnet
        finally:
            sender.kill()
            sender.wait()


def _upstream_receive_memory(net: TargetNet) -> tuple[int, int]:
    """(bytes the host's sockets toward the sender hold in their receive queues, how many)."""
    out = subprocess.run(["ss", "-tmnH", "dst", f"{net.target}:{PORT}"], capture_output=True, text=True,
                         check=True).stdout
    return sum(int(n) for n in re.findall(r"skmem:\(r(\d+)", out)), out.count("ESTAB")


def test_tunnels_that_read_nothing_hold_a_bounded_share_of_the_hosts_tcp_memory(net: TargetNet) -> None:
    with Sandbox.create(allow=[f"{net.target}:{PORT}"], unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        # the allowed thing: a 64 MiB download through a tunnel, whole
        r = sb.commands.run(DOWNLOAD.format(target=net.target, port=PORT), timeout=60)
        assert r.stdout == f"{64 << 20}\n", r.stderr
        sb.commands.run(OPEN_TUNNELS.format(n=MAX_CONNECTIONS + 10, target=net.target, port=PORT))
        assert lines_written(sb, "/tmp/tunnels", 1, 60) == f"{MAX_CONNECTIONS}\n"  # the next one is refused
        time.sleep(3)  # the sender fills whatever the windows let it
        held, sockets = _upstream_receive_memory(net)
        assert sockets == MAX_CONNECTIONS
        # 1.3 GB over 512 tunnels before; now ~4.5 MiB for each full-speed one, ~70 KiB for the rest
        bound = BULK_TUNNELS * (5 << 20) + (MAX_CONNECTIONS - BULK_TUNNELS) * (96 << 10)
        assert held < bound, f"{held >> 20} MiB in the owner's upstream sockets"
        assert any(e.rule == "too-many-connections" for e in sb.network.audit())


#: in a process whose open-files limit is 3,000 (as a server's is, where root may not raise it):
#: a sandbox per share named (comma-separated; empty: the sandbox's own, as in the library; a
#: tenant's, as ``corral serve`` assigns them), each in turn opening every tunnel it may (idle:
#: nothing is sent), then one more sandbox is made
NARROW_OWNER = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (3000, 3000))  # (soft = hard: the library raises soft to hard)
from corral import Sandbox
from corral.egress.tunnel import OWNER_TUNNELS
target, port, opener, shares = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
sandboxes = [Sandbox.create(allow=[f"{target}:{port}"], unsafe_allow_ranges=[f"{target}/32"]) for _ in shares]
try:
    for sb, share in zip(sandboxes, shares):
        if share:
            OWNER_TUNNELS.assign(sb.id, share)
    counts = []
    for sb in sandboxes:
        sb.commands.run(opener)
        deadline = time.monotonic() + 60
        while not (out := sb.commands.run("cat /tmp/tunnels").stdout) and time.monotonic() < deadline:
            time.sleep(0.5)
        counts.append(int(out))
    with Sandbox.create() as third:
        echoed = third.commands.run("echo made").stdout
    refusals = sorted({e.rule for sb in sandboxes for e in sb.network.audit()})
    print(json.dumps({"tunnels": counts, "third": echoed, "refusals": refusals}))
finally:
    for sb in sandboxes:
        sb.kill()
"""


def _narrow_owner(net: TargetNet, tmp_path: Path, shares: list[str]) -> dict[str, Any]:
    # idle tunnels: the client sends nothing, so the sender sends nothing
    opener = OPEN_TUNNELS.format(n=MAX_CONNECTIONS + 10, target=net.target, port=PORT).replace(
        '    s.sendall(b"e")\n', "")
    script = tmp_path / "narrow_owner.py"
    script.write_text(NARROW_OWNER)
    r = subprocess.run([sys.executable, str(script), net.target, str(PORT), opener, ",".join(shares)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    found: dict[str, Any] = json.loads(r.stdout.splitlines()[-1])
    return found


#: the tunnel budget of NARROW_OWNER's 3,000 descriptors: half of them, 6 per tunnel
NARROW_BUDGET = 3000 // 12


def test_the_tunnel_budget_never_exceeds_half_the_descriptor_limit() -> None:
    """A floor of 256 tunnels (~1,500 descriptors) let the budget pass the whole limit of an
    owner with fewer than ~3,000: at 600, one sandbox's held tunnels made every other socket()
    in the owner fail with EMFILE (a microVM's egress bridge died of it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        for limit in (12, 600, 1024, 3000, 3072, 20000):
            if hard != resource.RLIM_INFINITY and limit > hard:
                continue
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            budget = OWNER_TUNNELS.limit()
            assert budget >= 1 and budget * 6 <= limit // 2, (limit, budget)  # ~6 descriptors a tunnel
            assert budget == limit // 12  # and no less than that: the budget the tests below use
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_every_sandboxs_tunnels_together_leave_the_owner_half_its_descriptors(net: TargetNet, tmp_path: Path) -> None:
    found = _narrow_owner(net, tmp_path, ["", ""])
    # a budget of 3,000 // 12 = 250 tunnels; past half of it each of the two proxies holds at
    # most its share (125), so the first stops at 125 and the second gets the rest; before, the
    # owner aborted once the two held its 3,000 descriptors (and with a floor of 256 tunnels,
    # 128 each: 1,536 descriptors, more than half)
    assert found["tunnels"] == [NARROW_BUDGET // 2, NARROW_BUDGET // 2]
    assert found["refusals"] == ["host-connection-limit"]
    assert found["third"] == "made\n"


def test_a_tenants_sandboxes_share_one_part_of_the_tunnel_budget(net: TargetNet, tmp_path: Path) -> None:
    found = _narrow_owner(net, tmp_path, ["tenant:a"] * 3 + ["tenant:b"])
    # two shares of a 250-tunnel budget: tenant a's three sandboxes together hold its half, and
    # tenant b's one sandbox still gets the other half.  With a share per sandbox (before), a's
    # three took 128 + 64 + 64 (of 256) and b got none
    assert found["tunnels"] == [NARROW_BUDGET // 2, 0, 0, NARROW_BUDGET // 2]


def test_the_server_puts_each_tenants_sandboxes_in_one_tunnel_share(state_dir: Path) -> None:
    import asyncio

    from corral.egress.tunnel import OWNER_TUNNELS
    from corral.server.config import ServerConfig
    from corral.server.manager import SandboxManager
    from corral.server.metrics import Metrics
    from corral.spec import SandboxSpec

    async def lifecycle() -> None:
        manager = SandboxManager(ServerConfig(state_dir=str(state_dir)), Metrics())
        made = [await manager.create(tenant, SandboxSpec(network="allow", allow=["example.com"]))
                for tenant in ("alice", "alice", "bob")]
        try:
            assert [OWNER_TUNNELS.share_of(e.sandbox.id) for e in made] == ["tenant:alice"] * 2 + ["tenant:bob"]
        finally:
            for entry in made:
                await manager.destroy(entry.tenant, entry.sandbox.id)
        assert [OWNER_TUNNELS.share_of(e.sandbox.id) for e in made] == [e.sandbox.id for e in made]

    asyncio.run(lifecycle())


#: in the target's namespace: on port N, keeps every connection and neither reads, sends nor
#: closes; on port N + 1, reads a connection to its end, then answers "late" after half a second
SILENT_AND_LATE = r"""
import socket, sys, threading, time
held = []
def silent(srv):
    while True:
        held.append(srv.accept()[0])
def late(srv):
    while True:
        conn = srv.accept()[0]
        def answer(conn=conn):
            while conn.recv(65536):
                pass
            time.sleep(0.5)
            conn.sendall(b"late"); conn.close()
        threading.Thread(target=answer, daemon=True).start()
for port, serve in ((int(sys.argv[2]), silent), (int(sys.argv[2]) + 1, late)):
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], port)); srv.listen(256)
    threading.Thread(target=serve, args=(srv,), daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
"""

#: opens {n} tunnels to {target}:{port}, sends a byte and half-closes each, reads what comes
#: back within {wait} s (printing it), then exits: its sockets closed
HALF_CLOSE = """python3 -c '
import socket
got = []
for _ in range({n}):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(b"CONNECT {target}:{port} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    head = b""
    while not head.endswith(b"\\r\\n\\r\\n"): head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    s.sendall(b"e"); s.shutdown(socket.SHUT_WR)
    s.settimeout({wait})
    try:
        got.append(s.recv(64).decode())
    except socket.timeout:
        got.append("-")
print(" ".join(got))
'"""


def test_a_tunnel_whose_client_is_gone_does_not_wait_for_a_silent_far_end_for_ever(
        net: TargetNet, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that closed its socket (or died) looks, from the proxy, like one that only
    half-closed it; a far end that never answers nor closes kept the tunnel open for the
    sandbox's life, and a long session of such connections used up its 256 (then it reached
    nothing).  Now the far end has HALF_CLOSED_IDLE seconds between bytes after the half-close;
    one that answers in time still reaches its client."""
    import corral.egress.tunnel as tunnel

    monkeypatch.setattr(tunnel, "HALF_CLOSED_IDLE", 5.0)  # (20 tunnels take ~2.5 s to open here)
    silent = PORT + 10
    servers = subprocess.Popen(["ip", "netns", "exec", net.ns, sys.executable, "-c", SILENT_AND_LATE, net.target,
                                str(silent)], stdout=subprocess.PIPE, text=True)
    try:
        assert servers.stdout is not None and servers.stdout.readline().strip() == "ready"
        with Sandbox.create(allow=[f"{net.target}:{silent}", f"{net.target}:{silent + 1}"],
                            unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
            # the allowed thing: an answer that comes after the half-close, within the idle time
            answered = sb.commands.run(HALF_CLOSE.format(n=3, target=net.target, port=silent + 1, wait=5), timeout=60)
            assert answered.stdout == "late late late\n", answered.stderr
            gone = sb.commands.run(HALF_CLOSE.format(n=20, target=net.target, port=silent, wait=0.1), timeout=60)
            assert gone.stdout.split() == ["-"] * 20, gone.stderr
            held = _established_to(net, silent)
            assert held == 20  # the clients are gone, the tunnels (their upstream sockets) still there
            wait_until(lambda: _established_to(net, silent) == 0, 20, every=0.25)
            held = _established_to(net, silent)
            assert held == 0, f"{held} tunnels to a silent far end outlived their clients"
    finally:
        servers.kill()
        servers.wait()


def _established_to(net: TargetNet, port: int) -> int:
    """The host's sockets to ``port`` that a process holds (a tunnel's upstream sockets; once
    half-closed they are in FIN-WAIT-2; closed, the kernel keeps them a while with no owner)."""
    out = subprocess.run(["ss", "-tnpH", "dst", f"{net.target}:{port}"], capture_output=True,
                         text=True, check=True).stdout
    return sum(1 for line in out.splitlines() if "users:" in line)


#: opens {n} idle tunnels (nothing sent either way), says so, holds them until /tmp/go appears
IDLE_TUNNELS = """python3 -c '
import os, socket, time
tunnels = []
for _ in range({n}):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(b"CONNECT {target}:{port} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    assert s.recv(64).startswith(b"HTTP/1.1 200")
    tunnels.append(s)
open("/tmp/tunnels", "w").write(f"{{len(tunnels)}}\\n")
deadline = time.monotonic() + 60
while not os.path.exists("/tmp/go") and time.monotonic() < deadline:
    time.sleep(0.05)
' >/dev/null 2>&1 &"""


def _tunnel_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "corral-egress")


def test_the_threads_of_a_burst_of_tunnels_end_once_they_are_idle(
        net: TargetNet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads serve each open tunnel; they used to stay, idle, for the process's life once
    its tunnels closed (a long session's peak of ~270 tunnels left ~540 threads in the server)."""
    import corral.egress.tunnel as tunnel

    monkeypatch.setattr(tunnel.WORKERS, "idle", 1.0, raising=False)
    before = _tunnel_threads()
    with Sandbox.create(allow=[f"{net.target}:{PORT}"], unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        sb.commands.run(IDLE_TUNNELS.format(n=40, target=net.target, port=PORT))
        assert lines_written(sb, "/tmp/tunnels", 1, 60) == "40\n"
        assert _tunnel_threads() >= 40  # the burst's threads, serving it (idle ones of earlier tests reused)
        sb.commands.run("touch /tmp/go")
        wait_until(lambda: _tunnel_threads() <= before + 2, 20, every=0.25)
        assert _tunnel_threads() <= before + 2, f"{_tunnel_threads() - before} idle tunnel threads stayed"
        # the allowed thing, after the threads went: a new tunnel is served (a thread started anew)
        r = sb.commands.run(DOWNLOAD.format(target=net.target, port=PORT), timeout=60)
        assert r.stdout == f"{64 << 20}\n", r.stderr


def test_tunnel_workers_that_end_never_strand_a_job() -> None:
    """A worker ends only while no submitted job counts on it: jobs submitted from several
    threads while workers keep ending (an idle time of 1 ms) all run."""
    from corral.egress.tunnel import Workers

    workers = Workers(idle=0.001)
    done: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> None:
        with lock:
            done.append(i)

    def submitter(base: int) -> None:
        for i in range(300):
            workers.submit(job, base + i)
            if i % 7 == 0:
                time.sleep(0.002)  # (gaps in which idle workers end)

    submitters = [threading.Thread(target=submitter, args=(k * 1000,)) for k in range(4)]
    for t in submitters:
        t.start()
    for t in submitters:
        t.join(30)
    wait_until(lambda: len(done) == 1200, 10)
    assert sorted(done) == sorted(k * 1000 + i for k in range(4) for i in range(300))
    wait_until(lambda: workers.threads == 0, 5)
    assert workers.threads == 0


#: sends the bytes of hex {head} to the proxy in {pieces} pieces {every} s apart; prints how it ended and when:
#: "closed 2.1" (the proxy hung up) or the first answer's status line
DRIP = """python3 -c '
import select, socket, time
s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
start, head, pieces = time.monotonic(), bytes.fromhex("{head}"), {pieces}
size = -(-len(head) // pieces)
for at in range(0, len(head), size):
    try:
        s.sendall(head[at:at + size])
    except OSError:
        break
    if select.select([s], [], [], {every})[0]:
        break
select.select([s], [], [], 10)
try:
    answer = s.recv(64)
except OSError:
    answer = b""
if answer.startswith(b"\\x05"):
    answer = s.recv(64) if len(answer) == 2 and select.select([s], [], [], 10)[0] else answer[2:]
print(answer.split(b"\\r\\n")[0].decode(errors="replace") if answer else "closed", round(time.monotonic() - start, 1))
'"""


def test_a_request_head_dribbled_past_the_handshake_time_is_cut_and_audited(
        net: TargetNet, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handshake's timeout was per read: a head sent a byte every few seconds held a proxy
    thread (and descriptors) as long as the sandbox liked -- 256 of them held 256 of the owner's
    threads for 70 s, none refused or audited.  Now the whole head has HANDSHAKE_TIMEOUT."""
    import corral.egress.proxy as proxy

    monkeypatch.setattr(proxy, "HANDSHAKE_TIMEOUT", 2.0)
    head = f"CONNECT {net.target}:{PORT} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    socks = b"\x05\x01\x00" + b"\x05\x01\x00\x01" + bytes(map(int, net.target.split("."))) + PORT.to_bytes(2, "big")
    with Sandbox.create(allow=[f"{net.target}:{PORT}"], unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        # the allowed thing: a head that comes whole in time, even in pieces
        quick = sb.commands.run(DRIP.format(head=head.hex(), pieces=3, every=0.3), timeout=30)
        assert quick.stdout.split()[:2] == ["HTTP/1.1", "200"], quick
        # the denied one: the same head a piece every 0.4 s (6 s in all), and a SOCKS handshake
        for slow in (DRIP.format(head=head.hex(), pieces=15, every=0.4),
                     DRIP.format(head=socks.hex(), pieces=12, every=0.5)):
            r = sb.commands.run(slow, timeout=30)
            *what, seconds = r.stdout.split()
            assert what == ["closed"] and 1.5 <= float(seconds) < 4.5, r
        slow_ones = [e for e in sb.network.audit() if e.rule.startswith("handshake-too-slow")]
        assert sorted(e.protocol for e in slow_ones) == ["http", "socks5"], slow_ones


# -- the rate of new connections (``tunnel.ConnectionRate``) ----------------------------------
#: tunnel.CONNECTION_RATE and CONNECTION_BURST, as docs/egress.md states them (checked below)
RATE, BURST = 256.0, 512

#: one refused CONNECT after another, {n} of them; prints how many were answered 403
REFUSED_ONE_BY_ONE = r"""
import socket, sys
answered = 0
for _ in range(int(sys.argv[1])):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(b"CONNECT 169.254.169.254:80 HTTP/1.1\r\nHost: x\r\n\r\n")
    answered += s.recv(64).startswith(b"HTTP/1.1 403")
    s.close()
print(answered)
"""


def _owner_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


@pytest.fixture(scope="module")
def refusal_cpu(net: TargetNet) -> float:
    """What one refused CONNECT costs the owner's CPU on this host, now: the unit the CPU bounds
    below are stated in.  Seconds of CPU differ between hosts (0.07-0.2 ms a refusal on the hosts
    the bounds were first set on, 0.21 on a slower one, more beside a busy test worker), the
    ratio of a bounded cost to a refusal's much less; what the bugs cost was 12-25 times the
    bounds."""
    with Sandbox.create(allow=[f"{net.target}:8080"], unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        sb.files.write("/tmp/refused.py", REFUSED_ONE_BY_ONE)
        costs = []
        for _ in range(3):  # (the first round warms the proxy's threads: the median of three)
            before = _owner_cpu()
            r = sb.commands.run(["python3", "/tmp/refused.py", "100"], timeout=60)
            costs.append((_owner_cpu() - before) / 100)
            assert r.stdout.split() == ["100"], r
        return sorted(costs)[1]

#: one plain-HTTP request through the sandbox's relay (the scripts below run inside the sandbox)
GET = r"""
import socket
def get(target, timeout):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=timeout)
    s.sendall(f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    s.close()
    return answer
"""

#: {n} plain-HTTP GETs of http://{target}/ through the proxy, {workers} at a time, each on a
#: connection of its own (the proxy makes every request one), while a process of its own opens
#: {bare} connections one after another that send nothing; prints how many were answered 200,
#: the first failures, and the seconds it took
REQUESTS = GET + r"""
import json, os, socket, sys, threading, time
target, n, workers, bare = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
opener = os.fork() if bare else -1
if opener == 0:
    for _ in range(bare):
        socket.create_connection(("127.0.0.1", 3128), timeout=30).close()
    os._exit(0)
lock, left, ok, failed = threading.Lock(), [n], [0], []
def work():
    while True:
        with lock:
            if not left[0]:
                return
            left[0] -= 1
        try:
            answer = get(target, 30)
            good, why = b" 200 " in answer[:16], answer[:40]
        except OSError as exc:
            good, why = False, str(exc)
        with lock:
            ok[0] += good
            if not good:
                failed.append(repr(why))
start = time.monotonic()
threads = [threading.Thread(target=work) for _ in range(workers)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if opener > 0:
    os.waitpid(opener, 0)
print(json.dumps({"ok": ok[0], "failed": failed[:5], "seconds": time.monotonic() - start}))
"""


def _requests(sb: Sandbox, target: str, n: int, workers: int = 16, bare: int = 0) -> dict[str, Any]:
    r = sb.commands.run(["python3", "/tmp/requests.py", target, str(n), str(workers), str(bare)], timeout=120)
    assert r.exit_code == 0, r.stderr
    found: dict[str, Any] = json.loads(r.stdout)
    return found


def _rate_events(sb: Sandbox) -> list[Any]:
    return [e for e in sb.network.audit() if e.kind == "rate-limited"]


def test_a_burst_within_the_connection_budget_goes_at_once_and_past_it_waits_unrefused(net: TargetNet) -> None:
    """A package manager's burst (a few hundred connections in a second) is served at full speed
    and audits nothing; past the budget the sandbox's connections wait for the rate, none is
    refused, and the audit sums them up in one event.  Before, nothing bounded the rate at
    all (a flood of refusals cost the owner more than half a CPU: the test below)."""
    target = f"{net.target}:8080"
    with Sandbox.create(allow=[target], unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        sb.files.write("/tmp/requests.py", REQUESTS)
        burst = _requests(sb, target, 400)
        assert burst["ok"] == 400, burst
        assert _rate_events(sb) == []  # nothing waited
        # past the budget: whatever it had left (512 less the 400, plus what came back since)
        # goes at once, the rest at 256 a second.  Connections that send nothing, opened beside
        # the requests, spend the budget faster than the rate also where the host is too slow or
        # too busy for 256 requests a second (such a host's CI ran 1,000 of them in 3.7 s)
        past = _requests(sb, target, 1000, bare=1000)
        assert past["ok"] == 1000, past  # none refused
        assert past["seconds"] >= (1000 - BURST) / RATE * 0.9, past
        events = _rate_events(sb)
        assert [(e.rule, e.protocol) for e in events] == [("connection-rate", "proxy")], (events, past)
        # each past what was left waits (17 at a time: always one is queued); under load fewer do,
        # an accept thread that wakes late letting through unheld the tokens of the time it slept
        held = int(events[0].destination.split()[0])
        assert (1000 - BURST) * 0.25 <= held <= 2000, events
        assert not [e for e in sb.network.audit() if e.kind == "refused"]
    from corral.egress import tunnel

    assert (tunnel.CONNECTION_RATE, tunnel.CONNECTION_BURST) == (RATE, BURST)


#: {procs} processes, each sending refused CONNECTs (the metadata address) one after another for
#: {seconds} s; prints how many were answered (403)
FLOOD = r"""
import os, socket, sys, time
procs, seconds = int(sys.argv[1]), float(sys.argv[2])
end = time.monotonic() + seconds
r, w = os.pipe()
kids = []
for _ in range(procs):
    pid = os.fork()
    if pid == 0:
        n = 0
        while time.monotonic() < end:
            try:
                s = socket.create_connection(("127.0.0.1", 3128), timeout=1)
                s.sendall(b"CONNECT 169.254.169.254:80 HTTP/1.1\r\nHost: x\r\n\r\n")
                n += s.recv(64).startswith(b"HTTP/1.1 403")
                s.close()
            except OSError:
                pass
        os.write(w, b"%d\n" % n)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
os.close(w)
print(sum(int(x) for x in os.read(r, 65536).split()))
"""

#: a request to http://{target}/ every {every} s for {seconds} s; prints each one's milliseconds
#: (-1: it failed)
PACED = GET + r"""
import json, sys, time
target, every, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
times, end = [], time.monotonic() + seconds
while time.monotonic() < end:
    start = time.perf_counter()
    try:
        answer = get(target, 10)
        times.append((time.perf_counter() - start) * 1000 if b" 200 " in answer[:16] else -1)
    except OSError:
        times.append(-1)
    time.sleep(max(0.0, every - (time.perf_counter() - start)))
print(json.dumps(times))
"""

FLOOD_SECONDS = 5.0


@pytest.fixture(scope="module")
def flood(net: TargetNet) -> dict[str, Any]:
    """One sandbox floods its proxy with refused CONNECTs for FLOOD_SECONDS while another makes
    a request every 50 ms; what it cost the owner (this process), until its proxy is quiet again."""
    target = f"{net.target}:8080"
    spec: dict[str, Any] = {"allow": [target], "unsafe_allow_ranges": [f"{net.target}/32"]}
    with Sandbox.create(**spec) as flooder, Sandbox.create(**spec) as other:
        flooder.files.write("/tmp/flood.py", FLOOD)
        other.files.write("/tmp/paced.py", PACED)
        paced: dict[str, Any] = {}

        def pace() -> None:
            paced["r"] = other.commands.run(["python3", "/tmp/paced.py", target, "0.05", str(FLOOD_SECONDS)],
                                            timeout=60)

        def refusals() -> int:
            return sum(int(e.destination.split()[0]) if e.kind == "dropped" else 1
                       for e in flooder.network.audit() if e.rule == "link-local")

        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.monotonic()
        pacer = threading.Thread(target=pace)
        pacer.start()
        r = flooder.commands.run(["python3", "/tmp/flood.py", "8", str(FLOOD_SECONDS)], timeout=60)
        pacer.join(60)
        # what the sandbox left queued (its relay's and the proxy's) is served after it: count it
        seen, deadline = -1, time.monotonic() + 10
        while (now := refusals()) != seen and time.monotonic() < deadline:
            seen = now
            time.sleep(0.5)
        after = resource.getrusage(resource.RUSAGE_SELF)
        return {"answered": int(r.stdout), "seconds": time.monotonic() - start,
                "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
                "refusals": refusals(), "events": flooder.network.audit(),
                "other": json.loads(paced["r"].stdout)}


def test_a_flood_of_refused_requests_is_held_to_the_rate_and_costs_the_owner_a_bounded_cpu(
        flood: dict[str, Any], refusal_cpu: float) -> None:
    """8,000-11,000 refused CONNECTs a second from one sandbox cost the owner (its proxy, which no
    cgroup bounds) 2.9-3.5 s of CPU in 5 s, charged to no sandbox.  Now its proxy takes in its
    connections at the rate and leaves the rest queued in the kernel: a bounded number, at a
    bounded cost; another sandbox's requests meanwhile are all answered, promptly."""
    allowed = BURST + RATE * flood["seconds"]  # ~1,950 requests
    # what it may cost: that many refusals and the other sandbox's ~100 requests (a request through
    # to the target costs ~6 refusals), with room for a loaded host: 4 times (here 1.3-1.9 times)
    bound = (allowed + 100 * 6) * refusal_cpu * 4
    assert flood["cpu"] <= bound, (flood["cpu"], bound, refusal_cpu, flood["refusals"])
    assert flood["refusals"] <= allowed, flood["refusals"]
    assert flood["answered"] <= flood["refusals"]
    assert flood["answered"] >= RATE * FLOOD_SECONDS * 0.5  # (the flood did flood)
    other = flood["other"]
    assert len(other) >= FLOOD_SECONDS / 0.05 * 0.5 and -1 not in other, other
    assert sorted(other)[len(other) // 2] < 50 and max(other) < 2000, other


def test_a_flood_is_summed_up_in_the_audit_not_logged_per_request(flood: dict[str, Any]) -> None:
    """What the rate held back is in the flooding sandbox's audit as one ``rate-limited`` event
    (how many connections, how long), beside the refusals the proxy did serve: none is lost and
    none makes an event of its own."""
    held = [e for e in flood["events"] if e.kind == "rate-limited"]
    assert [(e.rule, e.protocol) for e in held] == [("connection-rate", "proxy")], held
    count, seconds = held[0].destination.split()[0], held[0].destination.split()[3]
    # (under load fewer wait: see the burst test above)
    assert (flood["refusals"] - BURST - RATE * 1.0) * 0.25 <= int(count) <= flood["refusals"], (held, flood["refusals"])
    assert float(seconds) >= FLOOD_SECONDS * 0.5, held
    assert len(flood["events"]) <= flood["refusals"] + 2


#: {n} connections each dribbling a request head that never ends, a byte at a time (one round of
#: bytes every millisecond) for {seconds} s; prints the bytes sent
DRIBBLE = r"""
import socket, sys, time
n, seconds = int(sys.argv[1]), float(sys.argv[2])
conns = [socket.create_connection(("127.0.0.1", 3128), timeout=10) for _ in range(n)]
for s in conns:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"GET http://example.invalid/ HTTP/1.1\r\nX-Pad: ")
sent, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    for s in conns:
        sent += s.send(b"a")
    time.sleep(0.001)
print(sent)
"""


def test_a_head_dribbled_a_byte_at_a_time_costs_the_owner_little_cpu(net: TargetNet, refusal_cpu: float) -> None:
    """Each piece of a request head cost the owner a read and a copy and a search of all it had
    read so far: a head dribbled a byte at a time, up to the 64 KiB a head may have, cost the
    owner CPU that grew with the square of its length (helper 68's probe: 200 connections
    dribbling for 10 s took 0.96 s of the owner's CPU).  Now only what is new is searched, and a
    head that comes in small pieces is read in fewer, bigger ones (here ~2,700 refusals' worth of
    CPU, against ~25 times that before)."""
    target = f"{net.target}:8080"
    with Sandbox.create(allow=[target], unsafe_allow_ranges=[f"{net.target}/32"]) as sb:
        sb.files.write("/tmp/dribble.py", DRIBBLE)
        before = _owner_cpu()
        r = sb.commands.run("python3 /tmp/dribble.py 64 4", timeout=60)
        cpu = _owner_cpu() - before
        assert r.exit_code == 0, r
        sent = int(r.stdout)
        assert sent > 64 * 1000, r.stdout  # (it did dribble: ~1,000 bytes a connection at least)
        assert cpu < 8000 * refusal_cpu, f"the owner spent {cpu:.2f} s of CPU on {sent} dribbled bytes " \
            f"({cpu / refusal_cpu:.0f} refusals' worth)"
        # the allowed direction: a whole head at once is answered at once
        ok = sb.commands.run(f"curl -s -o /dev/null -w '%{{http_code}}' -x http://127.0.0.1:3128 http://{target}/")
        assert ok.stdout == "200", ok
