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
the hooks directory (with husky's ``.husky/``, whose scripts its hooks run), and every word of any
setting's value that may name a file there (commands' scripts, ``remote.*.uploadpack``,
``core.gitProxy``, ``gpg.ssh.allowedSignersFile``, a template...) -- in the owner's home's
configuration too, for the workspace's repository, its worktrees and the repositories of their
own inside it.  :func:`.ws_git.host_keeps` holds them and the directories on the way to them, by
the path as configured and by where its links lead.

What a hook or a held script runs in turn (``npm test`` and ``package.json``'s scripts,
``node_modules/.bin``, ``.pre-commit-config.yaml``, a Makefile) is the project's own code, as the
sandbox left it: the owner runs it at their commit as they would run ``make``.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
from pathlib import Path

from .ws_git import HeldPaths

#: how deep included files are followed (git's own limit is 10)
_INCLUDE_DEPTH = 10
#: how deep repositories of their own are looked for in a workspace, and at most how many
#: directories are looked at for them
_NESTED_DEPTH = 3
_NESTED_DIRS = 20_000
#: what separates the words of a setting's value (a shell command's words, ``KEY=path``, lists)
_WORD_BREAKS = re.compile(r"[\s=;|&'\"()<>`,:]+")
#: the environment of the owner's git that names its configuration (the rest, ``GIT_DIR`` and
#: such, would point the reading elsewhere)
_CONFIG_ENV = ("GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_NOSYSTEM", "GIT_CONFIG_COUNT",
               "GIT_CONFIG_KEY_", "GIT_CONFIG_VALUE_", "GIT_CONFIG_PARAMETERS")


