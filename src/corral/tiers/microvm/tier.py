"""The microVM tier: each sandbox is a QEMU ``microvm`` guest with its own kernel,
restored from a template snapshot.

Layers: this tier (what the host can run, the guest's assets and accelerator) -> a sandbox
(``sandbox.py``: one VM and what it owns) -> its template (``template.py``) -> QEMU
(``qemu.py``, ``vmm.py``) -> the guest (``guest.py``, ``guestinit.c``).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

from ...errors import HostNotSupported
from ...host import cgroups
from ...host.seccomp import bpf_path
from ...spec import NETWORK_MODES, MiB, SandboxSpec
from ..base import Availability, Capabilities, Tier, TierSandbox
from ..linux.rootfs import reap_host_side
from . import converter, guest, livefork, qemu, template, vmm
from .sandbox import MicroVMSandbox

#: guest RAM on top of the sandbox's memory limit: kernel, agent, page cache
GUEST_OVERHEAD_MB = 96


def _check_host() -> None:
    qemu.qemu_binary()
    if os.geteuid() != 0:
        raise HostNotSupported("the microvm tier needs root on the host (cgroups, tmpfs mounts); run as root")
    cgroups.detect()


class MicroVMTier(Tier):
    name = "microvm"
    capabilities = Capabilities(
        network_modes=NETWORK_MODES, pty=True, images=None,
        users="uid 1000 with no capability by default; user='root' is root of its own guest kernel",
        guarantees=(
            "its own guest kernel: the host kernel sees only QEMU",
            "QEMU runs as root of the sandbox's own uid range (4 file capabilities there, none on the host), "
            "under the sandbox's host cgroups",
            "nothing survives the sandbox or its owner",
        ),
        pause=True,
        snapshot="live",
        root=True,
    )

    #: forks migrated straight into (each holds its own copy of the memory); more go through a
    #: stored snapshot whose memory image they share copy-on-write (livefork.py)
    direct_forks = 2

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        _check_host()
        #: the sandboxes' seccomp filter, which QEMU runs under too (vmm.launcher)
        self.seccomp = bpf_path(state_dir)
        self._layout = cgroups.detect()
        self._guest: tuple[guest.GuestAssets, str] | None = None
        self._guest_lock = threading.Lock()

    def _resolve_guest(self) -> tuple[guest.GuestAssets, str]:
        # lazily: the janitor's reap() must work even where the guest cannot be built
        with self._guest_lock:
            if self._guest is None:
                assets = guest.assets()
                kvm_ok, _ = template.probe_kvm(assets)
                self._guest = (assets, "kvm" if kvm_ok else "tcg")
            return self._guest

    @property
    def assets(self) -> guest.GuestAssets:
        return self._resolve_guest()[0]

    @property
    def accel(self) -> str:
        return self._resolve_guest()[1]

    @classmethod
    def probe(cls, state_dir: Path) -> Availability:
        try:
            _check_host()
        except HostNotSupported as exc:
            return Availability(cls.name, False, str(exc), "see the message")
        if shutil.which("mkfs.erofs") is None:
            return Availability(cls.name, False, "mkfs.erofs is missing (it writes each image's read-only disk)",
                                "apt-get install erofs-utils (or `make install`)")
        unsupported = vmm.idmap_unsupported(guest.cache_dir(), state_dir)
        if unsupported is not None:
            return Availability(cls.name, False, unsupported, "keep the microVM cache (CORRAL_MICROVM_CACHE) on"
                                " ext4, xfs, btrfs or tmpfs (Linux 6.3+), on Linux 5.12 or later")
        built = guest.cached_assets()
        if built is None:
            if shutil.which("apt-get") is None:
                return Availability(cls.name, False, "no guest kernel cached and no apt-get to fetch one",
                                    "run `make install` on a Debian host")
            return Availability(cls.name, True, "guest kernel not built yet: fetched with apt-get on first use",
                                details={"accelerator": "decided on first use"})
        kvm_ok, reason = template.probe_kvm(built)
        accel = "KVM" if kvm_ok else "TCG (software emulation)"
        return Availability(cls.name, True, f"QEMU microvm, {accel}: {reason}",
                            details={"accelerator": "kvm" if kvm_ok else "tcg", "kernel": built.kernel_release,
                                     "qemu": qemu.qemu_version()})

    def create(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path) -> TierSandbox:
        return MicroVMSandbox(self, spec, sandbox_id, run_dir)

    def create_from_snapshot(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path, snapshot: Path,
                             digest: str) -> TierSandbox:
        """A VM restored from a live snapshot (live.py): its processes and memory, a fresh identity."""
        return MicroVMSandbox(self, spec, sandbox_id, run_dir, seed=(snapshot, digest))

    def fork_live(self, parent: TierSandbox, spec: SandboxSpec,
                  children: list[tuple[str, Path]]) -> list[TierSandbox]:
        """Forks of a running VM straight from its migration stream (livefork.py): no snapshot."""
        assert isinstance(parent, MicroVMSandbox)
        return list(livefork.fork(self, parent, spec, children))

    def reap(self, sandbox_id: str, run_dir: Path, record: dict[str, Any]) -> None:
        # QEMU lives in the sandbox's host cgroup (killing it closes the tap too)
        reap_host_side(self.state_dir, sandbox_id, run_dir, record)
        # a snapshot's converter, if its owner died taking it: by name (one not yet in its group)
        # and its group, below the parent the owner made it under
        converter.kill_converters(sandbox_id)
        cgroups.reap(converter.group_name(sandbox_id), record.get("cgroup_parent"))

    def ram_mb(self, memory: int) -> int:
        """Guest RAM for a memory limit, rounded up to 64 MiB so templates are few."""
        mb = -(-memory // MiB) + GUEST_OVERHEAD_MB
        return -(-mb // 64) * 64
