"""What a sandbox is: image, tier, limits, workspace, environment, network.

A :class:`SandboxSpec` is validated when it is built, so every later layer can
trust it.  Every rejection is an :class:`~corral.errors.InvalidSpec` whose
message names the field, the value and what would be accepted.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import InvalidSpec
from .errors import quoted as _shown
from .netrules import AllowRule, parse_range
from .secrets import SecretBinding

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: the built-in isolation tiers, by name: each is the package ``corral.tiers.<name>`` (the one list of them)
TIERS = ("process", "gvisor", "microvm", "wasm")
#: tiers registered at run time (``corral.tiers.register_tier``), after the built-in ones
_REGISTERED_TIERS: list[str] = []

NETWORK_MODES = ("none", "allow", "open")
#: who commands run as inside: the unprivileged sandbox user (uid 1000), or root of the
#: sandbox's own user namespace (tiers that offer it: ``Capabilities.root``)
USERS = ("user", "root")
WORKSPACE_MODES = ("rw", "ro", "cow")
#: where the workspace appears inside every sandbox
WORKSPACE_PATH = "/workspace"


def tier_names() -> tuple[str, ...]:
    """Every tier a spec may name: the built-in ones, then those registered at run time."""
    return (*TIERS, *_REGISTERED_TIERS)


def add_tier_name(name: str) -> None:
    """Let specs name ``name`` (called by :func:`corral.tiers.register_tier`, which holds the tier)."""
    if name not in tier_names():
        _REGISTERED_TIERS.append(name)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB}
#: a variable name (\Z, not $: "$" also matches before a final newline, and "A\\n" was taken as a name)
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")


def parse_size(value: str | int | float, what: str = "size") -> int:
    """Parse ``512M``, ``1GiB``, ``1.5g``, ``1048576`` into bytes (binary units)."""
    if isinstance(value, bool):
        raise InvalidSpec(f"{what}: expected a size such as 512M or 2G, got {_shown(value)}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise InvalidSpec(f"{what}: must be a positive size, got {_shown(value)}")
        return int(value)
    match = _SIZE_RE.match(value)
    if not match or (match.group(3) and not match.group(2) and match.group(3).lower() != "b"):
        raise InvalidSpec(
            f"{what}: cannot parse {_shown(value)}; use a number with an optional unit K, M, G or T "
            "(binary: 1K = 1024 bytes), e.g. 512M or 2G"
        )
    number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if number < 1:
        raise InvalidSpec(f"{what}: must be a positive size, got {_shown(value)}")
    return int(number)


def format_size(n: int) -> str:
    for unit, factor in (("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


@dataclass(frozen=True)
class Limits:
    """Resource limits. Always on: there is no "unlimited"."""

    memory: int = 512 * MiB
    pids: int = 256
    cpus: float = 1.0
    disk: int = 1 * GiB
    timeout: float = 60.0
    #: bytes of stdout and of stderr kept per command; the rest is cut and flagged
    max_output: int = 16 * MiB

    def __post_init__(self) -> None:
        if not 16 * MiB <= self.memory <= 1024 * GiB:
            raise InvalidSpec(f"memory: {format_size(self.memory)} is outside 16M..1T")
        if isinstance(self.pids, bool) or not isinstance(self.pids, int) or not 8 <= self.pids <= 1_000_000:
            raise InvalidSpec(f"pids: {_shown(self.pids)} must be a whole number from 8 to 1000000")
        if not isinstance(self.cpus, (int, float)) or not math.isfinite(self.cpus) or not 0.01 <= self.cpus <= 1024:
            raise InvalidSpec(f"cpus: {_shown(self.cpus)} must be a number from 0.01 to 1024")
        if not 1 * MiB <= self.disk <= 1024 * GiB:
            raise InvalidSpec(f"disk: {format_size(self.disk)} is outside 1M..1T")
        if not isinstance(self.timeout, (int, float)) or not math.isfinite(self.timeout) or not 0 < self.timeout <= 7 * 86400:
            raise InvalidSpec(f"timeout: {_shown(self.timeout)} must be seconds in (0, 604800]")
        if not 1024 <= self.max_output <= 1024 * MiB:
            raise InvalidSpec(f"max_output: {_shown(self.max_output)} must be from 1K to 1G bytes")

    @classmethod
    def build(
        cls,
        memory: str | int | None = None,
        pids: int | str | None = None,
        cpus: float | str | None = None,
        disk: str | int | None = None,
        timeout: float | str | None = None,
        max_output: str | int | None = None,
    ) -> Limits:
        """Build limits from user-facing values (strings from a CLI or JSON), defaults for None."""
        base = cls()
        return cls(
            memory=parse_size(memory, "memory") if memory is not None else base.memory,
            pids=_parse_int(pids, "pids") if pids is not None else base.pids,
            cpus=_parse_float(cpus, "cpus") if cpus is not None else base.cpus,
            disk=parse_size(disk, "disk") if disk is not None else base.disk,
            timeout=_parse_float(timeout, "timeout") if timeout is not None else base.timeout,
            max_output=parse_size(max_output, "max_output") if max_output is not None else base.max_output,
        )


def _parse_int(value: int | str, what: str) -> int:
    if isinstance(value, bool):
        raise InvalidSpec(f"{what}: expected a whole number, got {_shown(value)}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidSpec(f"{what}: expected a whole number, got {_shown(value)}") from None


def _parse_float(value: float | str, what: str) -> float:
    if isinstance(value, bool):
        raise InvalidSpec(f"{what}: expected a number, got {_shown(value)}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InvalidSpec(f"{what}: expected a number, got {_shown(value)}") from None
    if not math.isfinite(number):
        raise InvalidSpec(f"{what}: expected a finite number, got {_shown(value)}")
    return number


#: what is no workspace: the host's own trees, where a sandbox's rw write-back (as root, their owner)
#: is code on the host (a file in /etc/cron.d, /usr/bin), and reading them (/etc/shadow) is the
#: host's secrets; and the directories that hold others' trees (every user's home, all of /var)
SYSTEM_TREES = tuple(Path(p) for p in ("/proc", "/sys", "/dev", "/boot", "/etc", "/run", "/usr", "/bin", "/sbin",
                                       "/lib", "/lib32", "/lib64", "/libx32",
                                       # the host's state: packages' scripts root runs (/var/lib/dpkg/info),
                                       # cron's and mail's spools, logs, caches
                                       "/var/lib", "/var/log", "/var/spool", "/var/mail", "/var/cache", "/var/backups"))
HOLDERS = frozenset(Path(p) for p in ("/", "/home", "/root", "/var", "/var/tmp", "/srv", "/opt", "/tmp", "/mnt",
                                      "/media"))
#: a user's keys: no workspace lies in one or holds one directly (a prompt injection reads
#: ``~/.ssh/id_rsa``; rw write-back into ``~/.ssh/authorized_keys`` or ``~/.bashrc`` is a login
#: or code on the host as that user); the project is a directory of its own
CREDENTIAL_STORES = frozenset((".ssh", ".gnupg", ".aws", ".azure", ".kube", ".password-store"))
#: of those, what a directory holding one is refused for (the others are also project folders' names)
HELD_CREDENTIAL_STORES = (".ssh", ".gnupg")
#: login users' uids start here (Debian's ``UID_MIN``); below it are system accounts, whose homes
#: are service trees (``/var/www``, ``/var/lib/postgresql``)
FIRST_LOGIN_UID = 1000
NOBODY = 65534


def login_homes() -> set[Path]:
    """Home directories of root, of login users (``/etc/passwd``) and of this process (``HOME``)."""
    import pwd

    homes = {Path(entry.pw_dir) for entry in pwd.getpwall()
             if (entry.pw_uid == 0 or FIRST_LOGIN_UID <= entry.pw_uid != NOBODY) and entry.pw_dir.startswith("/")}
    home = os.environ.get("HOME", "")
    if home.startswith("/"):
        homes.add(Path(home))
    return {Path(os.path.realpath(h)) for h in homes}


def homes_owning(path: Path) -> set[Path]:
    """Home directories among ``path`` and its parents, asked of each one's owner: a user a
    directory service does not list (``getpwall``) is still found by uid."""
    import pwd

    found = set()
    for place in (path, *path.parents):
        try:
            uid = place.stat().st_uid
            home = pwd.getpwuid(uid).pw_dir if uid == 0 or FIRST_LOGIN_UID <= uid != NOBODY else ""
        except (OSError, KeyError):
            continue
        if home.startswith("/") and Path(os.path.realpath(home)) == place:
            found.add(place)
    return found


def why_not_a_workspace(path: Path) -> str | None:
    """Why the host directory ``path`` (resolved) is no project to show a sandbox, or None."""
    if path in HOLDERS or any(path.is_relative_to(tree) for tree in SYSTEM_TREES):
        return ("the host's system or every user's files, not a project (the sandbox would read them as their "
                "owner, and rw writes back into them); give the project's own directory")
    why = _credentials_at(path)
    if why is not None:
        return f"{why}; the sandbox would read them, and rw writes back into them: give the project's own directory"
    return None


def _credentials_at(path: Path) -> str | None:
    """Why ``path`` would show a sandbox a user's keys, or None."""
    if CREDENTIAL_STORES & set(path.parts):
        return "it lies in a user's credential store"
    for home in login_homes() | homes_owning(path):
        if home == path or home.is_relative_to(path):
            return f"it is or holds the home directory {home} (keys, shell start-up files)"
        if path.is_relative_to(home) and path.relative_to(home).parts[0].startswith("."):
            # ~/.config/git/config (core.fsmonitor: run at any git status), gh and docker tokens
            return (f"it lies in {home}'s {path.relative_to(home).parts[0]} (a home's dot-directories hold its "
                    "tools' credentials and the programs they run)")
    held = [name for name in HELD_CREDENTIAL_STORES if os.path.lexists(path / name)]
    if held:
        return f"it holds {held[0]} (a user's keys)"
    return None


