"""Finding ``runsc`` and choosing the gVisor platform that really works on this host.

A platform is chosen by running a tiny sandbox on it under a short deadline,
never by looking at the host: on a PVM-style KVM host ``/dev/kvm`` opens and
its ioctls succeed, yet ``--platform=kvm`` hangs.  Order: systrap (the default
since 2023, fast, no special device), then ptrace, then kvm.  The answer is
cached per (runsc binary, kernel) in the state directory, so only the first
sandbox (or ``corral doctor``) pays for the probe.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import HostNotSupported
from ...host import cgroups
from ...spec import Limits

#: the oldest runsc known to work: Debian bookworm's 20221219 fails statx (`ls`, `stat`: EINVAL)
MIN_VERSION = 20240729
PLATFORMS = ("systrap", "ptrace", "kvm")
PROBE_DEADLINE = {"systrap": 8.0, "ptrace": 8.0, "kvm": 3.0}
#: force a platform (still probed: a forced platform that fails is an error, not a silent fallback)
PLATFORM_ENV = "CORRAL_GVISOR_PLATFORM"


@dataclass(frozen=True)
class Platform:
    name: str
    version: str
    #: what the probe saw, for `corral doctor`
    why: str


def runsc_binary() -> Path:
    """The runsc to use, or HostNotSupported with the fix."""
    candidates = ("/usr/bin/runsc", "/usr/sbin/runsc")
    found = shutil.which("runsc") or next((p for p in candidates if os.access(p, os.X_OK)), None)
    if found is None:
        raise HostNotSupported("runsc (gVisor) is not installed: run `make install` (runsc from bookworm-backports)")
    version = runsc_version(Path(found))
    if version < MIN_VERSION:
        raise HostNotSupported(
            f"runsc {version} at {found} is too old (its statx breaks `ls`); need >= {MIN_VERSION}: "
            "apt-get install -t bookworm-backports runsc (or `make install`)"
        )
    return Path(found)


def runsc_version(runsc: Path) -> int:
    """The release date of a runsc binary as YYYYMMDD (0 when unknown)."""
    try:
        out = subprocess.run([str(runsc), "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    match = re.search(r"(20\d{6})", out)
    return int(match.group(1)) if match else 0


def _cache_key(runsc: Path) -> str:
    st = runsc.stat()
    return f"{runsc}:{st.st_size}:{st.st_mtime_ns}:{os.uname().release}"


def choose_platform(runsc: Path, state_dir: Path) -> Platform:
    """The first platform that runs a sandbox here (cached), or HostNotSupported saying what each did."""
    forced = os.environ.get(PLATFORM_ENV, "")
    if forced and forced not in PLATFORMS:
        raise HostNotSupported(f"{PLATFORM_ENV}={forced!r}: use one of {', '.join(PLATFORMS)}")
    candidates = (forced,) if forced else PLATFORMS
    cache = state_dir / "gvisor-platform.json"
    key = _cache_key(runsc)
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key and cached.get("name") in candidates:
            return Platform(cached["name"], str(cached["version"]), cached["why"])
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    version = str(runsc_version(runsc))
    seen: list[str] = []
    for name in candidates:
        if name == "kvm" and not os.path.exists("/dev/kvm"):
            seen.append("kvm: no /dev/kvm")
            continue
        ok, detail = probe_platform(runsc, name, state_dir, PROBE_DEADLINE[name])
        seen.append(f"{name}: {detail}")
        if ok:
            platform = Platform(name, version, "; ".join(seen))
            state_dir.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"key": key, "name": name, "version": version, "why": platform.why}))
            os.replace(tmp, cache)
            return platform
    raise HostNotSupported("no gVisor platform works on this host (" + "; ".join(seen) + ")")


def probe_platform(runsc: Path, name: str, state_dir: Path, deadline: float) -> tuple[bool, str]:
    """Run ``uname -r`` in a throwaway sandbox on ``name``; kill it all if it misses the deadline.

    The probe runs in its own cgroup so a hung Sentry (kvm here) and every
    process it started are killed, not leaked.
    """
    group = cgroups.SandboxCgroup(f"gvisor-probe-{os.getpid()}-{name}", Limits())
    root = Path(tempfile.mkdtemp(prefix="gvisor-probe-", dir=state_dir if state_dir.is_dir() else None))
    procs_files = group.procs_files(group.leaf("probe"))

    def join() -> None:
        cgroups.join(procs_files, os.getpid())

    argv = [str(runsc), "--root", str(root), "--platform", name, "--network", "none", "--ignore-cgroups",
            "--log", str(root / "log"), "do", "--", "/bin/uname", "-r"]
    start = time.monotonic()
    try:
        # ``runsc do`` makes its bundle in $TMPDIR and leaves it there (/tmp/runsc-doNNN, one per
        # probe): in the probe's own directory, removed below
        env = {**os.environ, "TMPDIR": str(root)}
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                preexec_fn=join, start_new_session=True, cwd="/", env=env)
        try:
            out, err = proc.communicate(timeout=deadline)
        except subprocess.TimeoutExpired:
            group.kill_all()
            proc.kill()
            proc.communicate()
            return False, f"no answer within {deadline:.0f} s"
        took = time.monotonic() - start
        if proc.returncode == 0 and out.strip():
            return True, f"ran a sandbox in {took * 1000:.0f} ms"
        message = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        return False, f"failed (exit {proc.returncode}: {message[:200]})"
    finally:
        group.destroy()
        shutil.rmtree(root, ignore_errors=True)
