"""A tenant's slow work runs within its share of the server's threads.

Creates and forks ran on asyncio's default threads (cpus + 4: six here), outside every tenant's
share (``max_threads_per_tenant`` of ``blocking_threads``): one tenant's slow creates and forks
made every other tenant's wait.  Now they go through the share
(``SandboxManager(run_for=ServerContext.run_for)``), as snapshots and pauses to disk do.
Real servers on loopback (tests/server_fixtures.py), real sandboxes of the process tier
(the test is the `tenants` helper's).
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from corral.host import cgroups

from .sandbox_wait import wait_until
from .server_fixtures import KEYS, ServerProcess

# a small thread share, so that what one tenant may hold is easy to fill (the defaults are 32 of 128)
SMALL_SHARES = {"max_threads_per_tenant": 2, "blocking_threads": 16}


def _create_and_exec(client: httpx.Client) -> float:
    """Seconds for a create, one command and a destroy."""
    t0 = time.monotonic()
    made = client.post("/v1/sandboxes", json={})
    assert made.status_code == 201, made.text
    sandbox_id = made.json()["id"]
    ran = client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "echo hi"})
    assert ran.status_code == 200 and ran.json()["stdout"] == "hi\n", ran.text
    took = time.monotonic() - t0
    assert client.delete(f"/v1/sandboxes/{sandbox_id}").status_code == 204
    return took


def test_one_tenants_creates_and_forks_do_not_hold_back_anothers(state_dir: Path) -> None:
    """Creates and forks run in their tenant's share of the server's threads: alice keeping many
    slow ones in flight makes bob's create and exec wait for his own work only."""
    config = {**SMALL_SHARES, "max_sandboxes_per_tenant": 64}
    with ServerProcess(state_dir / "srv-tenant-threads", keys=KEYS, config=config) as server, \
            server.client("alice") as alice, server.client("bob") as bob:
        baseline = min(_create_and_exec(bob) for _ in range(2))
        parent = alice.post("/v1/sandboxes", json={}).json()["id"]
        assert alice.post(f"/v1/sandboxes/{parent}/exec",
                          json={"cmd": "head -c 256M /dev/urandom > big; echo ok"}).json()["stdout"] == "ok\n"
        results: list[int] = []
        stop = time.monotonic() + 4  # bounded: alice's load ends by then (at most 50 rounds each); bob runs at 2 s

        def flood(kind: str) -> None:
            with server.client("alice") as own:
                for _ in range(50):
                    if time.monotonic() > stop:
                        return
                    if kind == "fork":
                        answer = own.post(f"/v1/sandboxes/{parent}/fork", json={"count": 1})
                        made = [s["id"] for s in answer.json().get("sandboxes", [])]
                    else:
                        answer = own.post("/v1/sandboxes", json={})
                        made = [answer.json()["id"]] if answer.status_code == 201 else []
                    results.append(answer.status_code)
                    for sandbox_id in made:
                        own.delete(f"/v1/sandboxes/{sandbox_id}")

        workers = [threading.Thread(target=flood, args=("fork" if i % 3 else "create",)) for i in range(24)]
        for worker in workers:
            worker.start()
        time.sleep(2.0)  # alice's work fills her share (and, before the fix, the shared default threads)
        under_load = _create_and_exec(bob)
        for worker in workers:
            worker.join(timeout=120)
        print(f"{len(results)} of alice's calls; bob alone {baseline:.2f} s, with alice's load {under_load:.2f} s")
        # generous (0.08 s measured; 3.5 s when creates queued on asyncio's shared default threads):
        # bob shares the 2 cores with alice's two threads, not a queue behind her 24 callers
        assert under_load < max(1.5, 10 * baseline), (baseline, under_load)
        # alice's own calls still complete
        assert results and all(code == 201 for code in results), results