@dataclass(frozen=True)
class Workspace:
    """A host directory shown at ``/workspace``.

    ``rw``: changes are written back to the host directory after every command;
    ``ro``: read-only; ``cow``: writable, but changes stay in the sandbox.
    The sandbox always works on its own copy (on its disk-limited layer), so
    writes are bounded by the disk limit and the host directory is only ever
    written by Corral itself, never through a path the sandbox controls.
    """

    path: Path
    mode: str = "rw"

    def __post_init__(self) -> None:
        if self.mode not in WORKSPACE_MODES:
            raise InvalidSpec(f"workspace mode {_shown(self.mode)}: use one of {', '.join(WORKSPACE_MODES)}")
        # resolve once, here: later steps open it with O_NOFOLLOW
        try:
            object.__setattr__(self, "path", self.path.expanduser().resolve())
        except (OSError, RuntimeError) as exc:  # (a link changing as it was read; a loop of links)
            raise InvalidSpec(f"workspace {_shown(str(self.path))} cannot be resolved: {exc}") from None
        if not self.path.is_dir():
            raise InvalidSpec(f"workspace {_shown(str(self.path))} does not exist or is not a directory")
        why = why_not_a_workspace(self.path)
        if why is not None:
            raise InvalidSpec(f"workspace {_shown(str(self.path))}: {why}")

    @classmethod
    def parse(cls, text: str) -> Workspace:
        """Parse ``DIR``, ``DIR:ro``, ``DIR:rw`` or ``DIR:cow``."""
        path, _, mode = text.rpartition(":")
        if not path or mode not in WORKSPACE_MODES:
            path, mode = text, "rw"
        return cls(Path(path).expanduser(), mode)


