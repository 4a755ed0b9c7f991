"""What write-back leaves as the host has it so that the host's git runs nothing the sandbox wrote.

Git runs what a git directory's files say at a mere ``git status`` (``core.fsmonitor``,
``core.pager``, aliases, hooks), and reads its configuration from elsewhere when told to
(``commondir``, a ``.git`` file): a sandbox that set ``core.fsmonitor`` ran its program on the
host, as the workspace's owner (root, often).  Codex and sandbox-runtime refuse these too.
:func:`host_keeps` judges a path by itself (a ``.git`` directory's own files);
:func:`makes_a_git_directory` looks at the entry's neighbours, because a git directory needs no
``.git`` in its name.  The walk and the copy are :mod:`.workspace`'s.
"""

from __future__ import annotations

import os
from collections.abc import Container, Iterable

#: files of a git directory that make the host's git run a program or read its configuration
#: from elsewhere
GIT_RUNS = frozenset({"config", "config.worktree", "commondir", "gitdir"})
#: a git directory's operations in progress: their to-do lists hold ``exec`` lines the host's git
#: runs at ``git rebase --continue`` (which ``git status`` suggests), as the workspace's owner
GIT_SEQUENCES = frozenset({"rebase-merge", "rebase-apply", "sequencer"})
#: where a git directory's objects may also be read from: another repository on the host, whose
#: objects a later ``git gc`` copies into this one (and so into the next sandbox's reach)
GIT_ALTERNATES = frozenset({"alternates", "http-alternates"})
#: directories of a git directory whose files git runs or follows: its hooks and its operations in
#: progress (a separate git directory, ``git init --separate-git-dir``, is no ``.git``: its
#: ``rebase-merge/`` came back and the owner's ``git rebase --continue`` ran the sandbox's line)
_NEAR_GIT_NAMES = frozenset({"hooks", *GIT_SEQUENCES})
#: what makes a directory a git directory at git's discovery (``is_git_directory``: a ``HEAD``
#: there, and ``objects/`` and ``refs/`` there or in its ``commondir``), whatever its name
HEAD = "HEAD"


class HeldPaths:
    """Workspace-relative paths write-back leaves as the host has them, with every directory on
    the way to one (:class:`.git_reach.GitReach`): a path's check looks up its own prefixes, not
    every held path (a configuration names dozens; a write-back looks at thousands of entries)."""

    def __init__(self, paths: Iterable[str]) -> None:
        self.paths = frozenset(paths)
        self.ancestors = frozenset(path[:i] for path in self.paths for i, c in enumerate(path) if c == "/")

    def __bool__(self) -> bool:
        return bool(self.paths)

    def covers(self, rel: str) -> bool:
        """``rel`` is held, lies below a held path, or is a directory on the way to one."""
        if rel in self.paths or rel in self.ancestors:
            return True
        at = rel.find("/")
        while at >= 0:
            if rel[:at] in self.paths:
                return True
            at = rel.find("/", at + 1)
        return False


def host_keeps(rel: str, kind: str, configured: HeldPaths | None = None) -> bool:
    """True for what write-back leaves as the host has it: a git directory's configuration and
    hooks (``.git/config``, ``.git/hooks/...``, a submodule's or worktree's, ``commondir``,
    ``gitdir``), its operations in progress (``rebase-merge/``, ``rebase-apply/``, ``sequencer/``),
    its ``objects/info/alternates``, a ``.git`` that is not a directory (a ``gitdir: PATH`` file),
    and what the host's git configuration names in the workspace (``configured``, relative
    paths: :class:`HeldPaths`) and every directory on the way to it (neither removed nor made a link
    elsewhere; what else the sandbox puts in it is written back)."""
    if configured and configured.covers(rel):
        return True
    parts = rel.split("/")
    for i, part in enumerate(parts):
        if part != ".git":
            continue
        rest = parts[i + 1:]
        if not rest:
            if kind not in ("d", "D"):
                return True
            continue
        if "hooks" in rest:
            return True
        nested = rest[0] in ("modules", "worktrees")  # a submodule's or a worktree's own git directory
        if rest[-1] in GIT_RUNS and (len(rest) == 1 or nested):
            return True
        if rest[0] in GIT_SEQUENCES or (nested and GIT_SEQUENCES.intersection(rest[2:])):
            return True
        if rest[-1] in GIT_ALTERNATES and rest[-3:-1] == ["objects", "info"] and (len(rest) == 3 or nested):
            return True
    return False


