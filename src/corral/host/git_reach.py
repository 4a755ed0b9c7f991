"""What the host's git configuration names inside a workspace: write-back leaves it as the host has it.

A repository's configuration may point into its worktree, and the host's git then reads or runs
what the sandbox wrote there, as the workspace's owner (root, often): ``include.path =
../.gitconfig`` (shared settings; the sandbox's ``core.fsmonitor`` ran at the owner's next ``git
status``), husky's ``core.hooksPath = .husky/_`` (its hook ran at ``git commit``), and a setting
whose command is a project's script: ``core.fsmonitor = tools/fsmon.sh`` at ``git status``,
``diff.*.textconv`` at ``git diff``, ``core.pager`` at ``git log``, ``remote.*.uploadpack`` and
``core.gitProxy`` at ``git fetch``, ``gpg.program`` at ``git commit`` (helpers 94, 96).

:class:`GitReach` asks the host's git for its configuration (the repository's, its included
files' whatever their conditions, this process's home's and the workspace owner's) and names,
relative to the workspace: the files included, the hooks directory of each worktree (with
husky's ``.husky/``, whose scripts its hooks run), and the files the settings of
:data:`RUN_OR_READ` name (their commands' scripts, by a path or a bare file name, and the few
files git reads to decide: signers, attributes), for the workspace's repository and the
repositories of their own found inside it.  It reads first at the first write-back (the host's
directory as it was: nothing was written back before), again when one of the host's
configuration files changes, and what it holds only grows: a sandbox
that deleted ``.git/HEAD`` made the repository vanish from a reading, and what it held with it
(helper 97).  :func:`.ws_git.host_keeps` holds those paths and the directories on the way to
them, by the path as configured and by where its links lead.

Out of scope, as the README's row says: what a hook, a held script or an alias runs in turn
(``npm test`` and ``package.json``'s scripts, ``node_modules/.bin``, ``.pre-commit-config.yaml``,
a Makefile, an alias's ``!pytest tests/``) is the project's own code, as the sandbox left it: the
owner runs it as they would run ``make``.  Holding every word of every setting held a
submodule's whole worktree and an alias's ``tests/`` too, and silently dropped the sandbox's
work there (helper 97).
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import subprocess
from pathlib import Path

from .ws_git import HeldPaths

#: settings whose value is a command git runs, or a file git reads to decide what to trust or
#: run: (section, last part); a subsection between them (``diff.<driver>.textconv``) is any
RUN_OR_READ = frozenset({
    ("core", "fsmonitor"), ("core", "pager"), ("pager", "*"), ("core", "editor"), ("sequence", "editor"),
    ("core", "sshcommand"), ("core", "askpass"), ("core", "gitproxy"), ("core", "attributesfile"),
    ("gpg", "program"), ("gpg", "defaultkeycommand"), ("gpg", "allowedsignersfile"), ("gpg", "revocationfile"),
    ("credential", "helper"), ("interactive", "difffilter"), ("diff", "external"), ("diff", "textconv"),
    ("diff", "command"), ("filter", "clean"), ("filter", "smudge"), ("filter", "process"), ("merge", "driver"),
    ("mergetool", "cmd"), ("mergetool", "path"), ("difftool", "cmd"), ("difftool", "path"),
    ("remote", "uploadpack"), ("remote", "receivepack"), ("trailer", "cmd"), ("trailer", "command"),
    ("submodule", "update"), ("sendemail", "sendmailcmd"), ("browser", "cmd"), ("browser", "path"),
    ("man", "cmd"), ("man", "path"), ("guitool", "cmd"), ("uploadpack", "packobjectshook"),
})
#: how deep included files are followed (git's own limit is 10)
_INCLUDE_DEPTH = 10
#: how deep repositories of their own are looked for in a workspace when it is made, and at most
#: how many directories are looked at for them
_NESTED_DEPTH = 3
_NESTED_DIRS = 20_000
#: what separates a shell word's parts that may each be a path (``KEY=path``, ``a;b``, ``$(pwd)/x``)
_PART_BREAKS = re.compile(r"[=;|&()<>`,:]+")
#: the environment of the owner's git that names its configuration (the rest, ``GIT_DIR`` and
#: such, would point the reading elsewhere)
_CONFIG_ENV = ("GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_NOSYSTEM", "GIT_CONFIG_COUNT",
               "GIT_CONFIG_KEY_", "GIT_CONFIG_VALUE_", "GIT_CONFIG_PARAMETERS")


class GitReach:
    """The workspace-relative paths ``root``'s git configuration names (see the module).  First
    read at the first write-back, from the host's directory as it was before the sandbox ran
    (nothing was written back before it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._homes = _homes(root)
        #: the repositories read: the workspace's and those inside it at the first reading (a
        #: sandbox's own have no configuration on the host: write-back holds a nested ``.git/config``)
        self._repos: list[Path] | None = None
        self._files: tuple[Path, ...] = ()
        self._held = HeldPaths(())
        self._key: tuple[tuple[int, int, int], ...] | None = None

    def held(self) -> HeldPaths:
        """What to hold now: read again if one of the host's configuration files changed."""
        if self._repos is None:
            self._repos = [self.root, *_nested_repositories(self.root)]
            self._key = self._read()
        elif self._stat_key() != self._key:
            self._key = self._read()
        return self._held

    def _read(self) -> tuple[tuple[int, int, int], ...]:
        held: set[str] = set(self._held.paths)  # only grows (see the module)
        files: set[Path] = set(self._files)
        for repo in self._repos or ():
            for home in self._homes:
                named, read = _configured(repo, self.root, home)
                held.update(named)
                files.update(read)
        self._held, self._files = HeldPaths(held), tuple(sorted(files))
        return self._stat_key()

    def _stat_key(self) -> tuple[tuple[int, int, int], ...]:
        files = [Path("/etc/gitconfig"), *self._files]
        for repo in self._repos or ():
            files += [repo / ".git" / "config", repo / ".git" / "config.worktree"]
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


def _git(args: list[str], cwd: Path, home: Path) -> bytes | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k.startswith(_CONFIG_ENV)}
    env["HOME"] = str(home)
    try:
        # (a repository of another user's is "dubious" to root's git, which then skips its config)
        done = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(cwd), *args], capture_output=True,
                              env=env, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _entries(listed: bytes) -> list[tuple[str, str, str, str]]:
    """(origin, section, last part, value) of ``git config --show-origin --null --list``'s output,
    section and last part lower-cased (git's own are; a subsection keeps its case)."""
    fields = listed.split(b"\0")
    out = []
    for origin, entry in zip(fields[0::2], fields[1::2], strict=False):  # (a last empty field)
        name, _, value = os.fsdecode(entry).partition("\n")
        section, _, rest = name.partition(".")
        out.append((os.fsdecode(origin), section.lower(), rest.rpartition(".")[2].lower(), value))
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
    home = Path(os.environ.get("HOME") or "/root")
    modules = _git(["config", "--file", ".gitmodules", "--null", "--get-regexp", r"^submodule\..*\.path$"], root, home)
    for line in (modules or b"").split(b"\0"):
        _, _, path = os.fsdecode(line).partition("\n")
        if path and not os.path.isabs(path) and ".." not in Path(path).parts:
            found.append(root / path)
    return sorted(set(found))


