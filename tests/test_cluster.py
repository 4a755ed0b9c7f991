"""Sandboxes across a Ray cluster: a head and three worker nodes of 8 ``corral_slots`` each,
all on this host (``ray.cluster_utils.Cluster``), one host actor per worker node.

One cluster for the module (starting it is most of the module's time); the node-loss test
runs last but one and takes a node away, the driver-kill test uses the two that are left.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from corral import Sandbox
from corral.cluster.transport import ClusterTransport
from corral.errors import (
    ClusterFull,
    ClusterUnauthenticated,
    FileNotFoundInSandbox,
    HostNotSupported,
    InvalidSpec,
    SandboxLost,
)

from .leaks import assert_gone_soon, sandbox_leftovers
from .sandbox_wait import wait_until

# Ray rewrites a loopback address it is given to this machine's own (for other machines to reach
# it) and binds its servers to every interface then; in its one-machine mode, chosen before Ray is
# imported, the test's cluster stays on the loopback (`LocalCluster` checks that it does)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray's token authentication, as docs/cluster.md sets a cluster up (Corral refuses to use a cluster
# without it): every node and driver of the test's cluster, its subprocesses too, have the token.
# Chosen before Ray is imported: a process reads its mode once
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
ray = pytest.importorskip("ray", reason="the cluster extra is not installed: pip install 'corral[cluster]'")

SLOTS = 8
WORKERS = 3
#: a node that dies is marked dead by the GCS after 3 missed health checks a second apart
HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 1000}


#: every node and driver of the test's cluster: Ray binds its servers to the loopback only then
LOOPBACK = "127.0.0.1"


def non_loopback_listeners() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening on this host other than on the loopback."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(":")
            # the kernel's hex, a 32-bit word at a time in host order: 127.x.y.z ends in 7F,
            # also mapped into IPv6 (::ffff:127.x.y.z); ::1 is its own
            v4 = address[-8:] if len(address) == 8 or address.startswith("0000000000000000FFFF0000") else ""
            loopback = v4.endswith("7F") or address == "00000000000000000000000001000000"
            if fields[3] == "0A" and not loopback:
                found.add((address, int(port, 16)))
    return found


class LocalCluster:
    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.temp = Path(tempfile.mkdtemp(prefix="c17-ray-"))
        # Ray's test cluster writes the head's address to ``RAY_TMPDIR/ray`` whatever ``temp_dir``
        # says, and fails where that directory does not exist (a fresh machine has no /tmp/ray)
        (self.temp / "ray").mkdir()
        self._tmpdir_before = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = str(self.temp)
        small = {"num_cpus": 0, "object_store_memory": 80 << 20, "node_ip_address": LOOPBACK}
        self.cluster = Cluster(initialize_head=False)
        listening_before = non_loopback_listeners()
        try:
            self.cluster.add_node(**small, include_dashboard=False, temp_dir=str(self.temp), _system_config=HEALTH)
            self.workers = [self.cluster.add_node(**small, resources={"corral_slots": SLOTS}) for _ in range(WORKERS)]
            ray.init(address=self.cluster.address, namespace="corral", include_dashboard=False, log_to_driver=False,
                     logging_level="WARNING")
            from corral.cluster.node.actor import start_hosts

            self.hosts = start_hosts(ray, janitor_interval=1.0)
            assert len(self.hosts) == WORKERS
            # Ray runs whatever code reaches its ports, as root here: the test's cluster must not
            # be reachable from the network this machine is on (a node IP of 127.0.0.1 makes Ray
            # bind its GCS, raylets and agents there; any other address binds them everywhere)
            assert non_loopback_listeners() <= listening_before
        except BaseException:
            self._stop()
            raise

    def node(self, node_id: str) -> Any:
        return next(n for n in self.workers if n.node_id == node_id)

    def close(self) -> None:
        from corral.cluster.node.actor import down

        try:
            down(True)
        finally:
            self._stop()

    def _stop(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(self.temp, ignore_errors=True)
        if self._tmpdir_before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self._tmpdir_before


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    local = LocalCluster()
    try:
        yield local
    finally:
        local.close()


def test_24_sandboxes_8_per_node_and_the_25th_waits_then_is_refused(cluster: LocalCluster, state_dir: Path) -> None:
    with ThreadPoolExecutor(24) as pool:
        sandboxes = list(pool.map(lambda _: Sandbox.create(cluster=True, slot_timeout=30), range(24)))
    try:
        assert Counter(sb.node_id for sb in sandboxes) == {node_id: SLOTS for node_id in cluster.hosts}
        results = [sb.commands.run(f"echo {sb.id}") for sb in sandboxes]
        assert [(r.exit_code, r.stdout, r.stderr) for r in results] == [(0, f"{sb.id}\n", "") for sb in sandboxes]
        loads = ray.get([actor.load.remote() for actor in cluster.hosts.values()])
        assert all(load["used"] == SLOTS and load["free"] == 0 for load in loads)

        started = time.monotonic()
        with pytest.raises(ClusterFull):
            Sandbox.create(cluster=True, slot_timeout=1.5)
        assert 1.5 <= time.monotonic() - started < 10

        # a create that waits gets the first slot freed, on the node that freed it
        got: list[Sandbox] = []
        waiter = threading.Thread(target=lambda: got.append(Sandbox.create(cluster=True, slot_timeout=30)))
        waiter.start()
        assert wait_until(lambda: any(load["waiting"] for load in
                                      ray.get([a.load.remote() for a in cluster.hosts.values()])), 10, every=0.2)
        freed = sandboxes.pop()
        freed.kill()
        waiter.join(30)
        assert got and got[0].node_id == freed.node_id
        sandboxes.append(got[0])
        loads = ray.get([actor.load.remote() for actor in cluster.hosts.values()])
        assert all(load["used"] <= SLOTS for load in loads)
    finally:
        for sb in sandboxes:
            sb.kill()
    for sb in sandboxes:
        assert sandbox_leftovers(sb.id, state_dir) == []


def test_the_same_sandbox_streams_files_and_names_its_node(cluster: LocalCluster) -> None:
    with pytest.raises(InvalidSpec, match="slot_timeout"):
        Sandbox.create(slot_timeout=1)
    with pytest.raises(InvalidSpec, match="the node's environment"):
        Sandbox.create(cluster=True, network="allow", allow=["example.com"], secrets=["TOKEN@example.com"],
                       secret_values={"TOKEN": "x"})
    with Sandbox.create(cluster=True, metadata={"run": "c17"}) as sb:
        assert sb.node_id in cluster.hosts and sb.remote
        seen: list[tuple[float, str]] = []
        result = sb.commands.run("echo one; sleep 0.6; echo two", on_stdout=lambda s: seen.append((time.monotonic(), s)))
        assert result.exit_code == 0 and result.stdout == "one\ntwo\n"
        assert "".join(s for _, s in seen) == "one\ntwo\n"
        assert seen[-1][0] - seen[0][0] > 0.4  # the first line came before the command ended

        handle = sb.commands.run("read x; echo got $x", background=True)
        assert handle.pid is not None
        sb.commands.send_stdin(handle.pid, "ping\n")
        assert sb.commands.connect(handle.pid).wait().stdout == "got ping\n"

        sb.files.write("notes.txt", "hello")
        assert sb.files.read("notes.txt") == "hello"
        assert "notes.txt" in [e.name for e in sb.files.list(".")]
        with pytest.raises(FileNotFoundInSandbox):
            sb.files.read("missing.txt")

        assert sb.commands.run("id -u").stdout == "1000\n"  # the node's tier, as unprivileged as ever
        again = Sandbox.connect(sb.id, transport=ClusterTransport(True))  # a registry that never saw it asks the hosts
        assert again.node_id == sb.node_id and again.files.read("notes.txt") == "hello"
        assert [i.sandbox_id for i in Sandbox.list({"run": "c17"}, cluster=True)] == [sb.id]
    assert not sb.is_running()
    assert Sandbox.list({"run": "c17"}, cluster=True) == []

    async def from_asyncio() -> tuple[str | None, str]:
        from corral import AsyncSandbox

        asb = await AsyncSandbox.create(cluster=True)
        try:
            chunks: list[str] = []
            result = await asb.commands.run("echo async", on_stdout=chunks.append)
            return asb._backend.sync.node_id, result.stdout + "".join(chunks)
        finally:
            await asb.kill()

    node_id, out = asyncio.run(from_asyncio())
    assert node_id in cluster.hosts and out == "async\nasync\n"


def test_corral_serve_cluster_fronts_the_cluster_with_the_rest_api(cluster: LocalCluster, tmp_path: Path) -> None:
    from .server_fixtures import ServerProcess

    server = ServerProcess(tmp_path / "server-state", "--cluster", cluster.cluster.address).start()
    try:
        with Sandbox.create(url=server.url, memory="128M") as sb:
            seen: list[str] = []
            assert sb.commands.run("echo over rest", on_stdout=seen.append).stdout == "over rest\n"
            assert "".join(seen) == "over rest\n"
            sb.files.write("/tmp/x", "y")
            assert sb.files.read("/tmp/x") == "y"
            on_nodes = {info.sandbox_id for info in Sandbox.list(cluster=True)}
            assert sb.id in on_nodes  # held by a node's host, not by the server's process
        assert sb.id not in {info.sandbox_id for info in Sandbox.list(cluster=True)}
    finally:
        server.stop()


def host_of(cluster: LocalCluster, sandbox_id: str) -> str:
    """The node whose host actor holds ``sandbox_id``."""
    return next(node for node, actor in cluster.hosts.items() if ray.get(actor.owns.remote(sandbox_id)))


def test_a_stopped_node_does_not_hold_the_cluster_server_for_anyone(cluster: LocalCluster, tmp_path: Path) -> None:
    """A node's host that stops answering (SIGSTOP: a GC pause, a swap storm, a cut link) held the
    server's event loop: its reaper asked every sandbox's state there, without a timeout; and a
    listing (or a description) of a sandbox held there asked its state on the loop, twice, each up
    to the 3 s bound: every tenant's requests waited meanwhile."""
    import signal
    import threading

    import httpx

    from .server_fixtures import KEYS, ServerProcess

    server = ServerProcess(tmp_path / "server-state", "--cluster", cluster.cluster.address, keys=KEYS).start()
    alice, bob = server.client("alice"), server.client("bob")
    stopped: int | None = None
    try:
        stuck = alice.post("/v1/sandboxes", json={"limits": {"memory": "64M"}}).json()["id"]
        node = host_of(cluster, stuck)
        for _ in range(6):  # bob's sandbox on another node
            mine = bob.post("/v1/sandboxes", json={"limits": {"memory": "64M"}}).json()["id"]
            if host_of(cluster, mine) != node:
                break
            bob.delete(f"/v1/sandboxes/{mine}")
        stopped = ray.get(cluster.hosts[node].ping.remote())[1]
        os.kill(stopped, signal.SIGSTOP)
        time.sleep(1.5)  # the reaper has asked the stopped host by now
        alices_listings: list[int] = []

        def alice_lists() -> None:  # her sandbox's state is asked of the stopped host
            with server.client("alice") as own:
                for _ in range(2):
                    answer = own.get("/v1/sandboxes", timeout=30)
                    alices_listings.append(answer.status_code)
                    if answer.status_code == 200:
                        assert [s["state"] for s in answer.json()["sandboxes"]] == ["unknown"]

        listing = threading.Thread(target=alice_lists)
        listing.start()
        time.sleep(0.3)
        for _ in range(3):
            started = time.monotonic()
            assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200
            listed = bob.get("/v1/sandboxes", timeout=10)
            assert listed.status_code == 200 and [s["id"] for s in listed.json()["sandboxes"]] == [mine]
            assert time.monotonic() - started < 2.5
            time.sleep(0.5)
        listing.join(60)
        assert alices_listings == [200, 200]  # hers waited for the stopped host, and answered
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        # not answering for a while is not death: the sandbox was not reaped, and works
        ran = alice.post(f"/v1/sandboxes/{stuck}/exec", json={"cmd": "echo back"}, timeout=30)
        assert ran.status_code == 200 and ran.json()["stdout"] == "back\n"
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        alice.close()
        bob.close()
        server.stop()


