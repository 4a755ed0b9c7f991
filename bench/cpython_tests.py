"""CPython's own OS-facing tests inside sandboxes (issue 13), against the same tests on the host.

Runs Debian's libpython3.11-testsuite modules (default: test_os, test_subprocess, test_shutil,
test_posix) with ``python3 -m test --junit-xml`` on the host (the baseline: this machine's root)
and inside a process-tier sandbox as ``user="root"`` and as the default user (uid 1000), then
prints per module the tests that fail or error in a sandbox but pass on the host, and the
other way round.  Too slow for the suite (minutes on 2 cores): run it by hand.

Usage: python bench/cpython_tests.py [--tier process] [--users root,user] [--no-host] [MODULE...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from corral import Sandbox

PY = "/usr/bin/python3"
MODULES = ["test_os", "test_subprocess", "test_shutil", "test_posix"]


def outcomes(xml: bytes) -> dict[str, str]:
    """test id -> passed | failed | error | skipped, from a junit XML report."""
    found: dict[str, str] = {}
    for case in ET.fromstring(xml).iter("testcase"):
        name = str(case.get("name")) if case.get("classname") in (None, "None") else \
            f"{case.get('classname')}.{case.get('name')}"
        kinds = {child.tag for child in case}
        found[name] = next((k for k in ("error", "failure", "skipped") if k in kinds), "passed").replace(
            "failure", "failed")
    return found


def run_on_host(modules: list[str], timeout: float) -> tuple[dict[str, str], float]:
    with tempfile.TemporaryDirectory(prefix="c13-cpy-") as tmp:
        report = Path(tmp) / "host.xml"
        start = time.monotonic()
        subprocess.run([PY, "-m", "test", "--junit-xml", str(report), "-q", *modules], cwd=tmp,
                       capture_output=True, timeout=timeout)
        return outcomes(report.read_bytes()), time.monotonic() - start


def run_in_sandbox(tier: str, user: str, modules: list[str], timeout: float) -> tuple[dict[str, str], float]:
    with Sandbox.create(tier=tier, user=user, memory="2G", disk="2G", pids=2048, timeout=timeout) as sb:
        start = time.monotonic()
        sb.commands.run(f"cd /tmp && {PY} -m test --junit-xml /tmp/report.xml -q {' '.join(modules)}", timeout=timeout)
        took = time.monotonic() - start
        return outcomes(sb.files.read("/tmp/report.xml", format="bytes")), took


def summary(found: dict[str, str]) -> str:
    counts = {k: sum(1 for v in found.values() if v == k) for k in ("passed", "failed", "error", "skipped")}
    return " ".join(f"{k} {n}" for k, n in counts.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", default=MODULES)
    parser.add_argument("--tier", default="process")
    parser.add_argument("--users", default="root,user")
    parser.add_argument("--no-host", action="store_true", help="skip the host baseline")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    if not Path("/usr/lib/python3.11/test/test_os.py").exists():
        print("needs Debian's libpython3.11-testsuite (make install)", file=sys.stderr)
        return 2
    with open("/proc/loadavg") as f:
        print(f"load average at start: {' '.join(f.read().split()[:3])}")
    host: dict[str, str] = {}
    if not args.no_host:
        host, took = run_on_host(args.modules, args.timeout)
        print(f"host (root)              {took:7.1f} s  {summary(host)}")
    bad = ("failed", "error")
    worse_anywhere = False
    for user in args.users.split(","):
        found, took = run_in_sandbox(args.tier, user, args.modules, args.timeout)
        print(f"{args.tier:8} user={user:5}       {took:7.1f} s  {summary(found)}")
        worse = sorted(t for t, v in found.items() if v in bad and host.get(t, "passed") not in bad)
        better = sorted(t for t, v in host.items() if v in bad and found.get(t) not in bad)
        skipped_here = sorted(t for t, v in found.items() if v == "skipped" and host.get(t) == "passed")
        for label, tests in (("fails here, passes on the host", worse), ("fails on the host, passes here", better),
                             ("skipped here, passes on the host", skipped_here)):
            for test in tests:
                print(f"    {label}: {test}")
        worse_anywhere |= bool(worse)
    with open("/proc/loadavg") as f:
        print(f"load average at end: {' '.join(f.read().split()[:3])}")
    return 1 if worse_anywhere else 0


if __name__ == "__main__":
    sys.exit(main())