def _configured(root: Path, workspace: Path, home: Path) -> tuple[set[str], set[Path]]:
    """(``workspace``-relative paths the host's git configuration at ``root`` names, with ``home``
    as the owner's, and the files that may hold it: those read and those included)."""
    top_out = _git(["rev-parse", "--show-toplevel"], root, home)
    top = Path(os.fsdecode(top_out.strip())) if top_out and top_out.strip() else Path(os.path.realpath(root))
    listed = _git(["config", "--includes", "--show-origin", "--null", "--list"], root, home)
    if listed is None:
        return set(), set()  # no git on the host (or no configuration): nothing is its configuration
    worktrees = [top]
    for line in (_git(["worktree", "list", "--porcelain"], root, home) or b"").splitlines():
        if line.startswith(b"worktree "):
            tree = Path(os.fsdecode(line[len(b"worktree "):]))
            if ".git" not in tree.parts:  # (a submodule names its git directory: no worktree)
                worktrees.append(tree)
    named: list[Path] = []
    files: set[Path] = set()
    pending = _entries(listed)
    read: set[Path] = set()
    for _ in range(_INCLUDE_DEPTH + 1):
        included: list[Path] = []
        for origin, section, last, value in pending:
            if not origin.startswith("file:"):
                continue  # (the command line's safe.directory)
            where = origin.removeprefix("file:")
            # git names the repository's own files from the top of its worktree (`.git/config`)
            base = Path(where) if os.path.isabs(where) else top / where
            files.add(base)
            if not value:
                continue
            if (section == "include" and last == "path") or (section == "includeif" and last == "path"):
                path = _expand(value, home)
                target = path if path.is_absolute() else base.parent / path
                named.append(target)
                included.append(target)
                files.add(target)  # (one made later is a change to read again)
            elif (section, last) == ("core", "hookspath"):
                path = _expand(value, home)
                for tree in worktrees if not path.is_absolute() else [top]:
                    target = path if path.is_absolute() else tree / path
                    named.append(target)
                    if target.name == "_":  # husky: its hooks run the scripts of the directory above
                        named.append(target.parent)
            elif (section, last) in RUN_OR_READ or (section, "*") in RUN_OR_READ:
                if section == "submodule" and not value.startswith("!"):
                    continue  # (`update = checkout`: a mode, not a command)
                if section == "credential" and not value.startswith("!") and "/" not in value:
                    continue  # (`helper = store`: git runs `git credential-store`, from its PATH)
                named.extend(_command_paths(value.removeprefix("!"), worktrees, home))
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
    return _inside(workspace, named), files


def _expand(word: str, home: Path) -> Path:
    """``word`` with a leading ``~`` as the owner's git reads it (``home``'s, not this process's)."""
    if word == "~" or word.startswith("~/"):
        return home / word[2:]
    return Path(os.path.expanduser(word))


def _command_paths(command: str, worktrees: list[Path], home: Path) -> list[Path]:
    """The files ``command`` may run or read, as git's commands see them (from the top of a
    worktree): each part of its shell words (``KEY=path``, ``$(pwd)/path``), whether or not it
    names anything yet (``sh fsmonitor``: the sandbox may make it; a program's own name, ``less``,
    holds a file of that name, harmless); not a directory (``core.editor = code`` would hold a
    project's ``code/``); a glob by the directory before it."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    paths: list[Path] = []
    for word in words:
        for part in _PART_BREAKS.split(word):
            if not part or part.startswith("-"):
                continue
            if "$" in part:  # `$PWD/tools/x`, `${VAR}/x`: what follows the variable, from the top
                part = part.split("/", 1)[1] if "/" in part else ""
            glob = any(c in part for c in "*?[{")
            if glob:  # the directory before the pattern, whole
                part = "/".join(p for p in part.split("/")[:-1] if not any(c in p for c in "*?[{"))
            if not part:
                continue
            path = _expand(part, home)
            candidates = [path] if path.is_absolute() else [tree / path for tree in worktrees]
            if path.is_absolute():  # `$(git rev-parse --show-toplevel)/x` leaves `/x`
                candidates += [tree / part.lstrip("/") for tree in worktrees]
            paths.extend(c for c in candidates if glob or not os.path.isdir(c))
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