def test_a_host_that_a_sibling_restarted_is_used_again(cluster: LocalCluster) -> None:
    """A host actor that crashed (its node stays) is replaced; the sandboxes it held are lost, but
    its node takes creates again (it was left out for the life of the driver, and a long-lived
    server answered 429 cluster_full once the other nodes were full)."""
    from corral.cluster.node.actor import start_hosts

    transport = ClusterTransport(True, k=WORKERS)  # asks every node: the emptiest is chosen
    made = [Sandbox.create(transport=transport) for _ in range(WORKERS)]
    try:
        assert len({sb.node_id for sb in made}) == WORKERS  # one on each node
        victim = made[0].node_id
        assert victim is not None
        ray.kill(cluster.hosts[victim], no_restart=True)
        # ray.kill does not wait: a command sent at once reached the old host in a full run
        assert wait_until(lambda: _gone(cluster.hosts[victim]), 20, every=0.1)
        with pytest.raises(SandboxLost):
            made[0].commands.run("true")
        # what a sibling host does within SIBLING_INTERVAL: a host on every node that has none
        assert wait_until(lambda: _restart(cluster, victim, start_hosts), 30, every=0.5)
        with pytest.raises(SandboxLost):  # the new host does not have it: still lost
            made[0].commands.run("true")
        # its node is back in the driver's list once the list is asked for again (NODES_TTL)
        assert wait_until(lambda: victim in transport.hosts(), 10, every=0.5)
        again = Sandbox.create(transport=transport)
        made.append(again)
        assert again.node_id == victim and again.commands.run("echo here").stdout == "here\n"
    finally:
        for sb in made:
            sb.kill()


