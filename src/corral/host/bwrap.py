"""Whether this host can run bubblewrap sandboxes (the process tier and image builds)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import HostNotSupported


def check_host() -> str:
    """Path of bwrap, or HostNotSupported saying what to change."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise HostNotSupported("bubblewrap is not installed: apt-get install bubblewrap (or run `make install`)")
    if os.geteuid() != 0:
        raise HostNotSupported("the process tier needs root on the host (for cgroups and mounts); run as root")
    try:
        max_ns = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        max_ns = 1
    if max_ns == 0:
        raise HostNotSupported("user namespaces are disabled: sysctl -w user.max_user_namespaces=15000")
    apparmor = Path("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")
    if apparmor.exists() and apparmor.read_text().strip() == "1":
        raise HostNotSupported(
            "AppArmor restricts unprivileged user namespaces (Ubuntu 24.04+): "
            "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or add an AppArmor profile for bwrap"
        )
    return bwrap