def test_idle_kept_alive_connections_give_way_to_new_ones(state_dir: Path) -> None:
    """Kept-alive connections waiting for a next request were held 65 s: one client's 80 of them
    filled a server's 64 and another tenant got 503 for a minute (the tenants helper measured
    it).  Past half of max_connections a new connection closes idle ones first."""
    import socket

    config = {"max_connections": 64}
    with ServerProcess(state_dir / "srv-idle-conns", keys=KEYS, config=config) as server, \
            server.client("bob") as bob:
        host, port = server.url.split("//")[1].split(":")
        held = []
        for _ in range(80):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            sock.recv(4096)  # answered; the connection now waits, kept alive
            held.append(sock)
        try:
            answer = bob.get("/v1/sandboxes")
            assert answer.status_code == 200, answer.text
            # the allowed direction: a client still using its connection keeps it
            with server.client("alice") as alice:
                assert all(alice.get("/v1/sandboxes").status_code == 200 for _ in range(5))
        finally:
            for sock in held:
                sock.close()


def test_silent_connections_without_a_key_give_way_to_new_ones(state_dir: Path) -> None:
    """Connections that send nothing, reopened as fast as the server closes them, kept a keyed
    server's 64 connections full: a tenant got 503 on 29 of 44 requests over 45 s, and no key
    was ever shown. Past half of max_connections a new connection closes the oldest of those
    that have sent no whole head; a tenant's requests are all served meanwhile."""
    import socket

    config = {"max_connections": 64}
    with ServerProcess(state_dir / "srv-silent-conns", keys=KEYS, config=config) as server, \
            server.client("bob") as bob:
        silent: list[socket.socket] = []

        def top_up() -> None:
            for sock in list(silent):  # reopen what the server closed
                sock.setblocking(False)
                try:
                    if sock.recv(1) == b"":
                        silent.remove(sock)
                        sock.close()
                except BlockingIOError:
                    pass
            while len(silent) < 80:
                silent.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))

        try:
            answers = []
            for _ in range(10):
                top_up()
                answers.append(bob.get("/v1/sandboxes").status_code)
            assert answers == [200] * 10, answers
        finally:
            for sock in silent:
                sock.close()


class Dribblers:
    """Connections to a server that each send one byte of a never-ending request head every
    ``every`` seconds (slowloris), from ``sources`` (loopback addresses: 127.0.0.0/8 is all this
    host's, one peer each), ``per_source`` from each; one the server closed is made again (for
    ``reopen_for`` seconds, or always), and sends its first byte as it connects.  In a thread, as
    a context manager."""

    HEAD = b"GET /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 4096

    def __init__(self, port: int, sources: list[str], per_source: int, every: float = 1.0,
                 reopen_for: float | None = None) -> None:
        self.port, self.sources, self.per_source, self.every = port, sources, per_source, every
        self.reopen_for = reopen_for
        self.open: list[tuple[str, socket.socket, int]] = []
        #: connections made, and those the server closed
        self.made = self.closed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _connect(self, source: str) -> None:
        sock = socket.socket()
        sock.settimeout(10)
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", self.port))
        sock.setblocking(False)
        sock.send(self.HEAD[:1])
        self.made += 1
        self.open.append((source, sock, 1))

    def _run(self) -> None:
        reopen_until = None if self.reopen_for is None else time.monotonic() + self.reopen_for
        while not self._stop.is_set():
            still = []
            for source, sock, sent in self.open:
                try:
                    sock.recv(4096)  # an answer (408, 429) or the close: the server is done with it
                    gone = True
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if not gone:
                    try:
                        sock.send(self.HEAD[sent:sent + 1])
                        still.append((source, sock, sent + 1))
                        continue
                    except OSError:
                        pass
                self.closed += 1
                sock.close()
            self.open = still
            if reopen_until is not None and time.monotonic() > reopen_until:
                self._stop.wait(self.every)
                continue
            for source in self.sources:
                for _ in range(self.per_source - sum(1 for s, _, _ in self.open if s == source)):
                    self._connect(source)
            self._stop.wait(self.every)

    def __enter__(self) -> Dribblers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        for _, sock, _ in self.open:
            sock.close()


def _answers_while(client: httpx.Client, count: int, every: float) -> list[int]:
    answers = []
    for _ in range(count):
        answers.append(client.get("/v1/sandboxes").status_code)
        time.sleep(every)
    return answers