def _gone(actor: Any) -> bool:
    """Whether ``actor`` answers no more (killed)."""
    try:
        ray.get(actor.ping.remote(), timeout=2)
    except ray.exceptions.GetTimeoutError:
        return False
    except ray.exceptions.RayActorError:
        return True
    return False


def _restart(cluster: LocalCluster, node: str, start_hosts: Any) -> bool:
    try:
        hosts = start_hosts(ray, janitor_interval=1.0)
    except Exception:
        return False
    cluster.hosts.update(hosts)
    return node in hosts


def rss_mib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) >> 10


def test_a_hosts_memory_for_output_is_bounded_and_given_back(cluster: LocalCluster) -> None:
    """The output of a sandbox's commands is kept in the node's host actor (outside every cgroup)
    until polled: at most the sandbox's max_output per command, and none of it after a destroy
    (it was 64 MiB per command, and a destroyed sandbox's stayed for good)."""
    transport = ClusterTransport(True, k=WORKERS)  # asks every node: the emptiest is chosen
    ballast = [Sandbox.create(transport=transport) for _ in range(WORKERS)]  # one on each node
    ballast.pop(0).kill()  # so every round is on that node, the emptiest
    rounds: list[int] = []
    try:
        for _ in range(4):
            sb = Sandbox.create(transport=transport, memory="128M", max_output="8M")
            try:
                actor = cluster.hosts[sb.node_id]
                pid = ray.get(actor.ping.remote())[1]
                for _ in range(4):  # 32 MiB each, nobody polls it
                    sb.commands.run("head -c 32M /dev/zero; sleep 60", background=True, timeout=90)
                assert wait_until(lambda: ray.get(actor.load.remote()).get("buffered", 0)  # noqa: B023
                                  >= 4 * (8 << 20) - (1 << 20), 20, every=0.2)
                assert ray.get(actor.load.remote())["buffered"] <= 4 * (8 << 20)
            finally:
                sb.kill()
            # none of it is kept after the destroy (under a full run's load this can take seconds:
            # the RSS below was read while the host still held a round's output)
            assert wait_until(lambda: ray.get(actor.load.remote()).get("buffered", 0) == 0, 30,  # noqa: B023
                              every=0.2), ray.get(actor.load.remote())
            if len(rounds) > 1:  # given back once its commands have ended (the first round is the warm-up)
                wait_until(lambda: rss_mib(pid) - rounds[1] < 40, 10, every=0.2)  # noqa: B023
            rounds.append(rss_mib(pid))
    finally:
        for sb in ballast:
            sb.kill()
    # before: +160 MiB a round (128 MiB kept for pollers, 32 for the results), never given back
    assert rounds[-1] - rounds[1] < 40, rounds


