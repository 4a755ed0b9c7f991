"""The seccomp filter every process-tier sandbox runs under.

It is compiled once with libseccomp (PyPI ``pyseccomp``, ctypes over the
system's libseccomp2), exported as BPF to a file in the state directory and
handed to bubblewrap with ``--seccomp FD``: loading libseccomp in every child
would cost ~14 ms per sandbox.

The filter is a deny list on top of what namespaces and dropped capabilities
already forbid: each entry closes a known kernel attack surface or escape.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from pathlib import Path

from ..errors import HostNotSupported

#: syscalls refused with EPERM
DENIED_SYSCALLS: tuple[str, ...] = (
    # filesystem namespace changes
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    # namespace escapes and creation
    "unshare", "setns",
    # debugging other processes / reading their memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    # kernel attack surface
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "lookup_dcookie",
    "open_by_handle_at", "name_to_handle_at",
    "iopl", "ioperm", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "personality", "vhangup", "nfsservctl",
)

#: syscalls refused with ENOSYS, as if this kernel had none, so that programs take their
#: fallback: Linux's native asynchronous I/O draws from one host-wide table (``fs.aio-max-nr``,
#: 65,536 events: one sandbox's 16 ``io_setup`` calls took all of it, and every other
#: sandbox's failed), whose rings are not charged to the sandbox (``host/shared_tables.py``).
#: glibc's POSIX AIO (threads) is unaffected; databases fall back to their own threads.
#: ``memfd_secret`` too: its pages are taken out of the kernel's direct map (splitting its huge
#: pages for every process of the host) and locked; kernels built without it answer ENOSYS,
#: so programs already handle that answer.
UNIMPLEMENTED_SYSCALLS: tuple[str, ...] = (
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    "memfd_secret",
)

#: the socket families a sandbox may open; every other is refused with EAFNOSUPPORT, as if this
#: kernel had none (programs take their fallback).  ``AF_VSOCK`` above all: vsock is not
#: network-namespaced, so a sandbox with no network at all opened one on this host (a Firecracker
#: guest, CID 3) with a live transport to its hypervisor (CID 2), whose listeners are outside the
#: machine -- Docker's default profile refuses it for the same reason.  The others (``AF_ALG``,
#: ``AF_TIPC``, ``AF_RDS``, ``AF_CAN``...) are kernel attack surface nothing in a sandbox needs;
#: on a host that loads modules on demand, opening one loads its module.  ``AF_NETLINK`` too:
#: a netlink socket's receive queue (up to twice ``net.core.rmem_max``, 8 MiB here) is kernel
#: memory no memory cgroup is charged for, on v1 or v2, and a sandbox opens as many sockets as
#: its descriptors allow: one 64 MiB sandbox queued 940 MB of unread ``RTM_GETLINK`` replies
#: (the host's unreclaimable slab +900 MiB, its group +5 MiB), so a few could fill the host.
#: In an ``allow`` or ``open`` namespace (made by the host) it also heard the host's device
#: events (``NETLINK_KOBJECT_UEVENT``).  glibc's ``getaddrinfo`` falls back without it;
#: ``getifaddrs`` (``ip``, ``ss``, Node's ``os.networkInterfaces()``) fails: the gVisor tier,
#: whose netlink is its own kernel's, in the sandbox's memory, and the microVM keep them.
SOCKET_FAMILIES: dict[str, int] = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}

#: clone(2) flags that create namespaces; clone with any of them is refused
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}

#: ioctl requests refused: pushing input into a terminal
TIOCSTI = 0x5412
TIOCLINUX = 0x541C

_VERSION = "5"


def _fingerprint() -> str:
    text = repr((_VERSION, DENIED_SYSCALLS, UNIMPLEMENTED_SYSCALLS, sorted(CLONE_NAMESPACE_FLAGS.items()),
                 sorted(SOCKET_FAMILIES.items()), TIOCSTI, TIOCLINUX))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_filter() -> object:
    """Build the libseccomp filter object (not yet loaded anywhere)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # OSError: libseccomp.so missing
        raise HostNotSupported(
            f"libseccomp is not usable ({exc}); install libseccomp2 and the pyseccomp package"
        ) from exc
    deny = sc.ERRNO(errno.EPERM)
    filt = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            filt.add_rule(deny, name)
        except (ValueError, RuntimeError, OSError):
            continue  # syscall unknown on this architecture
    for name in UNIMPLEMENTED_SYSCALLS:
        try:
            filt.add_rule(sc.ERRNO(errno.ENOSYS), name)
        except (ValueError, RuntimeError, OSError):
            continue
    # the family is an int the kernel takes from the register's low 32 bits: anything above the
    # highest allowed (high bits set included) is refused whole, the small ones one by one
    no_family = sc.ERRNO(errno.EAFNOSUPPORT)
    highest = max(SOCKET_FAMILIES.values())
    filt.add_rule(no_family, "socket", sc.Arg(0, sc.GT, highest))
    for family in sorted(set(range(highest)) - set(SOCKET_FAMILIES.values())):
        filt.add_rule(no_family, "socket", sc.Arg(0, sc.EQ, family))
    # socketpair(2) reaches a family's own create code too (a TIPC pair, its module loaded on
    # demand): only AF_UNIX has pairs
    filt.add_rule(no_family, "socketpair", sc.Arg(0, sc.NE, SOCKET_FAMILIES["AF_UNIX"]))
    for flag in CLONE_NAMESPACE_FLAGS.values():
        filt.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory seccomp cannot read: refuse it with
    # ENOSYS so libc falls back to clone(2), whose flags we can check
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for request in (TIOCSTI, TIOCLINUX):
        filt.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    return filt


def bpf_path(state_dir: Path) -> Path:
    """Path of the exported BPF program, compiling it on first use."""
    path = state_dir / f"seccomp-{_fingerprint()}.bpf"
    if path.exists():
        return path
    filt = build_filter()
    fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=".seccomp-")
    try:
        with os.fdopen(fd, "wb") as f:
            filt.export_bpf(f)  # type: ignore[attr-defined]
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
