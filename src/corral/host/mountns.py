"""Where a sandbox's mounts are made: the host's mount namespace, or one of the sandbox's own.

:class:`HostMounts` mounts in this process's namespace (the host's): every
sandbox adds its mounts to the one table all of them share, and bubblewrap
copies that whole table into each new sandbox (and the kernel walks it on
unshare and pivot_root), so a create costs more with every live sandbox.

:class:`MountNamespace` makes them in a private mount namespace held by a
helper (``corral-agent --mountns``, a static binary: vfork'd) that later
becomes the sandbox's launcher: it execs bubblewrap (dropped to the sandbox's
uid) in that namespace, so the sandbox is built from a table of the host's
fixed mounts plus its own, and whatever it mounted vanishes with its last
process -- a crash of its owner leaves no mount behind, and teardown unmounts
nothing.  The host reaches the files on those mounts (the overlay's upper
layers, the workspace copy) through ``/proc/PID/root`` of the holder:
:meth:`MountNamespace.view`.
"""

from __future__ import annotations

import array
import os
import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TypeVar

from ..errors import HostNotSupported
from . import idmap, mounts
from .uids import UidRange
from .userns import map_and_open

T = TypeVar("T")


class HostMounts:
    """Mounts in the host's own namespace (the gVisor tier's; teardown unmounts them)."""

    private = False

    def view(self, path: Path) -> Path:
        """``path`` as this process reaches it (a host path: itself)."""
        return path

    def mount_tmpfs(self, target: Path, size: int, uid: int, gid: int, mode: int = 0o700) -> None:
        mounts.mount_tmpfs(target, size, uid, gid, mode)

    def mount_overlay(self, target: Path, lower: list[Path], upper: Path, work: Path) -> None:
        mounts.mount_overlay(target, lower, upper, work)

    def attach_idmapped(self, lower: Path, view: Path, userns_fd: int) -> None:
        """A read-only view of ``lower`` at ``view`` whose ids are those of ``userns_fd``."""
        tree = idmap.idmapped_tree(lower, userns_fd)
        try:
            idmap.attach(tree, view)
        finally:
            os.close(tree)

    def umount(self, target: Path, lazy: bool = False) -> None:
        mounts.umount(target, lazy)

    def mapped_overlay(self, target: Path, lower: Path, upper: Path, work: Path, userns_fd: int, view: Path) -> None:
        """The overlay at ``target`` on an idmapped view of ``lower`` (:meth:`attach_idmapped` at
        ``view``, an empty directory, detached once the overlay holds its own clone of it).
        Raises the first step's error: that of the view itself if it cannot be made."""
        self.attach_idmapped(lower, view, userns_fd)
        try:
            self.mount_overlay(target, [view], upper, work)
        finally:
            self.umount(view, lazy=True)