def _git_dir_of(key: tuple[str, str], kind: str) -> tuple[str, bool] | None:
    """If ``key`` (directory, name) is a file git reads from the directory it lies in when that
    directory is a git directory (its configuration, ``commondir``, a hook) or that directory's
    ``HEAD``: the directory, and whether ``key`` is the ``HEAD``."""
    dir_path, name = key
    if name == HEAD and kind != "d":
        return dir_path, True
    if name in GIT_RUNS and kind != "d":
        return dir_path, False
    if name in GIT_ALTERNATES and dir_path.endswith("objects/info") and kind != "d":
        return dir_path.removesuffix("objects/info").rstrip("/"), False
    if name not in _NEAR_GIT_NAMES and not any(near in dir_path for near in _NEAR_GIT_NAMES):
        return None  # (most entries: no split)
    parts = [*dir_path.split("/"), name] if dir_path else [name]
    at = next((i for i, part in enumerate(parts) if part in _NEAR_GIT_NAMES), None)
    return None if at is None else ("/".join(parts[:at]), False)


def _host_has(dst_root: int, dir_path: str, names: tuple[str, ...]) -> bool:
    """Whether the host's directory ``dir_path`` (below ``dst_root``, opened a component at a time
    without following links, and without making anything) holds one of ``names``."""
    from .workspace import _open_dir_beneath  # (workspace imports this module for its walk)

    try:
        fd = _open_dir_beneath(dst_root, dir_path.split("/") if dir_path else [], False, -1, -1)
    except OSError:  # no such directory on the host (yet): nothing of it there
        return False
    try:
        for name in names:
            try:
                os.stat(name, dir_fd=fd, follow_symlinks=False)
                return True
            except FileNotFoundError:
                continue
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


def makes_a_git_directory(current: Container[tuple[str, str]], dst_root: int, key: tuple[str, str],
                          kind: str) -> bool:
    """True for what write-back leaves as the host has it because, with the rest, it would give
    the host a git directory whose configuration or hooks the sandbox wrote, anywhere in the
    tree: a bare repository's layout (``HEAD``, ``objects/``, ``refs/``, ``config`` with
    ``core.fsmonitor``) needs no ``.git``, and the host's git took the sandbox's ``sub/`` (or the
    workspace itself, before an enclosing repository's ``.git``) for a repository and ran its
    program at ``git status``.  So a directory may get a ``HEAD`` or git's files, not both: its
    ``config``, ``config.worktree``, ``commondir``, ``gitdir`` and ``hooks/`` stay as the host has
    them where a ``HEAD`` is (in the sandbox's tree, ``current``, or on the host), and a ``HEAD``
    stays as the host has it where one of those is, in either order and over any number of
    syncs; except a ``HEAD`` in the directories whose such files write-back never writes
    (``.git``, its ``worktrees/*`` and ``modules/...``: :func:`host_keeps`), so the sandbox's
    commits, checkouts and branches come back."""
    found = _git_dir_of(key, kind)
    if found is None:
        return False
    dir_path, is_head = found
    names = (HEAD,) if not is_head else (*GIT_RUNS, *_NEAR_GIT_NAMES)
    if is_head and host_keeps(f"{dir_path}/config" if dir_path else "config", "f"):
        return False
    if any((dir_path, name) in current for name in names) or _host_has(dst_root, dir_path, names):
        return True
    if not is_head:
        return False
    # a HEAD where alternates are already (written by an earlier sync, before any HEAD was there)
    info = f"{dir_path}/objects/info" if dir_path else "objects/info"
    return (any((info, name) in current for name in GIT_ALTERNATES)
            or _host_has(dst_root, info, tuple(GIT_ALTERNATES)))