def test_connections_dribbling_a_head_from_one_address_do_not_fill_the_server(state_dir: Path) -> None:
    """80 connections from one address, each sending one byte of a head every second (no key, no
    whole request ever): each held its place until the 30 s head timeout, so they filled a keyed
    server's 64 connections and a tenant got 503 on every request.  Past max_partial_heads_per_peer
    (8, its default) such connections from one address are answered 429 and closed at once; the
    tenant's requests are all served meanwhile."""
    config = {"max_connections": 64}
    with ServerProcess(state_dir / "srv-dribbled-heads", keys=KEYS, config=config) as server, \
            server.client("bob") as bob, Dribblers(server.port, ["127.0.0.1"], 80) as dribblers:
        time.sleep(2.5)  # each has sent a byte or three
        answers = _answers_while(bob, 10, 0.5)
        print(f"bob's answers {answers}; dribbling connections made {dribblers.made}, "
              f"closed by the server {dribblers.closed}")
        assert answers == [200] * 10, answers


def test_slow_heads_from_many_addresses_give_way_but_running_requests_do_not(state_dir: Path) -> None:
    """60 connections from 12 addresses, 5 each (under each address's bound), dribbling heads, and a
    tenant's 8 commands running: together past a keyed server's 64 connections, and a new tenant's
    requests got 503 on 5 of 5 (nothing there could give way).  Past half of max_connections a head
    2 s in the making gives way to a new connection, oldest first; a running request never does: the
    commands all finish, and the new tenant's requests are served (its first one, on the very
    connection that made room, was 503 while those closed still counted as open until uvloop
    reported them lost: they count as closed at once)."""
    from corral import Sandbox

    config = {"max_connections": 64}
    with ServerProcess(state_dir / "srv-slow-heads", keys=KEYS, config=config) as server, \
            Sandbox.create(url=server.url, api_key=KEYS["alice"]) as sb, server.client("bob") as bob:
        results: list[str] = []

        def run() -> None:
            with server.client("alice") as alice:
                answer = alice.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": "sleep 8; echo done"})
                results.append(answer.json()["stdout"] if answer.status_code == 200 else answer.text)

        runners = [threading.Thread(target=run) for _ in range(8)]
        for runner in runners:
            runner.start()
        wait_until(lambda: len(sb.commands.list()) == 8, 10, every=0.05)
        sources = [f"127.0.0.{i}" for i in range(2, 14)]
        with Dribblers(server.port, sources, 5, reopen_for=1.0) as dribblers:
            time.sleep(3.5)  # every head began over 2 s ago
            held = len(dribblers.open)
            answers = _answers_while(bob, 5, 0.3)
            print(f"bob's answers {answers}; dribbling connections held {held} when bob came, "
                  f"{len(dribblers.open)} after")
        for runner in runners:
            runner.join(30)
        assert results == ["done\n"] * 8, results
        assert answers == [200] * 5, answers