class MountNamespace(HostMounts):
    """A sandbox's own mount namespace, held by its future launcher (see the module's docstring).

    One owner: the sandbox, which either :meth:`exec`\\ s it into its launcher (the process then
    is the sandbox's, and so is the namespace) or :meth:`close`\\ s it (the helper exits)."""

    private = True

    def __init__(self, helper: Path, stdin: int | IO[bytes] | None, stdout: int | IO[bytes] | None,
                 run: Callable[[Callable[[], subprocess.Popen[bytes]]], subprocess.Popen[bytes]] = lambda f: f(),
                 userns: UidRange | None = None) -> None:
        """Start the helper (``run`` calls the Popen: e.g. on the thread that must be its parent);
        ``stdin``/``stdout`` become the launched program's.  With ``userns``, the helper also
        starts making the user namespace of that range at once (:meth:`userns`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        extra = [str(userns.base)] if userns is not None else []
        self._ids = userns
        try:
            self.proc = run(lambda: subprocess.Popen(
                [str(helper), "--mountns", str(theirs.fileno()), *extra], stdin=stdin, stdout=stdout,
                stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), close_fds=True, cwd="/", env={},
            ))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock: socket.socket | None = ours
        self.exec_done = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def view(self, path: Path) -> Path:
        """``path`` in the namespace, reached from the host (``/proc/PID/root``): valid while the
        holder (or, after :meth:`exec`, the program it became) lives."""
        return Path(f"/proc/{self.proc.pid}/root") / path.relative_to("/")

    def _send(self, op: str, args: Sequence[str], fds: Sequence[int] = ()) -> socket.socket:
        if self._sock is None:
            raise OSError(9, "the sandbox's mount namespace is closed")
        payload = op.encode() + b"\0".join(a.encode() for a in args)
        if fds:
            self._sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            self._sock.send(payload)
        return self._sock

    def _ask(self, op: str, args: Sequence[str], fds: Sequence[int] = ()) -> bytes:
        return self._send(op, args, fds).recv(4096)

    @staticmethod
    def _error(reply: bytes) -> OSError | None:
        if not reply:
            return OSError(5, "the sandbox's mount namespace helper died")
        err = int.from_bytes(reply[:4], "little", signed=True)
        return OSError(err, reply[4:].decode(errors="replace")) if err else None

    def _check(self, op: str, args: Sequence[str], fds: Sequence[int] = ()) -> None:
        error = self._error(self._ask(op, args, fds))
        if error is not None:
            raise error

    def _raise_first(self, sock: socket.socket, replies: int) -> None:
        """Read the answers to ``replies`` requests sent in a row; raise the first error."""
        errors = [self._error(sock.recv(4096)) for _ in range(replies)]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error

    def _mount(self, source: str, target: Path, fstype: str, flags: int, options: str) -> None:
        self._check("m", [source, str(target), fstype, str(flags), options])

    def mount_tmpfs(self, target: Path, size: int, uid: int, gid: int, mode: int = 0o700) -> None:
        fstype, flags, options = mounts.tmpfs_args(size, uid, gid, mode)
        self._mount("corral", target, fstype, flags, options)

    def mount_overlay(self, target: Path, lower: list[Path], upper: Path, work: Path) -> None:
        fstype, flags, options = mounts.overlay_args(lower, upper, work)
        self._mount("overlay", target, fstype, flags, options)

    def mount_device_nodes(self, target: Path) -> None:
        """A tmpfs at ``target`` to hold device nodes (:func:`.mounts.device_nodes_args`)."""
        fstype, flags, options = mounts.device_nodes_args()
        self._mount("corral-dev", target, fstype, flags, options)

    def sandbox_dev(self, nodes: Path, max_ptys: int, shm: Path) -> None:
        """Finish ``nodes`` (a tmpfs of :meth:`mount_device_nodes`, populated) as a sandbox's whole
        ``/dev``: a ``devpts`` of its own at ``pts`` (:func:`.mounts.devpts_args`), ``shm`` bound
        at ``shm``, and the tmpfs read-only (its submounts stay writable).  One round trip."""
        pts_type, pts_flags, pts_options = mounts.devpts_args(max_ptys)
        sock = self._send("m", ["devpts", str(nodes / "pts"), pts_type, str(pts_flags), pts_options])
        self._send("M", [str(shm), str(nodes / "shm"), "", str(mounts.MS_BIND), ""])
        self._send("M", ["", str(nodes), "", str(mounts.MS_REMOUNT | mounts.MS_BIND | mounts.MS_RDONLY
                                                   | mounts.MS_NOSUID | mounts.MS_NOEXEC), ""])
        self._raise_first(sock, 3)

    def bind_all(self, binds: Sequence[tuple[Path, Path, bool]]) -> None:
        """Bind each (source, target, read-only) in order, ``nosuid``/``nodev``, in one round trip;
        after a failure the rest are not made."""
        sock = None
        for at, (source, target, read_only) in enumerate(binds):
            sock = self._send("M" if at else "m", [str(source), str(target), "", str(mounts.MS_BIND), ""])
            # a bind takes its source's flags: these are set by a remount of the bind
            flags = mounts.MS_REMOUNT | mounts.MS_BIND | mounts.MS_NOSUID | mounts.MS_NODEV
            self._send("M", ["", str(target), "", str(flags | (mounts.MS_RDONLY if read_only else 0)), ""])
        if sock is not None:
            self._raise_first(sock, 2 * len(binds))

    def attach_idmapped(self, lower: Path, view: Path, userns_fd: int) -> None:
        self._check("i", [str(lower), str(view)], [userns_fd])

    def umount(self, target: Path, lazy: bool = False) -> None:
        self._check("u", [str(target), str(mounts.MNT_DETACH if lazy else 0)])

    def mapped_overlay(self, target: Path, lower: Path, upper: Path, work: Path, userns_fd: int, view: Path,
                       extra: str = "", expect: Callable[[os.stat_result], None] | None = None) -> None:
        """As :meth:`HostMounts.mapped_overlay`, with ``extra`` overlay options (``a=b,c=d``);
        ``expect`` checks the view before the overlay is made of it (see :meth:`_mapped`)."""
        fstype, flags, options = mounts.overlay_args([view], upper, work)
        self._mapped(target, lower, userns_fd, view, fstype, flags, options + ("," + extra if extra else ""), expect)

    def mapped_read_only(self, target: Path, lower: Path, empty: Path, userns_fd: int, view: Path,
                         extra: str = "", expect: Callable[[os.stat_result], None] | None = None) -> None:
        """A read-only overlay at ``target`` of an idmapped view of ``lower`` (at ``view`` while it
        is made) over ``empty``, an empty directory that stays as long as the overlay: what the
        sandbox sees are the overlay's own inodes, not ``lower``'s (a Unix socket there cannot
        be connected to, as in an overlay with an upper layer)."""
        fstype, flags, options = mounts.read_only_overlay_args([view, empty])
        self._mapped(target, lower, userns_fd, view, fstype, flags, options + ("," + extra if extra else ""), expect)

    def _mapped(self, target: Path, lower: Path, userns_fd: int, view: Path, fstype: str, flags: int,
                options: str, expect: Callable[[os.stat_result], None] | None = None) -> None:
        """The view of ``lower`` at ``view``, the overlay of it at ``target``, the view detached.
        With ``expect``, the view is made first and ``expect(its stat)`` raises if it is not of
        the directory the caller means: ``lower`` is resolved by the helper, by its path, and
        the path may have changed since the caller looked (then nothing is mounted)."""
        if expect is not None:
            self._check("i", [str(lower), str(view)], [userns_fd])
            try:
                expect(os.stat(self.view(view)))
            except BaseException:
                self.umount(view, lazy=True)
                raise
            sock = self._send("m", ["overlay", str(target), fstype, str(flags), options])
            self._send("u", [str(view), str(mounts.MNT_DETACH)])
            self._raise_first(sock, 2)
            return
        # one round trip for the three steps: the overlay ('M') only if the view was made
        self._send("i", [str(lower), str(view)], [userns_fd])
        sock = self._send("M", ["overlay", str(target), fstype, str(flags), options])
        self._send("u", [str(view), str(mounts.MNT_DETACH)])
        attached, mounted, _detached = (self._error(sock.recv(4096)) for _ in range(3))
        error = attached or mounted
        if error is not None:
            raise error

    def userns(self) -> HolderUserns:
        """The user namespace the helper started making (``userns=`` given), as
        :class:`corral.host.userns.PendingUserns` would give it: its maker is a child of the
        helper, not a process of this one's."""
        assert self._ids is not None, "MountNamespace(..., userns=ids) first"
        return HolderUserns(self, self._ids)

    def exec(self, uid: int, argv: Sequence[str], fds: Sequence[int] = (), netns: int | None = None) -> subprocess.Popen[bytes]:
        """Turn the holder into ``argv`` run as host ``uid`` (in the network namespace ``netns``,
        if given), with ``fds`` at 3, 4, ... in order; its Popen (the same process) is returned.
        The namespace then lives as long as that program (and what it starts in it)."""
        passed = ([netns] if netns is not None else []) + list(fds)
        reply = self._ask("x", [str(uid), "1" if netns is not None else "0", *argv], passed)
        if reply:
            err = int.from_bytes(reply[:4], "little", signed=True)
            raise OSError(err, reply[4:].decode(errors="replace"))
        self.exec_done = True  # end of file: the exec closed the helper's end
        self._close_socket()
        return self.proc

    def _close_socket(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Release the helper if it never became the launcher (it exits on end of file), with
        everything mounted in its namespace; after :meth:`exec` the program is the caller's."""
        self._close_socket()
        if not self.exec_done:
            self.proc.wait()


class HolderUserns:
    """The sandbox's user namespace made by its mount namespace's helper (:meth:`MountNamespace.userns`)."""

    def __init__(self, holder: MountNamespace, ids: UidRange) -> None:
        self._holder = holder
        self.ids = ids

    def finish(self, maps: tuple[str, str] | None = None) -> int:
        """A descriptor (O_CLOEXEC) of the namespace, mapped (as :meth:`PendingUserns.finish`):
        the caller closes it."""
        reply = self._holder._ask("n", [])
        error = self._holder._error(reply)
        if error is not None:
            raise HostNotSupported(f"cannot make the sandbox's user namespace: {error.strerror}")
        try:
            return map_and_open(int(reply[4:]), self.ids, maps)
        finally:
            self._holder._send("N", [])  # no answer: its maker exits, the descriptor holds the namespace

    def close(self) -> None:
        """Nothing of this process's: the helper reaps the maker (at 'N', its exec or its end)."""
