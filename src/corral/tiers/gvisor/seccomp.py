"""The seccomp policy inside a gVisor sandbox: the process tier's, as an OCI ``linux.seccomp``.

runsc loads it into gVisor's own kernel (``--oci-seccomp``) on the agent, the container's
first process, before it runs; every command inherits it.  Without it a command as uid 1000
could ``unshare -U -r`` and then held, in its new user namespace, ``CAP_NET_ADMIN`` and
``CAP_NET_RAW`` that gVisor honoured over the sandbox's *own* network namespace: it changed
the MTU of the sandbox's loopback for good, added addresses to it, opened ``AF_PACKET`` and
bound port 80.  The process tier refuses namespaces with its filter; this is the same refusal.

What runsc 0.0~20240729 can express (``runsc/specutils/seccomp``): the actions KILL, TRAP,
ERRNO, TRACE and ALLOW, and all seven argument comparisons (MASKED_EQ included, ``value``
the mask and ``valueTwo`` the datum, as in libseccomp).  ``SCMP_ACT_ERRNO`` always returns
EPERM there (``errnoRet`` is read by later releases only), so the ENOSYS that ``clone3`` must
answer is ``SCMP_ACT_TRACE``: gVisor answers ENOSYS to it when no tracer asked for seccomp
stops (``pkg/sentry/kernel/seccomp.go``), and none ever can, ``ptrace`` being denied.

Taken from :mod:`corral.host.seccomp`: every denied syscall (EPERM) but ``syslog``, the
namespace flags of ``clone`` (EPERM), ``clone3`` (ENOSYS: its flags are in memory no filter
reads, and glibc falls back to ``clone`` only on ENOSYS) and TIOCSTI/TIOCLINUX (EPERM).  Left
out, each because the reason for it is the host kernel's: ``syslog`` (gVisor's log is its own
boot banner, not the host's ring buffer), the ENOSYS list (native AIO's table is the Sentry's,
in the sandbox's own memory; gVisor has no ``memfd_secret``) and the socket families (gVisor
has none of the refused ones: it answers EAFNOSUPPORT itself, where this filter could only
say EPERM; raw and packet sockets need ``CAP_NET_RAW``, which nothing holds once namespaces
are refused).
"""

from __future__ import annotations

from typing import Any

from ...host.seccomp import CLONE_NAMESPACE_FLAGS, DENIED_SYSCALLS, TIOCLINUX, TIOCSTI

#: denied in the process tier for the host kernel's sake, answered by gVisor's own kernel here
ANSWERED_BY_GVISOR = frozenset({"syslog"})


def _masked(index: int, mask: int, value: int) -> dict[str, Any]:
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def oci_seccomp() -> dict[str, Any]:
    """The ``linux.seccomp`` section of a gVisor sandbox's OCI config."""
    denied = [name for name in DENIED_SYSCALLS if name not in ANSWERED_BY_GVISOR]
    # one rule per flag and per request: runsc ORs conditions on the same argument only when
    # a rule has several (runc's legacy), so each stands alone, unambiguous
    clone = [{"names": ["clone"], "action": "SCMP_ACT_ERRNO", "args": [_masked(0, flag, flag)]}
             for flag in sorted(CLONE_NAMESPACE_FLAGS.values())]
    ioctl = [{"names": ["ioctl"], "action": "SCMP_ACT_ERRNO", "args": [_masked(1, 0xFFFFFFFF, request)]}
             for request in (TIOCSTI, TIOCLINUX)]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [
            {"names": denied, "action": "SCMP_ACT_ERRNO"},
            *clone,
            # ENOSYS (see above): libc then makes threads and processes with clone(2)
            {"names": ["clone3"], "action": "SCMP_ACT_TRACE"},
            *ioctl,
        ],
    }
