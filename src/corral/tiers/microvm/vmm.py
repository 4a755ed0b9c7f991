"""Where QEMU runs on the host: root of the sandbox's own user namespace, holding only the file
capabilities the workspace's 9p export needs, given its files as descriptors.

The namespace maps the sandbox's 65,536 host ids (``host.uids``) to 0-65535, as the process
tier's does: QEMU is its uid 0 (the range's base on the host).  The workspace export is
``security_model=passthrough``: a file the guest's uid N creates belongs to host uid ``base + N``,
the guest's ``chown`` is a real one within the range, and the guest sees the owners it set.
Over anything outside the range (host root's files, other sandboxes', the host's namespaces)
QEMU's capabilities count for nothing: it is an unprivileged process there.

``corral-agent --vmm`` (the static agent binary, ``agent/users.c``) makes the switch between the
shell that joins the host cgroup and QEMU: keep the given supplementary groups, enter the
namespace, become its root, take an empty network namespace of its own, cut the bounding set to
``VMM_CAPS``, set ``no_new_privs``, load the sandboxes' seccomp filter (on top of QEMU's own
``-sandbox``), exec.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import HostNotSupported
from ...host import idmap

#: QEMU's capabilities, over the sandbox's user namespace only: to create files as the guest's
#: users, chown and chmod them (CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID).  Not
#: CAP_MKNOD (device nodes need the host's; a FIFO needs none), never CAP_SYS_ADMIN or CAP_SETUID
VMM_CAPS = (1 << 0) | (1 << 1) | (1 << 3) | (1 << 4)


def fd_path(fd: int) -> Path:
    """A descriptor as a path QEMU can open (``/proc/self/fd/N``: no directory on the way is searched)."""
    return Path(f"/proc/self/fd/{fd}")


def kvm_groups(accel: str) -> str:
    """The supplementary groups QEMU keeps (``--vmm``'s GROUPS): under KVM, /dev/kvm's group
    where the device is not open to everyone (QEMU opens it by path); none otherwise."""
    if accel != "kvm":
        return "-"
    try:
        st = os.stat("/dev/kvm")
    except OSError:
        return "-"
    return "-" if st.st_mode & 0o006 == 0o006 or st.st_gid == 0 else str(st.st_gid)


#: sh -c SCRIPT corral-vmm PROCS_FILE... -- QEMU ARGS...: join the cgroups, become QEMU
_JOIN_AND_EXEC = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def joining(procs_files: list[str], argv: list[str]) -> list[str]:
    """``argv`` run by a shell that first joins the cgroups whose ``cgroup.procs`` files are given.
    QEMU must start inside the sandbox's host cgroup: the shell joins it and execs (same pid), so
    Python can vfork, where a ``preexec_fn`` would fork the whole (large, threaded) Python
    process, 10-20 ms per sandbox."""
    return ["/bin/sh", "-c", _JOIN_AND_EXEC, "corral-vmm", *procs_files, "--", *argv]


def launcher(agent: Path, userns: int, accel: str, seccomp: Path, die_with_parent: bool = False) -> list[str]:
    """The command line that enters the namespace ``userns`` (inherited) and execs what follows
    under the sandboxes' seccomp filter (``seccomp``: its BPF program, ``host/seccomp.py``), on
    top of QEMU's own ``-sandbox`` filter, which refuses no socket family: vsock ignores network
    namespaces, so only a filter keeps a QEMU a guest took over from the hypervisor of a VM host;
    ``die_with_parent``: killed when its parent ends (for a QEMU in no sandbox's cgroup)."""
    return [str(agent), "--vmm", str(userns), f"{VMM_CAPS:x}", kvm_groups(accel), "--seccomp", str(seccomp),
            *(["--die-with-parent"] if die_with_parent else []), "--"]


def open_files(*, ram: Path | None, disk: Path, workspace: Path, console: Path, userns: int, owner: int) -> dict[str, int]:
    """What QEMU would open by path, opened here as descriptors it inherits (each key's path is
    ``fd_path`` of its value; the caller closes them once QEMU runs).

    As root of the sandbox's namespace QEMU may not reach them by their paths (a 0700 run or
    state directory of host root's on the way).  The template's RAM file is host root's and
    shared by every VM of the template; QEMU 7.2 opens it read-write (and maps it privately),
    as it did as host root before: an idmapped mount of that one file (and nothing else of the
    template) shows it as the namespace root's.  The console log is made here for ``owner``."""
    files: dict[str, int] = {}
    try:
        if ram is not None:  # (None: QEMU's own anonymous RAM, a fork's)
            try:
                files["ram"] = idmap.idmapped_tree(ram, userns, read_only=False)
            except OSError as exc:
                raise HostNotSupported(f"the microvm tier needs idmapped mounts where its templates are "
                                       f"({ram.parent}): {exc}") from None
        files["disk"] = os.open(disk, os.O_PATH | os.O_CLOEXEC)
        files["ws"] = os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        files["console"] = os.open(console, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.fchown(files["console"], owner, owner)
    except BaseException:
        for fd in files.values():
            os.close(fd)
        raise
    return files


def idmap_unsupported(directory: Path, state_dir: Path) -> str | None:
    """Why QEMU's RAM file could not be handed to it here (an idmapped mount in ``directory``,
    for a throwaway user namespace of a range reserved for the check), or None if it can."""
    from ...host.uids import allocate_range, process_owner, release_range
    from ...host.userns import make_userns
    from ..linux.agent_build import agent_binary

    owner = process_owner("microvm-probe")
    ids = allocate_range(state_dir, owner)
    try:
        userns = make_userns(agent_binary(state_dir), ids)
        try:
            os.close(idmap.idmapped_tree(directory, userns, read_only=False))
        finally:
            os.close(userns)
    except (OSError, HostNotSupported) as exc:
        return f"QEMU's guest RAM file needs an idmapped mount in {directory}, which this host refuses: {exc}"
    finally:
        release_range(state_dir, ids.base, owner=owner)
    return None
