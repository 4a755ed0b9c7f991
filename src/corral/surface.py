"""What the local and the remote sandbox share: keyword arguments made into a
spec, a command's output callbacks, and the files API's directory copies.

:mod:`corral.sandbox` and :mod:`corral.client` both build on this module, so
neither has to import the other for it.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

from .errors import InvalidSpec
from .secrets import SecretBinding
from .spec import Limits, SandboxSpec, Workspace, validate_env, validate_sandbox_path
from .tiers.base import FileEntry

#: bytes ``files.read`` returns at most unless told otherwise
DEFAULT_MAX_READ = 256 << 20


class FilesAPI(Protocol):
    """What the directory copies need of ``sandbox.files`` (local or remote)."""

    def read(self, path: str, format: Literal["bytes"], max_bytes: int = ...) -> bytes: ...

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None: ...

    def list(self, path: str = ".") -> list[FileEntry]: ...

    def make_dir(self, path: str, mode: int = 0o755) -> None: ...


def build_spec(
    spec: SandboxSpec | None = None,
    *,
    image: str | None = None,
    tier: str | None = None,
    memory: str | int | None = None,
    pids: int | None = None,
    cpus: float | None = None,
    disk: str | int | None = None,
    timeout: float | None = None,
    max_output: str | int | None = None,
    workspace: str | Path | Workspace | None = None,
    env: Mapping[str, str] | None = None,
    network: str | None = None,
    allow: Sequence[str] | None = None,
    unsafe_allow_ranges: Sequence[str] | None = None,
    secrets: Sequence[str | SecretBinding] | Mapping[str, Sequence[str]] | None = None,
    user: str | None = None,
) -> SandboxSpec:
    """A spec from keyword arguments (each overriding ``spec``'s field when given).

    ``allow`` implies ``network="allow"``; ``secrets`` is ``["NAME@host1,host2"]``
    or ``{"NAME": ["host1", "host2"]}`` (values come from ``secret_values``, the
    secrets file or the caller's environment, never from the spec)."""
    base = spec or SandboxSpec()
    limits = base.limits
    given = {"memory": memory, "pids": pids, "cpus": cpus, "disk": disk, "timeout": timeout, "max_output": max_output}
    if any(v is not None for v in given.values()):
        fresh = Limits.build(memory, pids, cpus, disk, timeout, max_output)
        limits = Limits(**{name: getattr(fresh if value is not None else limits, name) for name, value in given.items()})
    ws = base.workspace
    if isinstance(workspace, Workspace):
        ws = workspace
    elif workspace is not None:
        ws = Workspace.parse(str(workspace))
    if isinstance(secrets, Mapping):
        secrets = [SecretBinding(name, tuple(hosts)) for name, hosts in secrets.items()]
    if isinstance(allow, str) or isinstance(unsafe_allow_ranges, str) or isinstance(secrets, str):
        raise InvalidSpec("allow, unsafe_allow_ranges and secrets take lists, not a single string")
    allow_list = tuple(allow) if allow is not None else base.allow
    return SandboxSpec(
        image=image or base.image,
        tier=tier or base.tier,
        limits=limits,
        workspace=ws,
        env=validate_env(env) if env is not None else base.env,
        network=network or ("allow" if allow_list or secrets else base.network),
        cwd=base.cwd,
        allow=allow_list,
        unsafe_allow_ranges=tuple(unsafe_allow_ranges) if unsafe_allow_ranges is not None
        else base.unsafe_allow_ranges,
        secrets=tuple(b if isinstance(b, SecretBinding) else SecretBinding.parse(b) for b in secrets)
        if secrets is not None else base.secrets,
        user=user if user is not None else base.user,
    )


def output_callback(
    on_stdout: Callable[[str], None] | None,
    on_stderr: Callable[[str], None] | None,
    on_output: Callable[[str, bytes], None] | None,
) -> Callable[[str, bytes], None] | None:
    """One ``on_output(stream, chunk)`` for the three callbacks a command takes (text ones decoded
    incrementally as UTF-8), or None when none is given."""
    if on_stdout is None and on_stderr is None and on_output is None:
        return None
    import codecs

    decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}

    def callback(stream: str, chunk: bytes) -> None:
        if on_output is not None:
            on_output(stream, chunk)
        target = on_stdout if stream == "stdout" else on_stderr
        if target is not None:
            text = decoders[stream].decode(chunk)
            if text:
                target(text)

    return callback


def upload_dir(files: FilesAPI, local: str | Path, remote: str) -> int:
    """Copy a host directory into the sandbox (symlinks are skipped). Returns files copied."""
    local = Path(local)
    if not local.is_dir():
        raise InvalidSpec(f"{local} is not a directory")
    base = validate_sandbox_path(remote).rstrip("/")
    count = 0
    files.make_dir(base)
    for dirpath, dirnames, filenames in os.walk(local):
        rel = os.path.relpath(dirpath, local)
        target = base if rel == "." else f"{base}/{rel}"
        for d in dirnames:
            if not os.path.islink(os.path.join(dirpath, d)):
                files.make_dir(f"{target}/{d}")
        for name in filenames:
            src = os.path.join(dirpath, name)
            if os.path.islink(src) or not os.path.isfile(src):
                continue
            with open(src, "rb") as f:
                files.write(f"{target}/{name}", f.read(), os.stat(src).st_mode & 0o755)
            count += 1
    return count


def download_dir(files: FilesAPI, remote: str, local: str | Path, max_bytes: int) -> int:
    """Copy a sandbox directory's files into the host directory ``local`` (made if missing);
    returns files copied.  Symlinks and special files are not copied; nothing is written through a
    link or hard link already in ``local``; what write-back keeps from the host's git is not
    written (a git directory's configuration and hooks); the files hold at most ``max_bytes``
    (the sandbox's disk limit), and the tree at most as many names as that disk holds, else
    ``ResourceLimit`` (:mod:`corral.host.download`).

    The sandbox's tree is the sandbox's to change while it is walked: moving a directory one level
    down after each listing had the host list the same files at every level (30,000 host files
    from a sandbox holding 1,000; the listing of 20,000 at 60 levels took the host process from
    25 to 465 MiB in 6.5 s).  So the listing stops, and nothing is written, at more names than
    the sandbox's disk can hold at once (a name per 4 KiB) or past ``MAX_LISTED_DIR_BYTES`` of
    directory paths; a file is read only within what is left of the bytes.  Walked with a list,
    not by recursion (a tree 1,100 directories deep made this raise RecursionError)."""
    from .errors import FileError, ResourceLimit
    from .host.download import DownloadTarget

    most_names = max(1, max_bytes // NAME_COST)
    # ((directory, name), kind, size, the directory in the sandbox): a directory's two strings
    # are shared by what is in it
    tree: list[tuple[tuple[str, str], str, int, str]] = []
    pending = [(remote.rstrip("/") or "/", "")]
    dir_bytes = 0

    def refuse(why: str) -> ResourceLimit:
        return ResourceLimit(f"download of {remote}: {why}; nothing was written (is the sandbox changing it? "
                             "copy it as an archive: commands.run('tar -cf ...') and files.read)")

    while pending:
        directory, rel = pending.pop()
        for entry in files.list(directory):
            if entry.name in (".", "..") or "/" in entry.name or entry.type not in ("dir", "file"):
                continue
            if len(tree) >= most_names:
                raise refuse(f"more than {most_names:,} names, more than the sandbox's disk holds")
            kind = "d" if entry.type == "dir" else "f"
            tree.append(((rel, entry.name), kind, entry.size, directory))
            if kind == "d":
                below, inside = f"{rel}/{entry.name}" if rel else entry.name, f"{directory.rstrip('/')}/{entry.name}"
                dir_bytes += len(below) + len(inside)
                if dir_bytes > MAX_LISTED_DIR_BYTES:
                    raise refuse(f"its directories' paths are past {MAX_LISTED_DIR_BYTES >> 20} MiB in all")
                pending.append((inside, below))
    count = 0
    with DownloadTarget(Path(local), {key for key, _, _, _ in tree}, max_bytes) as target:
        for key, kind, size, directory in tree:  # (each directory before what is in it)
            if target.keeps(key, kind):
                continue
            if kind == "d":
                target.make_dir(key)
                continue
            target.check(key, size)
            try:  # no more than the budget left is read into this process either
                data = files.read(f"{directory.rstrip('/')}/{key[1]}", "bytes", target.left)
            except FileError as exc:
                if exc.errno != errno.EFBIG:
                    raise
                target.check(key, target.left + 1)
                raise
            target.write(key, data)
            count += 1
    return count


def disk_holds(spec: SandboxSpec) -> int:
    """The most a sandbox's disk holds: its disk tmpfs is held within memory on every tier but
    gVisor's (:func:`corral.host.mounts.disk_held_in_memory`), so a download's bound is that, not
    ``disk`` (sparse files of 1 GiB were written whole from a disk holding 371 MiB)."""
    from .host.mounts import disk_held_in_memory

    return spec.limits.disk if spec.tier == "gvisor" else disk_held_in_memory(spec.limits)


#: what each name of a downloaded tree counts for: a sandbox's disk holds a name per 4 KiB of it
NAME_COST = 4096
#: the most a download's directories' paths may take in all, in this process's memory
MAX_LISTED_DIR_BYTES = 64 << 20


@functools.cache
def _spec_arguments() -> frozenset[str]:
    """``build_spec``'s keyword arguments (its signature, read once: ~35 us a create)."""
    import inspect

    return frozenset(name for name in inspect.signature(build_spec).parameters if name != "spec")


def check_create_arguments(kwargs: Mapping[str, object], *also: str) -> None:
    """Refuse an unknown keyword argument to ``create`` by name (not Python's bare TypeError)."""
    known = _spec_arguments().union(also)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise InvalidSpec(f"unknown argument(s) to create: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