def test_a_hosts_output_bound_drops_and_says_so(state_dir: Path) -> None:
    from corral.cluster.node.command_output import Budget
    from corral.cluster.node.host import NodeHost
    from corral.spec import SandboxSpec
    from corral.transport import CommandCall, CreateOptions

    host = NodeHost("test-node", 2, state=str(state_dir), janitor_interval=60)
    host.buffers = Budget(3 << 20)  # the whole host's, for its commands' output not yet polled
    try:
        sandbox_id, _ = host.create(CreateOptions(SandboxSpec.from_dict({"limits": {"max_output": "2M"}}), {}, None))
        def ended(handle: int) -> None:  # (a poll that saw the end would hand its result out)
            assert wait_until(lambda: host._command(sandbox_id, handle).ended_at is not None, 20, every=0.1)

        # two at once, 4 MiB each: each is kept up to max_output, both up to the host's bound
        handles = [host.start(sandbox_id, CommandCall("head -c 4M /dev/zero"), None, True)[0] for _ in range(2)]
        # both ended before either is taken (taking gives its bytes back to the bound: a CI run
        # under load took the first while the second was still writing, and the second kept 2 MiB)
        for handle in handles:
            ended(handle)
        polls = [host.poll(sandbox_id, handle, 0, 0.0) for handle in handles]
        got = [sum(len(data) for _, data in poll.chunks) for poll in polls]
        assert all(0 < n <= 2 << 20 for n in got) and sum(got) <= 3 << 20 and all(p.truncated for p in polls), got
        assert all(p.result is not None and len(p.result.stdout) == 2 << 20 for p in polls)  # the result: max_output
        assert host.buffers.held == 0  # handed out: not kept
        assert host.poll(sandbox_id, 2, polls[1].cursor, 0.0).chunks == []
        # so the next command's output is kept again, up to its max_output
        handle = host.start(sandbox_id, CommandCall("head -c 4M /dev/zero"), None, True)[0]
        ended(handle)
        alone = host.poll(sandbox_id, handle, 0, 0.0)
        assert sum(len(data) for _, data in alone.chunks) == 2 << 20 and alone.truncated
    finally:
        host.shutdown()