def test_many_parallel_keep_alive_clients_of_one_address_are_all_served(state_dir: Path) -> None:
    """The legitimate side of max_partial_heads_per_peer (its default): 100 clients of one address,
    each with one kept-alive connection for 10 requests, all at once, are all answered 200 (a
    client writes each head whole: none is ever partial long enough to count)."""
    with ServerProcess(state_dir / "srv-keep-alive-clients", keys=KEYS) as server:
        answers: list[int] = []
        start = threading.Barrier(100)

        def client() -> None:
            with httpx.Client(base_url=server.url, headers=server.headers("alice"), timeout=60,
                              limits=httpx.Limits(max_connections=1)) as alice:
                start.wait(30)
                mine = [alice.get("/v1/sandboxes").status_code for _ in range(10)]
            answers.extend(mine)

        clients = [threading.Thread(target=client) for _ in range(100)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(30)
        assert answers == [200] * 1000, {code: answers.count(code) for code in set(answers)}


@pytest.mark.parametrize("fast_routes", [True, False])
def test_a_command_whose_client_left_is_killed_and_frees_its_slot(state_dir: Path, fast_routes: bool) -> None:
    """``POST /exec`` of ``sleep 1000``, then the client goes: the command is killed (before, it ran
    to its timeout, days at most, holding one of the sandbox's exec slots and a thread of the
    tenant's share: 8 such clients left the sandbox unable to run anything)."""
    import json
    import socket

    from corral import Sandbox

    slots = 3
    config = {"max_concurrent_execs": slots, "fast_routes": fast_routes}  # (False: through FastAPI's routing)
    with ServerProcess(state_dir / f"srv-left-clients-{fast_routes}", config=config) as server, \
            Sandbox.create(url=server.url) as sb:
        body = json.dumps({"cmd": ["sleep", "1000"], "timeout": 600}).encode()
        for _ in range(slots + 1):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
                client.sendall(f"POST /v1/sandboxes/{sb.id}/exec HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
                wait_until(sb.commands.list, 10, every=0.02)
                assert [c.argv for c in sb.commands.list()] == [["sleep", "1000"]]
            # the client is gone (its socket closed, as a killed process's is)
            wait_until(lambda: not sb.commands.list(), 10)
            assert sb.commands.list() == []
        assert sb.commands.run("pgrep -c -x sleep || true").stdout == "0\n"
        # every slot is free: as many commands as the sandbox may run at once all run
        results: list[str] = []
        runners = [threading.Thread(target=lambda: results.append(sb.commands.run("sleep 0.5; echo ok").stdout))
                   for _ in range(slots)]
        for runner in runners:
            runner.start()
        for runner in runners:
            runner.join(30)
        assert results == ["ok\n"] * slots


def test_a_code_cell_whose_client_left_is_interrupted_and_frees_the_interpreter(state_dir: Path) -> None:
    """``POST /code`` of a cell that sleeps, then the client goes: the cell is interrupted as its
    timeout would (before, it held the interpreter, so the next cell waited for it, up to its
    timeout), and the interpreter's variables survive (an interrupted cell keeps them)."""
    import json
    import socket

    with ServerProcess(state_dir / "srv-left-cells") as server, server.client() as http:
        sid = http.post("/v1/sandboxes", json={"limits": {"memory": "256M"}}).json()["id"]
        try:
            assert http.post(f"/v1/sandboxes/{sid}/code", json={"code": "kept = 41"}).status_code == 200
            body = json.dumps({"code": "import time\ntime.sleep(1000)", "timeout": 600}).encode()
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
                client.sendall(f"POST /v1/sandboxes/{sid}/code HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
                time.sleep(1.0)  # the cell is running
            started = time.monotonic()
            after = http.post(f"/v1/sandboxes/{sid}/code", json={"code": "kept + 1"}, timeout=60)
            assert after.status_code == 200 and after.json()["results"][0]["text"] == "42", after.text
            assert time.monotonic() - started < 10
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


def test_a_destroy_that_fails_does_not_stop_the_reaper(state_dir: Path) -> None:
    """The reaper was one task: a destroy that raised ended its gather, and the task with it, so no
    sandbox was reaped for the rest of the server's life.  Here the first idle sandbox's destroy
    fails (after it is done: the fault is injected into the host's kill, as a clean-up error);
    the second one, idle later, is still reaped."""
    import asyncio

    from corral.server.config import ServerConfig
    from corral.server.manager import SandboxManager
    from corral.server.metrics import Metrics
    from corral.spec import SandboxSpec

    async def reaped() -> list[bool]:
        manager = SandboxManager(ServerConfig(state_dir=str(state_dir)), Metrics())
        manager.start()
        try:
            first = await manager.create("alice", SandboxSpec(), idle_timeout=0.5)
            second = await manager.create("alice", SandboxSpec(), idle_timeout=2.5)
            real_kill = first.sandbox.kill

            def failing_kill() -> None:
                real_kill()
                raise RuntimeError("a clean-up error")

            first.sandbox.kill = failing_kill  # type: ignore[method-assign]
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and (first.sandbox.is_running() or second.sandbox.is_running()):
                await asyncio.sleep(0.1)
            return [first.sandbox.is_running(), second.sandbox.is_running()]
        finally:
            await manager.shutdown()

    assert asyncio.run(reaped()) == [False, False]


def test_one_tenants_calls_on_its_paused_sandbox_hold_no_other_tenants_work(state_dir: Path) -> None:
    """Kills, signals, pause, resume, audit and a stream's controls took the server's shared
    threads without a bound (they must not wait behind the tenant's own commands): alice paused
    her sandbox in the middle of an upload, whose write then held her agent's channel, and sent
    signals to it; each waited for the agent on a shared thread until none was left, and bob's
    exec, listing and create waited with them.  A signal to a paused sandbox is now refused
    (409, as stdin is), and such calls hold at most 8 shared threads a tenant."""
    from concurrent.futures import ThreadPoolExecutor

    with ServerProcess(state_dir / "srv-control-threads", keys=KEYS, config=SMALL_SHARES) as server, \
            server.client("alice") as alice, server.client("bob") as bob:
        bobs = bob.post("/v1/sandboxes", json={}).json()["id"]
        sid = alice.post("/v1/sandboxes", json={"limits": {"cpus": 0.05}}).json()["id"]
        started = alice.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "sleep 300"})
        assert started.status_code == 201, started.text
        pid = started.json()["pid"]
        for _ in range(3):  # the agent, in the sandbox's cgroup, gets almost none of its 5 % of a CPU
            alice.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "while :; do :; done"})
        upload = threading.Thread(target=lambda: server.client("alice").put(
            f"/v1/sandboxes/{sid}/files/content", params={"path": "big"}, content=b"u" * (24 << 20),
            headers={"content-type": "application/octet-stream"}, timeout=120), daemon=True)
        upload.start()
        time.sleep(0.3)
        assert alice.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
        try:
            def signal_it(_: int) -> int:
                with server.client("alice") as own:
                    try:
                        return own.post(f"/v1/sandboxes/{sid}/commands/{pid}/signal", json={"signal": 15},
                                        timeout=20).status_code
                    except httpx.TimeoutException:
                        return 0
            with ThreadPoolExecutor(24) as pool:
                signals = pool.map(signal_it, range(24))
                time.sleep(1)
                t0 = time.monotonic()
                try:
                    ran = bob.post(f"/v1/sandboxes/{bobs}/exec", json={"cmd": "echo hi"}, timeout=30)
                except httpx.TimeoutException:
                    pytest.fail("bob's exec had no answer in 30 s: alice's signals held every thread")
                took = time.monotonic() - t0
                answered = list(signals)
            assert ran.status_code == 200 and ran.json()["stdout"] == "hi\n", ran.text
            assert took < 10, f"bob's exec waited {took:.1f} s behind alice's signals"
            assert answered == [409] * 24, answered
        finally:
            alice.post(f"/v1/sandboxes/{sid}/resume")
            alice.delete(f"/v1/sandboxes/{sid}")  # (the upload ends with it)
            bob.delete(f"/v1/sandboxes/{bobs}")
            upload.join(60)


