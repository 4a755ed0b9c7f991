"""Headless Chromium in a sandbox, and exposed ports (issue 12).

Prints, with the load average:
  - cold create -> first screenshot -> destroy, p50/p95, per tier (process, gVisor);
    baseline: the same ``chromium --screenshot`` in a live sandbox (Chromium's own start)
  - the same from a warm pool (``SandboxPool``: the sandbox is ready, Chromium is not)
  - Chromium's memory per sandbox: the sandbox's memory cgroup with Chromium idle on a page,
    minus the sandbox before Chromium started
  - an exposed port: added latency per request (a new TCP connection, one request, one
    byte back) and bulk throughput, against the same server on the host's loopback (baseline)

Usage: python bench/browser.py [-n 10] [--tiers process,gvisor] [--bulk-mib 256]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

if "CORRAL_STATE_DIR" not in os.environ:
    os.environ["CORRAL_STATE_DIR"] = tempfile.mkdtemp(prefix="corral-bench-")
    atexit.register(shutil.rmtree, os.environ["CORRAL_STATE_DIR"], True)

from corral import Sandbox
from corral.images import recipe as recipes
from corral.images.build import build
from corral.pool import SandboxPool
from corral.spec import SandboxSpec
from corral.surface import build_spec

MiB = 1 << 20
SPEC = {"image": "browser", "memory": "1G", "pids": 512}
PAGE = "<html><body><h1>bench</h1><p>" + "text " * 200 + "</p></body></html>"
SHOT = ("cd /tmp && chromium --headless --no-sandbox --disable-gpu --disable-background-networking "
        "--screenshot --window-size=800,600 file:///tmp/page.html >/dev/null 2>&1 && test -s screenshot.png")
# the bench's server: each connection sends one line; "N" -> N bytes back (1 MiB writes), then close
SERVER = """
import socket, threading
def serve(c):
    with c:
        n = int(c.makefile('rb').readline())
        block = bytes(1 << 20)
        while n > 0:
            c.sendall(block[:min(n, len(block))]); n -= min(n, len(block))
s = socket.create_server((HOST, PORT), backlog=128)
print('ready', flush=True)
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def line(what: str, values: list[float], unit: str = "ms", base: float | None = None) -> None:
    p50 = statistics.median(values)
    ratio = f"  x{p50 / base:.2f} of baseline" if base else ""
    print(f"  {what:<52} p50 {p50:9.1f} {unit}  p95 {pct(values, 95):9.1f} {unit}{ratio}")


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def screenshot(sb: Sandbox) -> None:
    sb.files.write("/tmp/page.html", PAGE)
    result = sb.commands.run(SHOT, timeout=120)
    assert result.exit_code == 0, result


def bench_tier(tier: str, n: int) -> None:
    print(f"{tier}:")

    def cold() -> None:
        with Sandbox.create(tier=tier, **SPEC) as sb:
            screenshot(sb)

    with Sandbox.create(tier=tier, **SPEC) as sb:
        screenshot(sb)  # warm the page cache
        warm = timed(lambda: screenshot(sb), n)
    line("screenshot in a live sandbox (baseline)", warm)
    line("cold create -> first screenshot -> destroy", timed(cold, n), base=statistics.median(warm))
    spec = build_spec(SandboxSpec(), tier=tier, image="browser", memory="1G", pids=512)
    with SandboxPool(spec, min_idle=1, max_idle=1) as pool:
        pooled = []
        for _ in range(n):
            deadline = time.monotonic() + 60
            while pool.idle_count() == 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # the pool refills between acquisitions: a warm start each time
            start = time.perf_counter()
            sb = pool.acquire()
            screenshot(sb)
            pooled.append((time.perf_counter() - start) * 1000)
            sb.kill()
    line("warm pool: acquire -> first screenshot", pooled, base=statistics.median(warm))
    with Sandbox.create(tier=tier, **SPEC) as sb:
        group = sb._tier_sandbox().cgroup  # type: ignore[attr-defined]
        sb.files.write("/tmp/page.html", PAGE)
        before = group.memory_usage()
        sb.commands.start("chromium --headless --no-sandbox --disable-gpu --disable-background-networking "
                          "--remote-debugging-port=9222 file:///tmp/page.html", timeout=600)
        exposed = sb.ports.expose(9222)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _get(exposed.port, b"GET /json/list HTTP/1.0\r\n\r\n"):
            time.sleep(0.1)
        time.sleep(2)  # settle
        after = group.memory_usage()
    print(f"  {'Chromium idle on a page: sandbox memory cgroup':<52} +{(after - before) / MiB:.0f} MiB "
          f"(sandbox before Chromium: {before / MiB:.0f} MiB)")


def _get(port: int, request: bytes) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(request)
            return b"".join(iter(lambda: c.recv(65536), b""))
    except OSError:
        return b""


def request(port: int, n: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(b"%d\n" % n)
        got = 0
        buf = bytearray(1 << 20)
        while (k := c.recv_into(buf)) > 0:
            got += k
        return got


def bench_ports(tier: str, n: int, bulk: int) -> None:
    print(f"exposed port, {tier} tier:")
    host = subprocess.Popen([sys.executable, "-c", SERVER.replace("HOST", "'127.0.0.1'").replace("PORT", "0")
                             .replace("print('ready', flush=True)", "print(s.getsockname()[1], flush=True)")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        host_port = int(host.stdout.readline())
        with Sandbox.create(tier=tier) as sb:
            ready = threading.Event()
            sb.commands.start(["python3", "-c", SERVER.replace("HOST", "'127.0.0.1'").replace("PORT", "8000")],
                              timeout=3600, on_stdout=lambda text: ready.set())
            assert ready.wait(30)
            exposed = sb.ports.expose(8000)
            for port in (host_port, exposed.port):
                request(port, 1)  # warm
            base = timed(lambda: request(host_port, 1), n * 20)
            line("request (connect, 1 byte back): host loopback (baseline)", base)
            fwd = timed(lambda: request(exposed.port, 1), n * 20)
            line("request through the exposed port", fwd, base=statistics.median(base))
            print(f"  {'added per request (p50)':<52} +{statistics.median(fwd) - statistics.median(base):.2f} ms")
            for what, port in (("bulk: host loopback (baseline)", host_port), ("bulk through the exposed port",
                                                                               exposed.port)):
                start = time.perf_counter()
                assert request(port, bulk) == bulk
                seconds = time.perf_counter() - start
                print(f"  {what:<52} {bulk / MiB / seconds:9.0f} MB/s ({bulk // MiB} MiB)")
    finally:
        host.kill()
        host.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", "--iterations", type=int, default=10)
    parser.add_argument("--tiers", default="process,gvisor")
    parser.add_argument("--bulk-mib", type=int, default=256)
    args = parser.parse_args()
    build(recipes.load("browser"), Path(os.environ["CORRAL_STATE_DIR"]))
    print(f"load average at start: {os.getloadavg()[0]:.2f}  (n={args.iterations})")
    for tier in args.tiers.split(","):
        bench_tier(tier, args.iterations)
    for tier in args.tiers.split(","):
        bench_ports(tier, args.iterations, args.bulk_mib * MiB)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