def test_a_hosts_ended_results_are_let_go_of_once_handed_out_and_bounded_per_sandbox(state_dir: Path) -> None:
    """An ended command's result (its output up to max_output) was kept whole for 60 s after
    its end, handed out or not, beside its process's copy of the output, charged to nothing: a
    sandbox's 8 commands held 1.5 GB of the host actor.  Now a result handed out keeps no output,
    the process's copy goes at the end, and results nobody came for are kept up to twice the
    sandbox's max_output together (the newest)."""
    from corral.cluster.node.command_output import EndedProcess
    from corral.cluster.node.host import NodeHost
    from corral.spec import SandboxSpec
    from corral.transport import CommandCall, CreateOptions

    host = NodeHost("test-node-results", 2, state=str(state_dir), janitor_interval=60)
    four_mib = "head -c 4M /dev/zero | tr '\\0' a"
    try:
        sandbox_id, _ = host.create(CreateOptions(SandboxSpec.from_dict({"limits": {"max_output": "4M"}}), {}, None))

        def to_its_end(handle: int) -> Any:  # as a caller's run() polls: output, then the result
            cursor, deadline = 0, time.monotonic() + 60
            while time.monotonic() < deadline:
                poll = host.poll(sandbox_id, handle, cursor, 1.0)
                cursor = poll.cursor
                if poll.done:
                    return poll
            raise AssertionError("the command did not end")

        # handed out: each caller gets the whole result, and the host keeps none of it
        for _ in range(6):
            handle = host.start(sandbox_id, CommandCall(four_mib), None, False)[0]
            end = to_its_end(handle)
            result, pid = end.result, end.pid
            assert result.stdout == "a" * (4 << 20) and result.exit_code == 0 and not result.truncated
            assert host.load()["kept"] == 0
            assert isinstance(host._command(sandbox_id, handle).process, EndedProcess)  # its copy is gone
        # found again by pid after it was handed out: the end, without the output, and says so
        again = to_its_end(host.attach(sandbox_id, pid)).result
        assert (again.exit_code, again.stdout, again.truncated) == (0, "", True)
        # not handed out: the newest two (8 MiB of output, twice max_output) are kept whole
        handles = []
        for _ in range(4):
            handles.append(host.start(sandbox_id, CommandCall(four_mib), None, True)[0])
            assert wait_until(lambda: host._command(sandbox_id, handles[-1]).ended_at is not None, 30, every=0.1)
        assert host.load()["kept"] == 8 << 20
        results = [to_its_end(handle).result for handle in handles]
        assert [(len(r.stdout), r.truncated) for r in results] == [(0, True), (0, True), (4 << 20, False),
                                                                   (4 << 20, False)]
        assert all(r.exit_code == 0 for r in results) and host.load()["kept"] == 0
    finally:
        host.shutdown()