def _weight(sandbox_id: str) -> float:
    """A sandbox's CPU weight on ``cpu.weight``'s scale (v1: ``cpu.shares``, 1,024 for 100)."""
    layout = cgroups.detect()
    group = layout.controllers["cpu"] / cgroups.PARENT / sandbox_id
    if layout.version == 2:
        return int((group / "cpu.weight").read_text())
    return int((group / "cpu.shares").read_text()) * 100 / 1024


SPIN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\nprint(time.process_time())"


def _busy(server: ServerProcess, load: dict[str, list[str]], seconds: int) -> dict[str, float]:
    """Two busy loops in each sandbox (tenant -> sandbox ids) for ``seconds`` of wall, at once:
    the CPU seconds each tenant's loops got, as the loops themselves counted them."""
    spin = SPIN.format(seconds=seconds)
    cmd = f"python3 -c '{spin}' & python3 -c '{spin}'; wait"
    got: dict[str, list[float]] = {tenant: [] for tenant in load}

    def run(tenant: str, sandbox_id: str) -> None:
        with server.client(tenant) as client:
            out = client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": cmd, "timeout": seconds + 30}).json()
        got[tenant].extend(float(line) for line in out["stdout"].split())

    threads = [threading.Thread(target=run, args=(tenant, sid)) for tenant, ids in load.items() for sid in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 60)
    return {tenant: sum(times) for tenant, times in got.items()}