@dataclass(frozen=True)
class SandboxSpec:
    """Everything that defines a sandbox. Immutable and validated."""

    image: str = "host"
    tier: str = "process"
    limits: Limits = field(default_factory=Limits)
    workspace: Workspace | None = None
    #: the only environment the sandbox sees besides PATH/HOME/LANG: the host's never leaks in
    env: Mapping[str, str] = field(default_factory=dict)
    network: str = "none"
    cwd: str = WORKSPACE_PATH
    #: ``network="allow"`` only: destinations (HOST, *.DOMAIN, IP, CIDR, each with optional :PORT)
    allow: tuple[str, ...] = ()
    #: CIDRs the operator re-enables despite the SSRF defences (test networks, local services)
    unsafe_allow_ranges: tuple[str, ...] = ()
    #: secrets bound to hosts; values are never part of the spec
    secrets: tuple[SecretBinding, ...] = ()
    #: who commands (and file calls) run as unless a command names its own ``user``: see USERS
    user: str = "user"

    def __post_init__(self) -> None:
        if self.tier not in tier_names():
            raise InvalidSpec(f"tier {_shown(self.tier)}: use one of {', '.join(tier_names())}")
        if not isinstance(self.image, str) or not _IMAGE_RE.match(self.image):
            raise InvalidSpec(
                f"image {_shown(self.image)}: names are 1-64 characters of a-z, 0-9, '.', '_', '-'"
            )
        if self.network not in NETWORK_MODES:
            raise InvalidSpec(f"network {_shown(self.network)}: use one of {', '.join(NETWORK_MODES)}")
        object.__setattr__(self, "env", validate_env(self.env))  # before the network: secrets check env names
        self._validate_network()
        validate_sandbox_path(self.cwd, "cwd")
        validate_user(self.user)

    def _validate_network(self) -> None:
        for name in ("allow", "unsafe_allow_ranges", "secrets"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise InvalidSpec(f"{name}: expected a list, got {_shown(value)}")
            if len(value) > MAX_NETWORK_ENTRIES:
                raise InvalidSpec(f"{name}: {len(value)} entries, more than the {MAX_NETWORK_ENTRIES} a spec may "
                                  "hold (a *.domain or a CIDR covers many)")
            object.__setattr__(self, name, tuple(value))
        # stored as parsed (stripped): the text as given was held whole for the sandbox's life
        allow = tuple(_network_entry(entry, "allow", index) for index, entry in enumerate(self.allow))
        for entry in allow:
            AllowRule.parse(entry)
        object.__setattr__(self, "allow", allow)
        ranges = tuple(_network_entry(cidr, "unsafe_allow_ranges", index)
                       for index, cidr in enumerate(self.unsafe_allow_ranges))
        for cidr in ranges:
            parse_range(cidr)
        object.__setattr__(self, "unsafe_allow_ranges", ranges)
        secrets = tuple(s if isinstance(s, SecretBinding) else SecretBinding.parse(s) for s in self.secrets)
        bound_hosts = sum(len(s.hosts) for s in secrets)
        if bound_hosts > MAX_NETWORK_ENTRIES:
            raise InvalidSpec(f"secrets: {bound_hosts} hosts bound in all, more than the {MAX_NETWORK_ENTRIES} a spec "
                              "may hold (a *.domain covers many)")
        object.__setattr__(self, "secrets", secrets)
        if self.allow and self.network != "allow":
            raise InvalidSpec(f"allow: an allowlist needs network='allow', not {_shown(self.network)}")
        if secrets and self.network != "allow":
            raise InvalidSpec("secrets: placeholders are only swapped by the egress proxy; use network='allow'")
        names = [s.name for s in secrets]
        dupes = sorted({n for n in names if names.count(n) > 1} | (set(names) & set(self.env)))
        if dupes:
            raise InvalidSpec(f"secrets: {', '.join(dupes)} given twice (as secrets, or as secret and env)")

    def to_dict(self) -> dict[str, Any]:
        # what dataclasses.asdict gave, field by field without its deep copy (~25 us a call: the
        # SDK's every create and the server's every answer about a sandbox): each field is a
        # string or is rebuilt below, and Limits' are numbers
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        data["limits"] = {f.name: getattr(self.limits, f.name) for f in fields(self.limits)}
        data["env"] = dict(self.env)
        data["allow"] = list(self.allow)
        data["unsafe_allow_ranges"] = list(self.unsafe_allow_ranges)
        data["secrets"] = [f"{b.name}@{','.join(b.hosts)}" for b in self.secrets]
        if self.workspace is not None:
            data["workspace"] = {"path": str(self.workspace.path), "mode": self.workspace.mode}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SandboxSpec:
        """Build from JSON-like data, rejecting unknown fields by name."""
        if not isinstance(data, Mapping):
            raise InvalidSpec("spec: expected an object")
        known = {"image", "tier", "limits", "workspace", "env", "network", "cwd", "allow", "unsafe_allow_ranges",
                 "secrets", "user"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidSpec(f"spec: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        kwargs: dict[str, Any] = {k: data[k] for k in ("image", "tier", "network", "cwd", "user") if k in data}
        limits = data.get("limits") or {}
        if not isinstance(limits, Mapping):
            raise InvalidSpec("limits: expected an object")
        limit_fields = {"memory", "pids", "cpus", "disk", "timeout", "max_output"}
        bad = sorted(set(limits) - limit_fields)
        if bad:
            raise InvalidSpec(f"limits: unknown field(s) {', '.join(bad)}; known: {', '.join(sorted(limit_fields))}")
        kwargs["limits"] = Limits.build(**limits)
        ws = data.get("workspace")
        if ws is not None:
            if isinstance(ws, str):
                kwargs["workspace"] = Workspace.parse(ws)
            elif isinstance(ws, Mapping) and "path" in ws:
                kwargs["workspace"] = Workspace(Path(str(ws["path"])), str(ws.get("mode", "rw")))
            else:
                raise InvalidSpec("workspace: expected 'DIR[:mode]' or {path, mode}")
        if "env" in data:
            kwargs["env"] = data["env"]
        for name in ("allow", "unsafe_allow_ranges", "secrets"):
            if name in data:
                kwargs[name] = data[name]
        return cls(**kwargs)


def template_key(spec: SandboxSpec) -> str:
    """The identity of a warm-pool template: two specs share a pool iff their keys are equal."""
    import json

    return json.dumps(spec.to_dict(), sort_keys=True, default=str)


def validate_user(user: object, what: str = "user") -> str:
    """``"user"`` (uid 1000 inside) or ``"root"`` (root of the sandbox's user namespace only)."""
    if not isinstance(user, str) or user not in USERS:
        raise InvalidSpec(f"{what}: {_shown(user)}: use one of {', '.join(repr(u) for u in USERS)}")
    return user


#: the longest string exec(2) takes, an argument or a ``NAME=value`` with its NUL (the kernel's
#: MAX_ARG_STRLEN, 32 pages): a longer one fails the command's exec with E2BIG
MAX_ARG_STRLEN = 128 * KiB
#: what an ``env`` may hold in all, its ``NAME=value`` strings with their NULs: half of what exec
#: takes for arguments and environment together (a quarter of the default 8 MiB stack limit), the
#: other half left to the command's argv and a command's own ``env``.  A spec's env is held by the
#: server (and every owner) for the sandbox's life and sent with every command: without a bound,
#: 16 sandboxes of a 30 MiB env grew a server by 541 MiB, and listing them took it 4.7 s
MAX_ENV_BYTES = 1 * MiB
#: variables an ``env`` may name (each costs exec a pointer besides its string)
MAX_ENV_VARS = 4096
#: what a command's argv may hold in all, its strings with their NULs: what exec takes for
#: arguments and environment together at the default 8 MiB stack limit (a quarter of it)
MAX_ARGV_BYTES = 2 * MiB
#: entries of a spec's ``allow``, ``unsafe_allow_ranges`` and ``secrets`` each (held with the spec
#: for the sandbox's life, as its env is)
MAX_NETWORK_ENTRIES = 1024
#: characters an ``allow`` or ``unsafe_allow_ranges`` entry may take as given, spaces included: a
#: host name is at most 253 and a wildcard's ``*.``, an IPv6 address's brackets and a port add a
#: few.  Without a bound, an entry of 30 MiB of spaces before ``example.com`` parsed (it is
#: stripped first) and was held whole: 16 such sandboxes grew a server by 483 MiB (not given back
#: when they were deleted), and a listing of them (480 MiB) took 3.1 s and 367 MiB more
MAX_NETWORK_ENTRY_CHARS = 300


def _network_entry(entry: object, what: str, index: int) -> str:
    """An ``allow`` or ``unsafe_allow_ranges`` entry as the spec holds it: a string of at most
    MAX_NETWORK_ENTRY_CHARS as given, without its surrounding spaces (its parse strips them)."""
    if not isinstance(entry, str):
        raise InvalidSpec(f"{what}[{index}]: expected a string, got {_shown(entry)}")
    if len(entry) > MAX_NETWORK_ENTRY_CHARS:
        raise InvalidSpec(f"{what}[{index}]: {len(entry)} characters, over the {MAX_NETWORK_ENTRY_CHARS} an entry "
                          f"may take (a host name is at most 253): {_shown(entry)}")
    return entry.strip()


def _exec_string_bytes(text: str) -> int:
    """The bytes ``text`` takes in exec's arguments or environment, with its NUL (a lone
    surrogate counts as the three bytes it would be written as)."""
    if len(text) >= MAX_ARG_STRLEN:  # a character is at least a byte: too long whatever it holds
        return len(text) + 1
    return len(text.encode("utf-8", "surrogatepass")) + 1


def validate_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """``env`` as a dict, each name a variable name, each value a string without NUL, and within
    what exec(2) takes: each ``NAME=value`` up to MAX_ARG_STRLEN, at most MAX_ENV_VARS of them and
    MAX_ENV_BYTES in all."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise InvalidSpec("env: expected a mapping of NAME to value")
    if len(env) > MAX_ENV_VARS:
        raise InvalidSpec(f"env: {len(env)} variables, more than the {MAX_ENV_VARS} an environment may hold")
    out: dict[str, str] = {}
    sizes = []
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME_RE.match(key):
            raise InvalidSpec(f"env: {_shown(key)} is not a valid variable name")
        if not isinstance(value, str) or "\0" in value:
            raise InvalidSpec(f"env: value of {key} must be a string without NUL bytes")
        sizes.append((f"{key}=...", len(key) + 1 + _exec_string_bytes(value)))
        out[key] = value
    _within_exec(sizes, MAX_ENV_BYTES, "env", "one variable", "an environment may hold in all",
                 "pass large data as a file")
    return out


def validate_argv(argv: list[str]) -> list[str]:
    """``argv`` within what exec(2) takes: each argument up to MAX_ARG_STRLEN with its NUL,
    MAX_ARGV_BYTES in all (a longer one failed at exec, E2BIG, after it had been sent and held)."""
    _within_exec([(f"argument {number}", _exec_string_bytes(arg)) for number, arg in enumerate(argv)],
                 MAX_ARGV_BYTES, "command", "one argument", "exec takes for them in all",
                 "pass them as a file or on stdin")
    return argv


def _within_exec(sizes: list[tuple[str, int]], most: int, what: str, one: str, all_of: str, instead: str) -> None:
    """Each ``(name, size)`` up to MAX_ARG_STRLEN and all of them up to ``most`` bytes, or InvalidSpec."""
    total = 0
    for name, size in sizes:
        if size > MAX_ARG_STRLEN:
            raise InvalidSpec(f"{what}: {name} is {size} bytes, over the {MAX_ARG_STRLEN} bytes (128 KiB) exec "
                              f"takes for {one} (the kernel's MAX_ARG_STRLEN); {instead}")
        total += size
        if total > most:
            raise InvalidSpec(f"{what}: the strings take over the {most} bytes ({most >> 20} MiB) {all_of}; {instead}")


def parse_env_assignments(items: list[str]) -> dict[str, str]:
    """Parse ``K=V`` strings; ``K`` alone is an error (no implicit host-env copy)."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidSpec(f"--env {_shown(item)}: expected NAME=VALUE (the host environment is never copied)")
        env[key] = value
    return validate_env(env)


def path_bytes(path: str, what: str = "path") -> bytes:
    """The bytes a sandbox path names.  A name that is not UTF-8 is listed as Python's ``os``
    gives it (each such byte as a surrogate U+DC80..U+DCFF, ``surrogateescape``) and names that
    byte again; any other lone surrogate names nothing: :class:`InvalidSpec`."""
    try:
        return path.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise InvalidSpec(f"{what}: {_shown(path)} is not valid Unicode (a lone surrogate that stands for no byte)") from None


def validate_sandbox_path(path: str, what: str = "path") -> str:
    """An in-sandbox path: absolute (relative ones are taken from /workspace), no NUL."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidSpec(f"{what}: {_shown(path)} is not a valid path")
    if len(path_bytes(path, what)) > 4000:
        raise InvalidSpec(f"{what}: path is longer than 4000 bytes")
    return path if path.startswith("/") else os.path.join(WORKSPACE_PATH, path)


def validate_file_mode(mode: int, what: str = "mode") -> int:
    """A mode for a file or directory the files API makes: permission bits and the sticky bit.

    Setuid and setgid are refused rather than dropped: a file the API writes into a workspace may
    reach the host, and a mode that silently came out different would be a surprise either way.
    The sandbox's umask (022) applies, as with open(2) and mkdir(2)."""
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise InvalidSpec(f"{what}: {_shown(mode)} is not a file mode (0 to 0o1777, e.g. 0o644)")
    if mode & 0o6000:
        raise InvalidSpec(f"{what}: {oct(mode)} asks for setuid or setgid, which the files API never sets")
    return mode


def validate_max_bytes(max_bytes: int) -> int:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise InvalidSpec(f"max_bytes: {_shown(max_bytes)} must be a whole number of bytes")
    return max_bytes