def test_output_kept_for_pollers_is_a_prefix_cut_to_the_byte_never_holed() -> None:
    """A chunk that did not fit whole was dropped and a smaller one after it kept: a poller got
    output with a hole in it (and the suite's 4 MiB command kept 2 MiB less 12 KiB of 2 MiB)."""
    from corral.cluster.node.command_output import Budget, Command

    command = Command(limit=100_000, budget=Budget(1 << 20))
    sent = bytes(range(256)) * 1000
    for start, size in ((0, 60_000), (60_000, 60_000), (120_000, 5_000)):
        command.feed("stdout", sent[start:start + size])
    assert b"".join(data for _, data in command.chunks) == sent[:100_000] and command.truncated
    # the host's bound: what is left of it is kept, then nothing more of that stream
    budget = Budget(50_000)
    first, second = Command(limit=100_000, budget=budget), Command(limit=100_000, budget=budget)
    first.feed("stdout", sent[:40_000])
    second.feed("stdout", sent[:30_000])
    budget.give(40_000)  # the first one's output handed out
    second.feed("stdout", sent[30_000:31_000])
    assert b"".join(data for _, data in second.chunks) == sent[:10_000] and second.truncated
    assert budget.held == 10_000
    second.feed("stderr", b"err")  # another stream of it is kept as before
    assert second.chunks[-1] == ("stderr", b"err")


def test_a_node_removed_without_grace_loses_its_sandboxes_typed_and_leaves_nothing(
        cluster: LocalCluster, state_dir: Path) -> None:
    sandboxes = [Sandbox.create(cluster=True) for _ in range(6)]
    victim = sandboxes[0].node_id
    assert victim is not None
    on_victim = [sb for sb in sandboxes if sb.node_id == victim]
    survivors = [sb for sb in sandboxes if sb.node_id != victim]
    in_flight: list[BaseException] = []

    def long_command(streamed: bool) -> None:
        try:
            on_victim[0].commands.run("sleep 60", timeout=90, on_stdout=(lambda _: None) if streamed else None)
        except BaseException as exc:
            in_flight.append(exc)

    runners = [threading.Thread(target=long_command, args=(streamed,)) for streamed in (True, False)]
    for runner in runners:
        runner.start()
    assert wait_until(lambda: len(on_victim[0].commands.list()) == 2, 10, every=0.2)  # both running on the node
    removed_at = time.monotonic()
    cluster.cluster.remove_node(cluster.node(victim), allow_graceful=False)
    for runner in runners:
        runner.join(15)
    assert len(in_flight) == 2 and all(isinstance(exc, SandboxLost) for exc in in_flight), in_flight
    for sb in on_victim:
        with pytest.raises(SandboxLost):
            sb.commands.run("true")
        with pytest.raises(SandboxLost):
            sb.files.read("/etc/hostname")
        with pytest.raises(SandboxLost):
            sb.get_info()
        assert not sb.is_running()
        sb.kill()  # nothing to do: gone with its node
    assert time.monotonic() - removed_at < 10

    fresh = [Sandbox.create(cluster=True) for _ in range(4)]
    assert all(sb.node_id != victim for sb in fresh)
    assert all(sb.commands.run("true").exit_code == 0 for sb in survivors + fresh)
    for sb in survivors + fresh:
        sb.kill()
    # the victim's host died with its sandboxes' owner: a surviving host's janitor reaps what they left
    left = wait_until(lambda: not any(sandbox_leftovers(sb.id, state_dir) for sb in on_victim), 30, every=0.2)
    assert left, [sandbox_leftovers(sb.id, state_dir) for sb in on_victim]

    # a node that joins gets its host from the hosts already there, without another `corral cluster up`
    joined = cluster.cluster.add_node(num_cpus=0, object_store_memory=80 << 20, resources={"corral_slots": SLOTS},
                                      node_ip_address=LOOPBACK)
    cluster.workers.append(joined)
    transport = ClusterTransport.shared(True)
    assert wait_until(lambda: joined.node_id in transport.hosts(fresh=True), 30, every=0.2)
    assert ray.get(transport.hosts()[joined.node_id].load.remote())["free"] == SLOTS


