"""What the host's git configuration names inside a workspace: write-back leaves it as the host has it.

A repository's configuration may point into its worktree, and the host's git then reads or runs
what the sandbox wrote there, as the workspace's owner (root, often): ``include.path =
../.gitconfig`` (shared settings; the sandbox's ``core.fsmonitor`` ran at the owner's next ``git
status``), husky's ``core.hooksPath = .husky/_`` (its hook ran at ``git commit``), a
``core.fsmonitor``, ``diff.*.textconv``, ``filter.*.clean``, ``core.pager``, ``core.sshCommand``,
``gpg.program`` or ``core.editor`` naming a script of the project (each ran at ``git status``,
``diff``, ``log``, ``fetch``, ``commit``: helper 94).  :class:`GitReach` asks the host's git for
its configuration (every file it reads, included ones too, whatever their conditions) and names,
relative to the workspace, the files and directories those settings name there: included files,
the hooks directory (with husky's ``.husky/``, whose scripts its hooks run), and every word of a
command setting that is a path.  :func:`.ws_git.host_keeps` holds them and the directories on the
way to them, by the path as configured and by where its links lead.

What a hook or a held script runs in turn (``npm test`` and ``package.json``'s scripts,
``node_modules/.bin``, ``.pre-commit-config.yaml``, a Makefile) is the project's own code, as the
sandbox left it: the owner runs it at their commit as they would run ``make``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

#: settings whose value is a command git runs (the words of it that are paths are held)
_COMMANDS = frozenset({"core.fsmonitor", "core.pager", "core.editor", "core.sshcommand", "core.askpass",
                       "sequence.editor", "gpg.program", "credential.helper", "interactive.difffilter",
                       "diff.external", "merge.tool", "diff.tool"})
#: the same for settings of a named driver, tool or alias: (first part, last part); "" is any
_COMMAND_PATTERNS = (("diff", "textconv"), ("diff", "command"), ("filter", "clean"), ("filter", "smudge"),
                     ("filter", "process"), ("merge", "driver"), ("gpg", "program"), ("pager", ""),
                     ("alias", ""), ("credential", "helper"), ("difftool", "cmd"), ("mergetool", "cmd"))
#: how deep included files are followed (git's own limit is 10)
_INCLUDE_DEPTH = 10


class GitReach:
    """The workspace-relative paths ``root``'s git configuration names (see the module): read with
    the host's git once, and again when one of the files it was read from changes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._key: tuple[tuple[int, int, int], ...] | None = None
        self._files: tuple[Path, ...] = ()
        self._held: tuple[str, ...] = ()

    def held(self) -> tuple[str, ...]:
        key = self._stat_key()
        if key != self._key:
            held: set[str] = set()
            files: set[Path] = set()
            for repo in [self.root, *_nested_repositories(self.root)]:
                named, origins = _configured(repo, self.root)
                held.update(named)
                files.update(origins)
            self._held, self._files = tuple(sorted(held)), tuple(sorted(files))
            self._key = self._stat_key()
        return self._held

    def _stat_key(self) -> tuple[tuple[int, int, int], ...]:
        home = Path(os.environ.get("HOME", "/root"))
        xdg = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
        files = (self.root / ".git" / "config", self.root / ".git" / "HEAD", home / ".gitconfig",
                 xdg / "git" / "config", Path("/etc/gitconfig"), *self._files)
        key = []
        for path in files:
            try:
                st = os.stat(path)
                key.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                key.append((0, 0, 0))
        return tuple(key)


def _is_command(name: str) -> bool:
    if name in _COMMANDS:
        return True
    first, _, rest = name.partition(".")
    last = rest.rpartition(".")[2]
    return any(first == a and (not b or (last == b and "." in rest)) for a, b in _COMMAND_PATTERNS)


def _git(args: list[str], cwd: Path) -> bytes | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        # (a repository of another user's is "dubious" to root's git, which then skips its config)
        done = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(cwd), *args], capture_output=True,
                              env=env, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _entries(listed: bytes) -> list[tuple[str, str, str]]:
    """(origin, lower-cased name, value) of ``git config --show-origin --null --list``'s output."""
    fields = listed.split(b"\0")
    out = []
    for origin, entry in zip(fields[0::2], fields[1::2], strict=False):  # (a last empty field)
        name, _, value = os.fsdecode(entry).partition("\n")
        out.append((os.fsdecode(origin), name.lower(), value))
    return out