def test_a_tenants_sandboxes_together_weigh_as_much_cpu_as_anothers_one(state_dir: Path) -> None:
    """Under contention each tenant gets one share of the CPU, however many sandboxes it runs:
    weights were per sandbox, and alice's 8 busy sandboxes made bob's command 5.4x slower. Both
    ways: bob's one busy sandbox gets about what alice's four get together, and alice alone may use
    every core (a weight is no cap)."""
    with ServerProcess(state_dir / "srv-tenant-cpu", keys=KEYS) as server, \
            server.client("alice") as alice, server.client("bob") as bob:
        mine = [alice.post("/v1/sandboxes", json={"limits": {"cpus": 2}}).json()["id"] for _ in range(4)]
        his = bob.post("/v1/sandboxes", json={"limits": {"cpus": 2}}).json()["id"]
        assert [_weight(sid) for sid in mine] == [25] * 4 and _weight(his) == 100  # one default group's
        assert alice.delete(f"/v1/sandboxes/{mine.pop()}").status_code == 204
        assert [_weight(sid) for sid in mine] == [25] * 3 and _weight(his) == 100  # parts change at 1 or 5
        mine.append(alice.post("/v1/sandboxes", json={"limits": {"cpus": 2}}).json()["id"])
        # bob's one sandbox against alice's four: about even (before: a fifth of the five)
        both = _busy(server, {"alice": mine, "bob": [his]}, 3)
        assert both["bob"] > 0.6 * both["alice"], both
        # alice alone: her sandboxes take what bob left too (about twice her part above; under
        # others' load on the host, less: 1.34x was seen beside three other test runs)
        alone = _busy(server, {"alice": mine}, 3)["alice"]
        assert alone > 1.15 * both["alice"], (alone, both)


