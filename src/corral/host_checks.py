"""The host checks behind ``corral doctor``: what this host can and cannot do, each with the fix.

The command itself (arguments, output, the tier probes beside these) is :mod:`corral.cli.doctor`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .errors import HostNotSupported


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def _userns() -> Check:
    try:
        max_ns = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        max_ns = -1
    if max_ns == 0:
        return Check("user namespaces", False, "user.max_user_namespaces = 0", "sysctl -w user.max_user_namespaces=15000")
    restrict = Path("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")
    if restrict.exists() and restrict.read_text().strip() == "1":
        return Check("user namespaces", False, "restricted by AppArmor",
                     "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0")
    return Check("user namespaces", True, f"enabled (max {max_ns})")


def _cgroups() -> Check:
    from .host import cgroups

    try:
        layout = cgroups.detect()
    except HostNotSupported as exc:
        return Check("cgroups", False, str(exc), "mount cgroup2 at /sys/fs/cgroup with memory, pids, cpu")
    return Check("cgroups", True, layout.describe())


def _cgroup_moves() -> Check:
    """Each command is moved into a cgroup of its own (its kill tree), and each create moves its
    launcher.  A move takes the kernel's global threadgroup lock for writing, which waits for an
    RCU grace period unless one just passed: 5-24 ms after a pause, 0.05 ms back to back
    (measured on this VM).  Corral expedites that grace period around its own moves
    (host/grace.py: ``/sys/kernel/rcu_expedited``, set for a fraction of a millisecond);
    the cgroup2 mount option ``favordynmods`` (Linux 6.0+) removes the wait for good, and makes
    every fork and exit on the host a little dearer: an operator's choice, reported, never applied."""
    from .host import cgroups, grace, mounts

    try:
        root = cgroups.detect().kill_root
    except HostNotSupported:
        return Check("cgroup moves", False, "no cgroups")
    if "favordynmods" in mounts.superblock_options(root).split(","):
        return Check("cgroup moves", True, f"{root} has favordynmods: a move never waits for a grace period")
    switch = grace.current()
    if os.environ.get("CORRAL_EXPEDITE_CGROUP_MOVES", "1") == "0":
        how = "not expedited (CORRAL_EXPEDITE_CGROUP_MOVES=0): a move after a pause may wait 5-24 ms"
    elif switch == "1":
        how = f"{grace.SWITCH} is set (by the administrator, or left by a Corral process killed mid-move)"
    elif switch == "0":
        how = f"expedited around Corral's own moves ({grace.SWITCH}, set for the move only)"
    else:
        how = f"{grace.SWITCH} {switch}: a move after a pause may wait 5-24 ms for an RCU grace period"
    return Check("cgroup moves", True, f"{how}; optional: mount -o remount,favordynmods {root} "
                 "(Linux 6.0+; forks and exits cost a bit more)")


def _bwrap() -> Check:
    path = shutil.which("bwrap")
    if path is None:
        return Check("bubblewrap", False, "not installed", "apt-get install bubblewrap")
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
    return Check("bubblewrap", True, f"{path} ({version})")


def _seccomp() -> Check:
    try:
        from .host.seccomp import build_filter

        build_filter()
    except HostNotSupported as exc:
        return Check("seccomp", False, str(exc), "apt-get install libseccomp2; pip install pyseccomp")
    return Check("seccomp", True, "libseccomp filter compiles")


def _landlock() -> Check:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION) returns the ABI version
    abi = libc.syscall(444, None, 0, 1)
    if abi < 0:
        return Check("landlock", False, "not available (not required)", "boot with lsm=...,landlock")
    return Check("landlock", True, f"ABI {abi} (not used yet: namespaces already hide the host)")


def _workspace_watch() -> Check:
    from .host.fsnotify import ChangeWatch

    # the sandbox's disk is a tmpfs: /dev/shm is one too, where there is one
    watch = ChangeWatch.open("/dev/shm") if os.path.isdir("/dev/shm") else None
    if watch is None:
        return Check("workspace watch", False, "no fanotify with file handles: each workspace write-back walks "
                     "everything the sandbox changed (not required)", "Linux >= 5.9 with CONFIG_FANOTIFY")
    watch.close()
    return Check("workspace watch", True, "fanotify: a workspace write-back looks only at what changed since the last")


def _root() -> Check:
    if os.geteuid() == 0:
        return Check("privileges", True, "running as root (cgroups and mounts)")
    return Check("privileges", False, "not root", "run corral as root (rootless mode is not supported yet)")


def _network_open() -> Check:
    from .egress.open_net import check_host

    try:
        check_host()
    except HostNotSupported as exc:
        return Check("network open", False, str(exc).split(":")[0] + " (none and allow still work)",
                     "sysctl -w net.ipv4.ip_forward=1; apt-get install nftables iproute2")
    return Check("network open", True, "IPv4 forwarding on, nftables present")


def _network_allow() -> Check:
    """Proved by doing it: a throwaway namespace with its table and NFLOG group, made and deleted."""
    import secrets

    from .egress.allow_net import AllowNetwork
    from .egress.audit import AuditLog

    try:
        AllowNetwork("sb-" + secrets.token_hex(8), AuditLog()).close()
    except HostNotSupported as exc:
        return Check("network allow", False, str(exc), "apt-get install nftables")
    return Check("network allow", True, "namespace, nftables table and NFLOG audit work")


def _shared_tables() -> Check:
    """The host-wide kernel tables (open files, pids, terminals): the first sandbox of each
    process raises those below what Corral wants (:func:`corral.host.shared_tables.widen`);
    this check only says which it will raise, and which it cannot."""
    from .host import shared_tables

    narrow = shared_tables.narrow()
    stuck = [t for t in narrow if not os.access(t.path, os.W_OK)]
    if stuck:
        return Check("shared kernel tables", False, "one sandbox can empty: " + ", ".join(
            f"{t.name} = {shared_tables.current(t)} ({t.why})" for t in stuck),
            "; ".join(f"sysctl -w {t.name}={t.wanted}" for t in stuck))
    sizes = ", ".join(f"{t.name} = {shared_tables.current(t)}" for t in shared_tables.TABLES)
    if narrow:
        return Check("shared kernel tables", True, f"{sizes}; the first sandbox raises "
                     + ", ".join(t.name for t in narrow))
    return Check("shared kernel tables", True, sizes)


def host_checks() -> list[Check]:
    return [_root(), _userns(), _cgroups(), _cgroup_moves(), _bwrap(), _seccomp(), _landlock(), _workspace_watch(), _network_allow(),
            _network_open(), _shared_tables()]