def _nested_repositories(root: Path) -> list[Path]:
    """Repositories of their own inside the workspace whose configuration the host's git reads
    when the owner works in them: the workspace repository's submodules and, for a workspace that
    is a folder of projects, its directories holding a ``.git`` (a submodule's ``core.hooksPath``
    named a hook the sandbox wrote: helper 94)."""
    found = []
    try:
        with os.scandir(root) as entries:
            found += [Path(e.path) for e in entries
                      if e.is_dir(follow_symlinks=False) and os.path.lexists(os.path.join(e.path, ".git"))]
    except OSError:
        pass
    modules = _git(["config", "--file", ".gitmodules", "--null", "--get-regexp", r"^submodule\..*\.path$"], root)
    for entry in (modules or b"").split(b"\0"):
        _, _, path = os.fsdecode(entry).partition("\n")
        if path and not os.path.isabs(path) and ".." not in Path(path).parts:
            found.append(root / path)
    return sorted(set(found))


def _configured(root: Path, workspace: Path) -> tuple[tuple[str, ...], tuple[Path, ...]]:
    """(``workspace``-relative paths the host's git configuration at ``root`` names, the files it
    was read from)."""
    top_out = _git(["rev-parse", "--show-toplevel"], root)
    top = Path(os.fsdecode(top_out.strip())) if top_out and top_out.strip() else Path(os.path.realpath(root))
    listed = _git(["config", "--includes", "--show-origin", "--null", "--list"], root)
    if listed is None:
        return (), ()  # no git on the host (or no configuration): nothing is its configuration
    worktrees = [top]
    for line in (_git(["worktree", "list", "--porcelain"], root) or b"").splitlines():
        if line.startswith(b"worktree "):
            worktrees.append(Path(os.fsdecode(line[len(b"worktree "):])))
    named: list[Path] = []
    origins: set[Path] = set()
    pending = _entries(listed)
    read: set[Path] = set()
    for _ in range(_INCLUDE_DEPTH + 1):
        included: list[Path] = []
        for origin, name, value in pending:
            if not origin.startswith("file:"):
                continue  # (the command line's safe.directory)
            where = origin.removeprefix("file:")
            # git names the repository's own files from the top of its worktree (`.git/config`)
            base = Path(where) if os.path.isabs(where) else top / where
            origins.add(base)
            if not value:
                continue
            if name == "include.path" or (name.startswith("includeif.") and name.endswith(".path")):
                path = Path(os.path.expanduser(value))
                target = path if path.is_absolute() else base.parent / path
                named.append(target)
                included.append(target)
            elif name == "core.hookspath":
                path = Path(os.path.expanduser(value))
                for tree in worktrees if not path.is_absolute() else [top]:
                    target = path if path.is_absolute() else tree / path
                    named.append(target)
                    if target.name == "_":  # husky: its hooks run the scripts of the directory above
                        named.append(target.parent)
            elif _is_command(name):
                named.extend(_command_paths(value.removeprefix("!"), worktrees))
        # an included file's own includes, whatever the conditions that make git read it now
        pending = []
        for path in included:
            if path in read or not path.is_file():
                continue
            read.add(path)
            more = _git(["config", "--file", str(path), "--includes", "--show-origin", "--null", "--list"], root)
            pending += _entries(more or b"")
        if not pending:
            break
    return _inside(workspace, named), tuple(sorted(origins))


def _command_paths(command: str, worktrees: list[Path]) -> list[Path]:
    """The words of ``command`` that are paths (a ``/`` in them), as git's commands see them: from
    the top of a worktree."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    paths = []
    for word in words:
        if "/" not in word:
            continue
        path = Path(os.path.expanduser(word))
        paths.extend([path] if path.is_absolute() else [tree / path for tree in worktrees])
    return paths


def _inside(root: Path, named: list[Path]) -> tuple[str, ...]:
    """``named`` relative to the workspace ``root``: each by its path as configured (the links on
    the way held as they are) and by where its links lead, if inside."""
    real_root = os.path.realpath(root)
    held = set()
    for path in named:
        for where in (os.path.normpath(path), os.path.realpath(path)):
            inside = os.path.relpath(where, real_root)
            if inside != "." and not inside.startswith(".."):
                held.add(inside)
    return tuple(sorted(held))