def _send_body(port: int, head: str, pieces: list[bytes], gap: float, give_up_after: float) -> tuple[int | None, float]:
    """Send ``head`` then each piece ``gap`` s apart (stopping at an answer or at ``give_up_after``
    s), then wait for the answer; its status (None: none came) and the seconds until then."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=give_up_after) as conn:
        conn.sendall(head.encode())
        answer = b""
        for piece in pieces:
            if time.monotonic() - started > give_up_after:
                break
            try:
                conn.sendall(piece)
            except OSError:  # the server answered and closed
                break
            conn.settimeout(gap)
            try:
                answer = conn.recv(4096)
            except TimeoutError:
                continue
            break
        if not answer:
            conn.settimeout(max(0.1, give_up_after - (time.monotonic() - started)))
            try:
                answer = conn.recv(4096)
            except (TimeoutError, OSError):
                return None, time.monotonic() - started
        return (int(answer.split()[1]) if answer else None), time.monotonic() - started


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_a_request_body_that_trickles_is_cut_off_and_one_at_the_least_rate_is_taken(state_dir: Path) -> None:
    """A body must arrive at 64 KiB (SMALL_BODY) per request_head_timeout at least, chunked or of
    any declared length: only a small declared one was timed, and a chunked body (or a declared
    100,000 bytes) sent a byte a second to the upload route or the port proxy stayed open past
    12 s with request_head_timeout 3 s, holding its request, connection and tenant bytes."""
    with ServerProcess(state_dir / "srv-slow-bodies", keys=KEYS, config={"request_head_timeout": 2}) as server, \
            server.client("alice") as alice:
        sandbox_id = alice.post("/v1/sandboxes", json={"limits": {"memory": "64M"}}).json()["id"]
        key = f"Authorization: Bearer {KEYS['alice']}\r\nHost: x\r\n"
        upload = f"PUT /v1/sandboxes/{sandbox_id}/files/content?path=/tmp/body HTTP/1.1\r\n{key}"
        proxy = f"POST /v1/sandboxes/{sandbox_id}/ports/8000/ HTTP/1.1\r\n{key}"
        for head, pieces in ((upload + "Transfer-Encoding: chunked\r\n\r\n", [_chunk(b"x")] * 40),
                             (proxy + "Transfer-Encoding: chunked\r\n\r\n", [_chunk(b"x")] * 40),
                             (upload + "Content-Length: 100000\r\n\r\n", [b"x"] * 40)):
            status, took = _send_body(server.port, head, pieces, 0.5, 10)
            assert (status, took < 6) == (408, True), (head.split("\r\n")[0], head.split("\r\n")[-3], status, took)
        # the allowed thing: 256 KiB at 64 KiB a second, in all longer than request_head_timeout
        body = bytes(range(256)) * 1024
        pieces = [_chunk(body[i:i + (16 << 10)]) for i in range(0, len(body), 16 << 10)] + [b"0\r\n\r\n"]
        status, took = _send_body(server.port, upload + "Transfer-Encoding: chunked\r\n\r\n", pieces, 0.25, 20)
        assert status == 204 and took > 2, (status, took)
        assert alice.get(f"/v1/sandboxes/{sandbox_id}/files/content", params={"path": "/tmp/body"}).content == body
        alice.delete(f"/v1/sandboxes/{sandbox_id}")


def test_listing_a_forks_carried_commands_with_its_agent_frozen_holds_back_no_other_tenant(state_dir: Path) -> None:
    """A microVM fork's carried commands are listed one guest-agent round trip each (up to 60 s), and
    GET /commands made them on the event loop: alice froze her fork's agent (guest root, its
    cgroup.freeze) and listed its commands, and for 59 s no tenant's request was answered, /healthz
    included.  Now the listing waits on a thread of alice's: bob is answered at once meanwhile."""
    from .tier_probe import skip_unless_tier

    skip_unless_tier("microvm", state_dir)
    with ServerProcess(state_dir / "srv-carried-listing", keys=KEYS) as server, \
            server.client("alice") as alice, server.client("bob") as bob:
        sid = alice.post("/v1/sandboxes", json={"tier": "microvm", "limits": {"memory": "256M"}}).json()["id"]
        kid = ""
        try:
            assert alice.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "sleep 1000", "cwd": "/tmp"}).status_code == 201
            forked = alice.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1}, timeout=120)
            assert forked.status_code == 201, forked.text
            kid = forked.json()["sandboxes"][0]["id"]
            assert len(alice.get(f"/v1/sandboxes/{kid}/commands").json()["commands"]) == 1  # carried
            frozen = alice.post(f"/v1/sandboxes/{kid}/commands", json={
                "cmd": "sleep 1; echo 1 > /sys/fs/cgroup/agent/cgroup.freeze", "user": "root", "cwd": "/tmp"})
            assert frozen.status_code == 201, frozen.text
            time.sleep(3)
            listing = threading.Thread(target=lambda: server.client("alice").get(
                f"/v1/sandboxes/{kid}/commands", timeout=120), daemon=True)
            listing.start()
            time.sleep(1)
            slowest = 0.0
            for _ in range(20):
                t0 = time.monotonic()
                try:
                    assert bob.get("/healthz", timeout=10).status_code == 200
                except httpx.TimeoutException:
                    pytest.fail("bob's /healthz had no answer in 10 s while alice listed her frozen fork's commands")
                slowest = max(slowest, time.monotonic() - t0)
                time.sleep(0.1)
            assert listing.is_alive(), "the listing did not wait for the frozen agent (nothing was tested)"
            assert slowest < 1, f"bob's /healthz took {slowest:.1f} s while alice's listing waited"
        finally:
            for made in (kid, sid):
                if made:
                    alice.delete(f"/v1/sandboxes/{made}", timeout=120)