#: a driver in a process of its own: joins the cluster ``argv[1]`` as Corral does, says how it went
JOINER = """
import sys
import ray
from corral import Sandbox
from corral.errors import SandboxError
try:
    Sandbox.create(cluster=sys.argv[1], slot_timeout=1).kill()
    print("created", flush=True)
except SandboxError as exc:
    print(type(exc).__name__, ray.is_initialized(), exc, flush=True)
"""


def without_ray_token(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    env.update(extra)
    return env


def join_from_a_new_process(address: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", JOINER, address], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_driver_without_the_clusters_token_is_refused(cluster: LocalCluster) -> None:
    """The suite's cluster is set up as docs/cluster.md says: its token is what lets a driver in
    (its own drivers, with it, create sandboxes in every other test)."""
    address = cluster.cluster.address
    once = {"RAY_gcs_server_port_wait_time_s": "1"}  # one try to connect, not Ray's 20 (a second each)
    assert join_from_a_new_process(address, without_ray_token(**once)).startswith("ConnectionLost False ")
    wrong = without_ray_token(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), **once)
    assert join_from_a_new_process(address, wrong).startswith("ConnectionLost False ")


UNAUTHENTICATED_HEAD = """
import os, sys, tempfile
from pathlib import Path
temp = Path(tempfile.mkdtemp(prefix="c17-noauth-"))
(temp / "ray").mkdir()
os.environ["RAY_TMPDIR"] = str(temp)
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=False)
cluster.add_node(num_cpus=0, object_store_memory=80 << 20, node_ip_address="127.0.0.1", include_dashboard=False,
                 temp_dir=str(temp))
print(cluster.address, flush=True)
sys.stdin.read()
cluster.shutdown()
"""


def test_a_cluster_that_lets_drivers_in_without_a_token_is_refused_unless_the_caller_says_so(
        cluster: LocalCluster) -> None:
    """Ray runs what any driver sends, as root on Corral's nodes: a cluster without token
    authentication is refused (typed, nothing created, the driver's connection closed), and
    used only when the caller states that nobody else reaches it."""
    head = subprocess.Popen([sys.executable, "-c", UNAUTHENTICATED_HEAD], env=without_ray_token(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert head.stdout is not None
        address = head.stdout.readline().strip()
        assert address.startswith(LOOPBACK)
        refused = join_from_a_new_process(address, without_ray_token())
        assert refused.startswith("ClusterUnauthenticated False ") and "RAY_AUTH_MODE=token" in refused
        # a driver in token mode is let into such a cluster with any token: the cluster is asked
        # (old: joined, and Corral placed sandboxes there)
        with_a_token = without_ray_token(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
        assert join_from_a_new_process(address, with_a_token).startswith("ClusterUnauthenticated False ")
        assert issubclass(ClusterUnauthenticated, HostNotSupported)
        # stated: it is joined (and, having no node with slots, has no room for a sandbox)
        allowed = join_from_a_new_process(address, without_ray_token(CORRAL_RAY_UNAUTHENTICATED="1"))
        assert allowed.startswith("ClusterFull True ")
    finally:
        head.communicate("", timeout=60)


DRIVER = """
import sys, time
import ray
from corral import Sandbox
from corral.cluster.transport import ClusterTransport
ray.init(address=sys.argv[1], namespace="corral", include_dashboard=False, log_to_driver=False,
         logging_level="WARNING")
sandboxes = [Sandbox.create(cluster=True, idle_timeout=float(sys.argv[2])) for _ in range(2)]
print(" ".join(sb.id for sb in sandboxes), flush=True)
if sys.argv[3] == "wait":
    time.sleep(600)
"""


def test_a_killed_drivers_sandboxes_are_destroyed_within_their_idle_timeout(
        cluster: LocalCluster, state_dir: Path) -> None:
    idle = 3.0
    corral = str(Path(sys.executable).with_name("corral"))
    status = subprocess.Popen([corral, "cluster", "status", "--address", cluster.cluster.address],
                              stdout=subprocess.PIPE, text=True)
    drivers = [subprocess.Popen([sys.executable, "-c", DRIVER, cluster.cluster.address, str(long), mode],
                                stdout=subprocess.PIPE, text=True, env=os.environ.copy())
               for long, mode in ((idle, "wait"), (600, "exit"))]
    try:
        assert drivers[0].stdout is not None and drivers[1].stdout is not None
        ids = drivers[0].stdout.readline().split()
        assert len(ids) == 2
        listed = {info.sandbox_id for info in Sandbox.list(cluster=True)}
        assert set(ids) <= listed
        # a driver that exits without destroying its sandboxes: they go with it, not 600 s later
        left_behind = drivers[1].stdout.readline().split()
        assert len(left_behind) == 2 and drivers[1].wait(30) == 0
        assert not {i.sandbox_id for i in Sandbox.list(cluster=True)} & set(left_behind)
    finally:
        for driver in drivers:
            driver.kill()
            driver.wait(10)
    killed_at = time.monotonic()
    lines = status.communicate(timeout=60)[0].splitlines()
    assert status.returncode == 0 and len(lines) == WORKERS
    assert {json.loads(line)["node_id"] for line in lines} == set(ClusterTransport.shared(True).hosts(fresh=True))
    gone = wait_until(lambda: not {i.sandbox_id for i in Sandbox.list(cluster=True)} & set(ids), idle + 10, every=0.2)
    assert gone and time.monotonic() - killed_at < idle + 10
    for sandbox_id in ids:  # (unlisted once its row goes; its processes may take a moment more)
        assert_gone_soon(sandbox_id, state_dir, 10)


def test_placement_prefers_a_warm_pool_then_free_slots_then_memory() -> None:
    from corral.cluster.placement import rank, sample

    def load(node: str, free: int, memory: int, warm: int = 0) -> dict[str, Any]:
        return {"node_id": node, "free": free, "free_memory": memory << 30, "warm": warm}

    loads = [load("full", 0, 20, warm=3), load("roomy", 6, 20), load("warm", 1, 2, warm=1), load("tight", 6, 0)]
    assert [x["node_id"] for x in rank(loads, 1 << 30)] == ["warm", "roomy", "tight"]
    assert [x["node_id"] for x in rank([load("a", 2, 8), load("b", 2, 9)], 1 << 30)] == ["b", "a"]
    first, rest = sample(["a", "b", "c", "d"], 2)
    assert len(first) == 2 and sorted(first + rest) == ["a", "b", "c", "d"]


def test_a_killed_cluster_servers_paused_sandbox_ends_at_its_lifetime(cluster: LocalCluster, tmp_path: Path) -> None:
    """The server gave a node's sandbox its idle timeout only: after ``kill -9`` of the server a
    paused (or busy) sandbox, which the node's idle reaper skips, lived on past ``max_lifetime``,
    outside every quota (helper 106: still there minutes later). The node now ends it at its lifetime."""
    from .server_fixtures import ServerProcess

    server = ServerProcess(tmp_path / "server-state", "--cluster", cluster.cluster.address,
                           "--max-lifetime", "8").start()
    try:
        sb = Sandbox.create(url=server.url, memory="128M")
        sb.pause()
        [info] = [i for i in Sandbox.list(cluster=True) if i.sandbox_id == sb.id]
        assert info.end_at is not None and info.end_at - time.time() < 9, info
    finally:
        server.kill9()
    assert wait_until(lambda: sb.id not in {i.sandbox_id for i in Sandbox.list(cluster=True)}, 30)
