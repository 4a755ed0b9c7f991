"""`make demo`: an untrusted "agent" command run, contained, and cleaned up.

Plants a fake secret on the host (a file under /root and an environment
variable), then lets a hostile script try to read them, phone home, wipe the
filesystem, fork-bomb and eat memory — and shows that each attempt stays inside
the sandbox, and that nothing of the sandbox is left afterwards.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

BOLD, GREEN, RED, DIM, RESET = "\033[1m", "\033[32m", "\033[31m", "\033[2m", "\033[0m"
if not sys.stdout.isatty():
    BOLD = GREEN = RED = DIM = RESET = ""

HOSTILE = r"""
echo "== whoami: $(id)"
echo "== reading the host's secret file:"; cat /root/.corral-demo/id_rsa 2>&1 | head -1
echo "== host env secret: [${DEMO_API_KEY:-not visible}]"
echo "== phoning home:"; python3 -c "import urllib.request; urllib.request.urlopen('http://169.254.169.254/', timeout=2)" 2>&1 | tail -1
echo "== processes it can see (its own only): $(ls /proc | grep -c '^[0-9]')"
echo "== rm -rf / --no-preserve-root:"; rm -rf / --no-preserve-root 2>/dev/null; echo "   (exit $?; the sandbox's own files, if any)"
"""


def step(title: str) -> None:
    print(f"\n{BOLD}▶ {title}{RESET}")


def show(text: str) -> None:
    for line in text.rstrip().splitlines():
        print(f"   {DIM}│{RESET} {line}")


def main() -> int:
    own_state = "CORRAL_STATE_DIR" not in os.environ  # a state directory of its own: removed at the end
    os.environ.setdefault("CORRAL_STATE_DIR", tempfile.mkdtemp(prefix="corral-demo-"))
    from corral import Sandbox
    from corral.host import cgroups, mounts

    secret_dir = Path("/root/.corral-demo")
    secret_dir.mkdir(exist_ok=True)
    (secret_dir / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY----- (host secret)\n")
    os.environ["DEMO_API_KEY"] = "sk-live-host-secret"
    state = Path(os.environ["CORRAL_STATE_DIR"])
    try:
        step("Create a sandbox: 128 MiB memory, 64 processes, 64 MiB disk, no network")
        start = time.perf_counter()
        sb = Sandbox.create(memory="128M", pids=64, disk="64M", timeout=10)
        print(f"   {sb.id} ready in {(time.perf_counter() - start) * 1000:.1f} ms")
        with sb:
            step("Run a hostile script (as an injected prompt might)")
            result = sb.commands.run(HOSTILE)
            show(result.stdout + result.stderr)
            leaked = "host secret" in result.stdout or "sk-live" in result.stdout
            print(f"   {RED + 'LEAKED' if leaked else GREEN + 'nothing of the host was readable'}{RESET}")

            step("Fork bomb")
            result = sb.commands.run("bomb() { bomb | bomb & }; bomb; sleep 3", timeout=3)
            print(f"   held at the pids limit; killed after {result.duration_ms:.0f} ms (timed_out={result.timed_out})")

            step("Memory bomb")
            result = sb.commands.run(["python3", "-c", "x = []\nwhile True: x.append(bytearray(1 << 24))"])
            print(f"   exit {result.exit_code}, oom_killed={result.oom_killed}")

            step("The sandbox is still usable")
            show(sb.commands.run("echo still here; ls /workspace | wc -l").stdout)
            sandbox_id = sb.id
        step("Destroyed: what is left of it on the host?")
        leftovers = [f"cgroup {n}" for n in cgroups.list_sandbox_groups() if n == sandbox_id]
        leftovers += [str(m) for m in mounts.mounts_under(state / "sandboxes")]
        leftovers += [str(p) for p in (state / "sandboxes").iterdir()]
        print(f"   {GREEN + 'nothing: no process, mount, cgroup or file' if not leftovers else RED + str(leftovers)}{RESET}")
        return 1 if leftovers or leaked else 0
    finally:
        (secret_dir / "id_rsa").unlink()
        secret_dir.rmdir()
        if own_state:
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
