"""gVisor's side of ``network="open"``: runsc's netstack on the veth of the sandbox's namespace.

The namespace, veth pair, NAT and nftables policy are the process tier's
(:class:`corral.egress.open_net.OpenNetwork`, made by :class:`SandboxNetwork`).
runsc is given that namespace's path in the OCI config and ``--network
sandbox``: it joins the namespace, opens an AF_PACKET socket on the veth, moves
the veth's addresses and routes into gVisor's netstack and hands the socket to
the Sentry.  Every packet the sandbox sends therefore leaves through the veth
and meets our table on the host side, exactly as in the process tier.  Not
``--network host``: that would pass the sandbox's socket syscalls to the host
kernel (hostinet), the one part of the host's attack surface gVisor exists to
take away.

The obstacle: before taking the veth, runsc (20240729, the one installable
here) refuses to run "in the root network namespace", which it recognises
by ``/proc/sys/net/core/rmem_default`` existing (``isRootNS`` in
``runsc/sandbox/network.go``).  On this kernel (6.18) ``rmem_default`` is a
per-namespace sysctl: the file exists in *every* namespace (measured), so runsc
refuses ours.  When that misfire is detected (the file exists inside
the sandbox's own namespace, which is never the root one), runsc is started in
a private mount namespace where an empty read-only tmpfs covers
``/proc/sys/net/core`` *as seen from the sandbox's network namespace*.
``/proc/sys/net`` shows the namespace of whoever looks: the tmpfs is mounted
from inside the sandbox's namespace, so it covers that namespace's directory
and nothing else — the host's own ``/proc/sys/net/core`` stays visible even to
runsc, and nothing at all changes outside runsc's mount namespace (``/`` is
made a slave first, so the mount cannot propagate back to the host).  In
``runsc/sandbox/network.go`` ``isRootNS`` is the only reader of that directory, and the
Sentry mounts a fresh ``/proc`` in its chroot (docs/gvisor.md: what was checked).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path

from ...host import mounts, netns

#: what this runsc looks at to decide "root network namespace"
ROOT_TEST = Path("/proc/sys/net/core/rmem_default")
CLONE_NEWNS = 0x00020000
MS_RDONLY = 0x1
MS_NOEXEC = 0x8
MS_REC = 0x4000
MS_SLAVE = 0x80000


def runsc_args(netns_name: str | None) -> list[str]:
    """runsc's network flag: its own netstack on our namespace's veth, or loopback only."""
    return ["--network", "sandbox" if netns_name else "none"]


def oci_namespace(netns_name: str | None) -> dict[str, str]:
    """The OCI config's network namespace: ours by path, or a new empty one."""
    if netns_name:
        return {"type": "network", "path": str(netns.NETNS_DIR / netns_name)}
    return {"type": "network"}


_misfires: dict[str, bool] = {}


def root_test_misfires(netns_name: str) -> bool:
    """Whether runsc would take the sandbox's namespace (never the root one) for the root one.

    Asked once per process: the answer is the kernel's, the same for every
    namespace.  The first ``open`` sandbox pays one thread and a setns."""
    if "answer" not in _misfires:
        _misfires["answer"] = netns.in_netns(netns_name, ROOT_TEST.exists)
    return _misfires["answer"]


class HideRootTest:
    """A ``preexec_fn`` for runsc: a private mount namespace where ``ROOT_TEST`` is absent
    in the sandbox's network namespace.

    Everything is looked up and opened here, in the parent: between fork and exec
    only the prepared libc calls run (the parent has threads; the child must not
    need the import machinery or a lock they might hold).  :meth:`close` after
    the launch."""

    def __init__(self, netns_name: str) -> None:
        libc = mounts.libc()
        self._unshare, self._mount, self._setns = libc.unshare, libc.mount, libc.setns
        self._target = str(ROOT_TEST.parent).encode()
        self._sandbox_ns = os.open(netns.NETNS_DIR / netns_name, os.O_RDONLY | os.O_CLOEXEC)
        # to go back afterwards (the forking thread's): runsc itself stays where it is in the other modes
        self._own_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    def __call__(self) -> None:
        steps: list[tuple[str, Callable[[], int]]] = [
            ("unshare(CLONE_NEWNS)", lambda: self._unshare(CLONE_NEWNS)),
            # a slave of the host's mounts: what is mounted below never propagates back
            ("make / a slave", lambda: self._mount(None, b"/", None, MS_REC | MS_SLAVE, None)),
            ("enter the sandbox's network namespace", lambda: self._setns(self._sandbox_ns, netns.CLONE_NEWNET)),
            ("cover /proc/sys/net/core", lambda: self._mount(
                b"corral-hide", self._target, b"tmpfs", MS_RDONLY | mounts.MS_NOSUID | mounts.MS_NODEV | MS_NOEXEC,
                b"size=4k,nr_inodes=1,mode=555")),
            ("return to the host's network namespace", lambda: self._setns(self._own_ns, netns.CLONE_NEWNET)),
        ]
        for what, call in steps:
            if call() != 0:
                raise OSError(ctypes.get_errno(), f"runsc launcher: {what}: {os.strerror(ctypes.get_errno())}")

    def close(self) -> None:
        for fd in (self._sandbox_ns, self._own_ns):
            os.close(fd)
