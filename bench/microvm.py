"""microVM tier figures: restore-from-snapshot vs boot-from-scratch, exec round
trip, memory per idle VM.

    .venv/bin/python bench/microvm.py [--cold N] [--pooled N] [--exec N] [--trace N] [--boots N] [--allow N] [--open N]

Prints p50/p95 of: cold create -> first command -> destroy (restored from the
template snapshot) and its parts, the restore itself (QEMU start -> agent
ready), exec round trip of ``true`` in a warm VM, create -> first command for a sandbox taken from a
warm pool (issue 16's target 5, create -> first command <= 150 ms, as a pool serves it), a boot from scratch to the
guest's ready marker, and RSS of the QEMU process of an idle VM.  With
``--trace N`` (default 3) it also restores N VMs with ``CORRAL_MICROVM_TRACE``
set and prints when each step of the guest's configuration ended, on the
host's clock (QEMU's trace events timestamp the guest's step bytes on its
serial port), and when the VM started running.  Target: restore <= 250 ms
under TCG.  Every line carries the 1-minute load average: the machine is
shared, and counts are small on purpose.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from corral import Sandbox
from corral.images import resolve
from corral.pool import SandboxPool
from corral.spec import Limits, SandboxSpec
from corral.tiers.microvm import MicroVMSandbox
from corral.tiers.microvm import template as templates
from corral.tiers.microvm.guest import assets
from corral.tiers.microvm.rootdisk import image_disk


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def line(name: str, values_ms: list[float]) -> None:
    print(f"{name:<44} p50 {pct(values_ms, 0.5):8.1f} ms   p95 {pct(values_ms, 0.95):8.1f} ms   (n={len(values_ms)}, "
          f"load {os.getloadavg()[0]:.1f})")


def rss_kib(pid: int) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1])
    return 0


def create(**network: object) -> tuple[Sandbox, MicroVMSandbox]:
    sb = Sandbox.create(tier="microvm", memory="256M", **network)
    inner = sb._inner
    assert isinstance(inner, MicroVMSandbox)
    return sb, inner


def trace_steps(inner: MicroVMSandbox) -> list[tuple[str, float]]:
    """(event, ms since QEMU was started) from a traced VM's qemu.log and console.log."""
    deadline = time.monotonic() + 5
    console = ""
    while "agent told to go" not in console and time.monotonic() < deadline:
        time.sleep(0.05)  # the guest writes its step names after the agent started
        console = inner.console_log.read_text(errors="replace")
    names = ["length read", *re.findall(r"corral-trace +[\d.]+ ms (.*)", console)]
    names = [f"{name} ({names[:i].count(name) + 1})" if names.count(name) > 1 else name
             for i, name in enumerate(names)]  # one line per layer
    steps = [("agent ready (host)", inner.timings["ready"] * 1000)]
    if "restore" in inner.timings:
        steps.append(("VM running (QMP RESUME)", inner.timings["restore"] * 1000))
    seen: set[int] = set()
    versions = 0
    for row in inner.qemu_log.read_text(errors="replace").splitlines():
        match = re.match(r"\d+@(\d+\.\d+):(\S+)(.*)", row)
        if not match:
            continue
        at = (float(match.group(1)) - inner.trace_wall0) * 1000
        event, rest = match.group(2), match.group(3)
        if event == "serial_write":
            byte = re.search(r"addr 0x00 val 0x([0-9a-f]+)", rest)
            step = int(byte.group(1), 16) - ord("A") if byte else -1
            if 0 <= step < len(names) and step not in seen:  # the first write of each step byte
                seen.add(step)
                steps.append((f"guest: {names[step]} done", at))
        elif event == "v9fs_version":
            steps.append((f"9p mount {versions} reaches QEMU", at))
            versions += 1
        elif event in ("qemu_loadvm_state_post_main", "virtio_console_chr_read"):
            steps.append(({"qemu_loadvm_state_post_main": "snapshot loaded",
                           "virtio_console_chr_read": "configuration handed to the guest"}[event], at))
    return steps