class GitReach:
    """The workspace-relative paths ``root``'s git configuration names (see the module): read with
    the host's git once, and again when one of the files it was read from changes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._homes = _homes(root)
        self._key: tuple[tuple[int, int, int], ...] | None = None
        self._files: tuple[Path, ...] = ()
        self._held = HeldPaths(())

    def held(self) -> HeldPaths:
        key = self._stat_key()
        if key != self._key:
            held: set[str] = set()
            files: set[Path] = set()
            for repo in [self.root, *_nested_repositories(self.root)]:
                for home in self._homes:
                    named, origins = _configured(repo, self.root, home)
                    held.update(named)
                    files.update(origins)
            self._held, self._files = HeldPaths(held), tuple(sorted(files))
            self._key = self._stat_key()
        return self._held

    def _stat_key(self) -> tuple[tuple[int, int, int], ...]:
        files = [self.root / ".git" / "config", self.root / ".git" / "HEAD", Path("/etc/gitconfig"), *self._files]
        for home in self._homes:
            xdg = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
            files += [home / ".gitconfig", xdg / "git" / "config"]
        if os.environ.get("GIT_CONFIG_GLOBAL"):
            files.append(Path(os.environ["GIT_CONFIG_GLOBAL"]))
        key = []
        for path in files:
            try:
                st = os.stat(path)
                key.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                key.append((0, 0, 0))
        return tuple(key)


def _homes(root: Path) -> list[Path]:
    """The homes whose git configuration applies: this process's (``HOME``) and the workspace
    owner's, who runs git in it (under ``sudo corral`` or a daemon, root's is not theirs: the
    owner's ``core.hooksPath = .githooks`` named the sandbox's hook; helper 96)."""
    homes = [Path(os.environ.get("HOME") or "/root")]
    try:
        owner = Path(pwd.getpwuid(os.stat(root).st_uid).pw_dir)
    except (OSError, KeyError):
        return homes
    return homes if owner == homes[0] else [*homes, owner]


def _git(args: list[str], cwd: Path, home: Path | None = None) -> bytes | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k.startswith(_CONFIG_ENV)}
    if home is not None:
        env["HOME"] = str(home)
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
    """Repositories of their own inside the workspace, whose configuration the host's git reads
    when the owner works in them: directories holding a ``.git`` (a submodule's is a file) down to
    :data:`_NESTED_DEPTH` levels, and the workspace repository's submodules (a submodule's
    ``core.hooksPath`` named a hook the sandbox wrote, as did a repository two levels down in a
    monorepo of repositories: helpers 94, 96)."""
    found: list[Path] = []
    level, looked = [root], 0
    for _ in range(_NESTED_DEPTH):
        below: list[Path] = []
        for directory in level:
            try:
                with os.scandir(directory) as entries:
                    for entry in entries:
                        if entry.name in (".git", "node_modules") or not entry.is_dir(follow_symlinks=False):
                            continue
                        looked += 1
                        if os.path.lexists(os.path.join(entry.path, ".git")):
                            found.append(Path(entry.path))
                        below.append(Path(entry.path))
            except OSError:
                continue
            if looked > _NESTED_DIRS:
                break
        level = below
    modules = _git(["config", "--file", ".gitmodules", "--null", "--get-regexp", r"^submodule\..*\.path$"], root)
    for line in (modules or b"").split(b"\0"):
        _, _, path = os.fsdecode(line).partition("\n")
        if path and not os.path.isabs(path) and ".." not in Path(path).parts:
            found.append(root / path)
    return sorted(set(found))


def _configured(root: Path, workspace: Path, home: Path) -> tuple[set[str], set[Path]]:
    """(``workspace``-relative paths the host's git configuration at ``root`` names, with ``home``
    as the owner's, and the files it was read from)."""
    top_out = _git(["rev-parse", "--show-toplevel"], root, home)
    top = Path(os.fsdecode(top_out.strip())) if top_out and top_out.strip() else Path(os.path.realpath(root))
    listed = _git(["config", "--includes", "--show-origin", "--null", "--list"], root, home)
    if listed is None:
        return set(), set()  # no git on the host (or no configuration): nothing is its configuration
    worktrees = [top]
    for line in (_git(["worktree", "list", "--porcelain"], root, home) or b"").splitlines():
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
            else:
                named.extend(_value_paths(value, worktrees))
                subsection = name.partition(".")[2].rpartition(".")[0]
                if subsection:  # (`url.<path>.insteadOf`: a key may name a path too)
                    named.extend(_value_paths(subsection, worktrees))
        # an included file's own includes, whatever the conditions that make git read it now
        pending = []
        for path in included:
            if path in read or not path.is_file():
                continue
            read.add(path)
            more = _git(["config", "--file", str(path), "--includes", "--show-origin", "--null", "--list"], root, home)
            pending += _entries(more or b"")
        if not pending:
            break
    return _inside(workspace, named), origins


def _value_paths(value: str, worktrees: list[Path]) -> list[Path]:
    """The words of any setting's value that may name a file of a worktree, as git's commands
    see them (from the top of a worktree): a word with a ``/`` or a ``.`` in it (held whether or
    not it names anything yet: it may be made), or one naming a file there.  Any setting, not a
    list of those that run commands: a list missed ``remote.*.uploadpack``, ``core.gitProxy``,
    ``gpg.ssh.allowedSignersFile``..., and a command's script by its bare name (``sh fsmon.sh``)
    or after ``KEY=`` (helper 96).  A bare word naming a directory is not held (``core.editor =
    code`` would hold a project's ``code/``): an alias's ``cd tools && ./lint.sh`` runs the
    project's script, as ``make`` would."""
    paths: list[Path] = []
    for word in _WORD_BREAKS.split(value.removeprefix("!")):
        if not word or word.startswith("-"):
            continue
        path = Path(os.path.expanduser(word))
        candidates = [path] if path.is_absolute() else [tree / path for tree in worktrees]
        looks_like_a_path = "/" in word or "." in word
        paths.extend(c for c in candidates if looks_like_a_path or (os.path.lexists(c) and not os.path.isdir(c)))
    return paths


def _inside(root: Path, named: list[Path]) -> set[str]:
    """``named`` relative to the workspace ``root``: each by its path as configured (the links on
    the way held as they are) and by where its links lead, if inside."""
    real_root = os.path.realpath(root)
    held = set()
    for path in named:
        for where in (os.path.normpath(path), os.path.realpath(path)):
            inside = os.path.relpath(where, real_root)
            if inside != "." and not inside.startswith(".."):
                held.add(inside)
    return held
