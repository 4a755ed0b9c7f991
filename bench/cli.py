"""`corral run -- true` as a whole process, beside the floors and the peers (issue 16, target 1).

Each command is started N times, interleaved (A B C A B C ...) so drift in the
machine's speed hits all alike; printed: p50/p95 wall time per command and the
p50's ratio to bare bubblewrap (the floor; target: corral run p50 <= 20 ms,
<= 6x bwrap).  Rows:

- bare `bwrap --unshare-all ... true` (the floor) and `python -I -S -c pass`
  (the interpreter's own start-up, which any Python CLI pays);
- `corral run -- true` in-process (no daemon), and through `corral daemon`
  (started here with its own state directory, stopped at the end): `corral` is
  `make install`'s C launcher (src/corral/cli/launcher.c); the Python CLI's own
  client of the daemon (cli/fast_run.py) is the `python -m corral.cli` row;
- the peers, when installed (never a test dependency): firejail, `runsc do`,
  Anthropic's sandbox-runtime (`srt`), Codex's Linux sandbox (`codex sandbox linux`).

Usage: python bench/cli.py [--runs 30]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BWRAP = ["bwrap", "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
         "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev",
         "true"]


def peers() -> dict[str, list[str]]:
    found = {}
    if shutil.which("firejail"):
        found["firejail --noprofile true"] = ["firejail", "--quiet", "--noprofile", "true"]
    if shutil.which("runsc"):
        found["runsc do true"] = ["runsc", "--network=none", "do", "true"]
    if shutil.which("srt"):
        found["sandbox-runtime (srt) true"] = ["srt", "true"]
    if shutil.which("codex"):
        found["codex sandbox linux true"] = ["codex", "sandbox", "linux", "true"]
    return found


def start_daemon(corral: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([corral, "daemon", "--pool", "2"], env=env, stderr=subprocess.DEVNULL)
    path = Path(env["CORRAL_STATE_DIR"]) / "daemon.sock"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(str(path))
                time.sleep(1)  # let the pool fill
                return proc
            except OSError:
                time.sleep(0.05)
    raise SystemExit("the daemon did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    corral = str(Path(sys.executable).with_name("corral"))
    state = tempfile.mkdtemp(prefix="corral-bench-cli-")
    base_env = {**os.environ, "CORRAL_STATE_DIR": state}
    base_env.pop("CORRAL_URL", None)
    rows: dict[str, tuple[list[str], dict[str, str]]] = {
        "floor: bare bwrap true": (BWRAP, base_env),
        "python -I -S -c pass": ([sys.executable, "-I", "-S", "-c", "pass"], base_env),
        "corral run -- true (in-process)": ([corral, "run", "--", "true"], {**base_env, "CORRAL_NO_DAEMON": "1"}),
        "corral run -- true (daemon)": ([corral, "run", "--", "true"], base_env),
        "python -m corral.cli run (daemon)": ([sys.executable, "-m", "corral.cli", "run", "--", "true"], base_env),
    }
    rows.update({name: (argv, base_env) for name, argv in peers().items()})
    load0 = os.getloadavg()
    daemon = start_daemon(corral, base_env)
    samples: dict[str, list[float]] = {name: [] for name in rows}
    try:
        for _ in range(args.runs):
            for name, (argv, env) in rows.items():
                start = time.perf_counter()
                subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
                samples[name].append((time.perf_counter() - start) * 1000)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
        shutil.rmtree(state, ignore_errors=True)
    floor = statistics.median(samples["floor: bare bwrap true"])
    print(f"load average: {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; {args.runs} runs each, interleaved")
    print(f"{'command':36s} {'p50 ms':>8s} {'p95 ms':>8s} {'p50/bwrap':>10s}")
    for name, values in samples.items():
        ordered = sorted(values)
        p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
        print(f"{name:36s} {statistics.median(values):8.1f} {p95:8.1f} {statistics.median(values) / floor:10.2f}")
    missing = [p for p in ("firejail", "runsc", "srt", "codex") if not shutil.which(p)]
    if missing:
        print(f"peers not installed here (not measured): {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