def traced(count: int, network: str = "none") -> None:
    os.environ["CORRAL_MICROVM_TRACE"] = "1"
    try:
        table: dict[str, list[float]] = {}
        for _ in range(count):
            sb, inner = create(network=network)
            try:
                for name, at in trace_steps(inner):
                    table.setdefault(name, []).append(at)
            finally:
                sb.kill()
    finally:
        del os.environ["CORRAL_MICROVM_TRACE"]
    print(f"traced restores, network={network} (n={count}, load {os.getloadavg()[0]:.1f}): "
          "median ms since QEMU was started")
    for name, values in sorted(table.items(), key=lambda item: statistics.median(item[1])):
        print(f"  {statistics.median(values):8.1f}  {name}")


def allowed(count: int) -> None:
    """network="allow": the proxy and bridge on the host, the relay told to listen in the guest."""
    created, ready, first = [], [], []
    for _ in range(count):
        start = time.monotonic()
        sb, inner = create(allow=["127.0.0.1:9"], unsafe_allow_ranges=["127.0.0.1/32"])
        made = time.monotonic()
        sb.commands.run(["true"])
        first.append((time.monotonic() - made) * 1000)
        sb.kill()
        created.append((made - start) * 1000)
        ready.append(inner.timings["ready"] * 1000)
    line("network=allow: create (Sandbox.create)", created)
    line("  of which QEMU start -> agent ready", ready)
    line("  then first command (true)", first)


def opened(count: int) -> None:
    """network="open": the namespace, veth, bridge, tap and table on the host, eth0 configured in the guest."""
    if Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() != "1":
        print("network=open: skipped (needs net.ipv4.ip_forward=1, which this bench does not switch on)")
        return
    created, ready, first, destroyed = [], [], [], []
    for _ in range(count):
        start = time.monotonic()
        sb, inner = create(network="open")
        made = time.monotonic()
        sb.commands.run(["true"])
        ran = time.monotonic()
        sb.kill()
        destroyed.append((time.monotonic() - ran) * 1000)
        first.append((ran - made) * 1000)
        created.append((made - start) * 1000)
        ready.append(inner.timings["ready"] * 1000)
    line("network=open: create (Sandbox.create)", created)
    line("  of which QEMU start -> agent ready", ready)
    line("  then first command (true)", first)
    line("  destroy", destroyed)


def translated_blocks(inner: MicroVMSandbox) -> int:
    """TCG translation blocks QEMU holds so far (``info jit``)."""
    text = inner.qmp().command("human-monitor-command", **{"command-line": "info jit"})
    found = re.search(r"TB count\s+(\d+)", str(text))
    return int(found.group(1)) if found else -1


def translations() -> None:
    """Why a restored VM's first command costs more than its next ones under TCG: QEMU translates
    guest code into host code as it first runs it, and a restored QEMU starts with no translations
    (they are not part of a snapshot, and a fork's QEMU is a new process too).  Prints the blocks
    each of three ``true`` translates and its time; every new process still translates some (the
    guest randomises where its libraries are mapped, and a translation is keyed by address)."""
    sb, inner = create()
    try:
        before = translated_blocks(inner)
        for which in ("first", "second", "third"):
            start = time.monotonic()
            sb.commands.run(["true"])
            took = (time.monotonic() - start) * 1000
            after = translated_blocks(inner)
            print(f"{'  ' + which + ' true in a restored VM: translated':<44} {after - before:8d} blocks "
                  f"{took:8.1f} ms   (load {os.getloadavg()[0]:.1f})")
            before = after
    finally:
        sb.kill()


def pooled(count: int) -> None:
    """create -> first command when the sandbox comes from a warm pool: the pool restored it and
    ran its health check (``true``) while nobody waited, so the owner's first command finds the
    guest's command path already translated by TCG (a new VM's first command pays that, above)."""
    spec = SandboxSpec(tier="microvm", limits=Limits(memory=256 * 2**20))
    to_first, first_cmd = [], []
    with SandboxPool(spec, min_idle=1, max_idle=1) as pool:
        for _ in range(count):
            deadline = time.monotonic() + 60
            while pool.idle_count() < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)  # the refill's settle: nothing of the pool runs beside the measurement
            start = time.monotonic()
            sb = pool.acquire()
            acquired = time.monotonic()
            sb.commands.run(["true"])
            ran = time.monotonic()
            sb.kill()
            to_first.append((ran - start) * 1000)
            first_cmd.append((ran - acquired) * 1000)
    line("pooled: create (acquire) -> first command", to_first)
    line("  of which first command (true)", first_cmd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cold", type=int, default=5)
    parser.add_argument("--exec", type=int, default=10, dest="execs")
    parser.add_argument("--trace", type=int, default=3)
    parser.add_argument("--boots", type=int, default=1)
    parser.add_argument("--trace-network", default="none", help="the network mode of the traced restores")
    parser.add_argument("--allow", type=int, default=0, help="also N cold creates with network='allow'")
    parser.add_argument("--pooled", type=int, default=5,
                        help="N creates taken from a warm pool (SandboxPool, one member) -> first command")
    parser.add_argument("--open", type=int, default=0, dest="opens",
                        help="also N cold creates with network='open' (needs IPv4 forwarding on)")
    args = parser.parse_args()
    if "CORRAL_STATE_DIR" not in os.environ:  # a private one, removed at exit
        os.environ["CORRAL_STATE_DIR"] = tempfile.mkdtemp(prefix="corral-bench-")
        atexit.register(shutil.rmtree, os.environ["CORRAL_STATE_DIR"], True)

    # warm the template cache (first use on a machine boots and saves it)
    sb, inner = create()
    accel = inner._tier.accel
    sb.commands.run(["true"])
    sb.kill()
    print(f"microvm tier, accelerator {accel}")

    cold, created, first, destroyed, to_ready = [], [], [], [], []
    for _ in range(args.cold):
        start = time.monotonic()
        sb, inner = create()
        ready = time.monotonic()
        sb.commands.run(["true"])
        ran = time.monotonic()
        sb.kill()
        end = time.monotonic()
        cold.append((end - start) * 1000)
        created.append((ready - start) * 1000)
        first.append((ran - ready) * 1000)
        destroyed.append((end - ran) * 1000)
        to_ready.append((inner.timings["total"] - inner.timings["template"]) * 1000)
    line("cold create -> first command -> destroy", cold)
    line("  of which create (Sandbox.create)", created)
    line("  of which first command (true) in a new VM", first)
    line("  of which destroy", destroyed)
    line("restore: QEMU start -> agent ready", to_ready)
    if accel == "tcg":
        translations()
    if args.pooled:
        pooled(args.pooled)
    if args.allow:
        allowed(args.allow)
    if args.opens:
        opened(args.opens)
    if args.trace:
        traced(args.trace, args.trace_network)

    sb, inner = create()
    try:
        sb.commands.run(["true"])
        rtt = []
        for _ in range(args.execs):
            start = time.monotonic()
            sb.commands.run(["true"])
            rtt.append((time.monotonic() - start) * 1000)
        line("exec round trip (true)", rtt)
        start = time.monotonic()
        sb.commands.run(["python3", "-c", "print(1)"])
        print(f"{'python3 -c print(1) in a warm VM':<44} {(time.monotonic() - start) * 1000:8.1f} ms")
        time.sleep(1.0)
        pid = inner.qemu_pid()
        assert pid is not None
        print(f"{'RSS of an idle VM (QEMU process)':<44} {rss_kib(pid) / 1024:8.1f} MiB"
              f"   (host cgroup: {inner.cgroup.memory_usage() / 2**20 if inner.cgroup else 0:.1f} MiB)")
    finally:
        sb.kill()

    guest = assets()
    disk = image_disk(resolve("host", Path(os.environ["CORRAL_STATE_DIR"])))
    boots = []
    for _ in range(args.boots):
        with tempfile.TemporaryDirectory(prefix="corral-boot-") as tmp:
            proc, qmp, seconds = templates._boot(Path(tmp), guest, accel, 384, time.monotonic() + 180, disk)
            qmp.close()
            proc.kill()
            proc.wait()
            boots.append(seconds * 1000)
    if boots:
        line("boot from scratch -> guest ready marker", boots)


if __name__ == "__main__":
    main()
