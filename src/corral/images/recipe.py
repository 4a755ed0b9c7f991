"""Image recipes: what goes into an image, read from TOML and validated.

A recipe names a Debian suite and lists apt packages, pip packages, npm
packages, files to copy in and commands to run at build time::

    name = "python-data"
    extends = "base"            # merge another recipe's lists into this one
    suite = "bookworm"
    apt = ["python3-pandas"]
    pip = ["tabulate==0.9.0"]   # wheels only, fetched on the host, installed offline
    npm = ["left-pad@1.3.0"]    # fetched on the host with --ignore-scripts
    run = ["python3 -c 'import pandas'"]
    [[files]]
    src = "motd.txt"            # relative to the recipe file
    dest = "/etc/motd"
    mode = "0644"

``from = "NAME"`` instead starts from an already built image (an overlay on
its root, materialized with hard links) and adds to it — apt packages too
(downloaded on the host against the parent's package database, installed with
dpkg inside the build sandbox); it keeps the parent's suite and mirror.

The digest is a hash of everything that defines the image (the recipe's
content, the content of every file it names, the parent's digest and the
builder version), never of its name: two names for one recipe share one
image, and any change to a named file makes a new image.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import InvalidSpec

#: bump when the builder's output for an unchanged recipe changes
BUILDER_VERSION = "1"
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
SUITES = ("bookworm", "trixie", "bullseye")

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
_APT_RE = re.compile(r"^[a-z0-9][a-z0-9.+-]*(:[a-z0-9]+)?(=[A-Za-z0-9.+:~-]+)?\Z")
_PIP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?\s*([<>=!~]=?\s*[A-Za-z0-9.*+!-]+\s*,?\s*)*\Z")
_NPM_RE = re.compile(r"^(@[a-z0-9._-]+/)?[a-z0-9._-]+(@[A-Za-z0-9.^~<>=*|+ -]+)?\Z")
_KEYS = {"name", "description", "extends", "from", "suite", "mirror", "apt", "pip", "npm", "files", "run",
         "build_timeout", "build_memory"}


@dataclass(frozen=True)
class FileCopy:
    src: Path
    dest: str
    mode: int | None = None


@dataclass(frozen=True)
class Recipe:
    name: str
    source: Path | None = None
    description: str = ""
    suite: str = DEFAULT_SUITE
    mirror: str = DEFAULT_MIRROR
    base_image: str | None = None
    apt: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()
    npm: tuple[str, ...] = ()
    files: tuple[FileCopy, ...] = ()
    run: tuple[str, ...] = ()
    #: seconds allowed for each build step
    build_timeout: float = 1800.0
    build_memory: str = "2G"

    def digest(self, parent_digest: str = "") -> str:
        """sha256 over everything that defines the image (name excluded)."""
        if self.base_image and not parent_digest:
            raise InvalidSpec(f"recipe {self.name!r}: the digest of image {self.base_image!r} is needed")
        payload = {
            "builder": BUILDER_VERSION,
            "suite": self.suite,
            "mirror": self.mirror,
            "from": parent_digest,
            "apt": sorted(set(self.apt)),
            "pip": list(self.pip),
            "npm": list(self.npm),
            "files": [{"dest": f.dest, "mode": f.mode, "content": _content_hash(f.src)} for f in self.files],
            "run": list(self.run),
        }
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()


def _content_hash(path: Path) -> str:
    """Hash of a file, or of a directory tree (names, modes, contents, symlink targets)."""
    h = hashlib.sha256()
    if path.is_symlink() or path.is_file():
        entries = [(path, "")]
    else:
        entries = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                full = Path(dirpath) / name
                entries.append((full, str(full.relative_to(path))))
    for full, rel in entries:
        h.update(rel.encode() + b"\0")
        if full.is_symlink():
            h.update(b"L" + os.readlink(full).encode() + b"\0")
            continue
        h.update(b"F%o\0" % (full.stat().st_mode & 0o7777))
        with open(full, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def builtin_names() -> list[str]:
    folder = resources.files("corral.images") / "recipes"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def builtin_path(name: str) -> Path | None:
    path = Path(str(resources.files("corral.images") / "recipes" / f"{name}.toml"))
    return path if path.is_file() else None


def load(ref: str | Path) -> Recipe:
    """A recipe from a built-in name (``base``) or a path to a TOML file."""
    text_ref = str(ref)
    if text_ref.endswith(".toml") or "/" in text_ref:
        return load_file(Path(text_ref))
    path = builtin_path(text_ref)
    if path is None:
        raise InvalidSpec(
            f"no built-in recipe {text_ref!r} (built-in: {', '.join(builtin_names())}); "
            "pass a path to a .toml file for your own"
        )
    return load_file(path)


def load_file(path: Path, _seen: tuple[Path, ...] = ()) -> Recipe:
    path = path.resolve()
    if path in _seen:
        raise InvalidSpec(f"recipe {path}: 'extends' loops back to itself")
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidSpec(f"recipe file {path} does not exist")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidSpec(f"recipe file {path} cannot be read: {exc}")
    except tomllib.TOMLDecodeError as exc:
        raise InvalidSpec(f"recipe {path} is not valid TOML: {exc}")
    return parse(data, path, (*_seen, path))


def parse(data: dict[str, Any], source: Path | None = None, _seen: tuple[Path, ...] = ()) -> Recipe:
    where = f"recipe {source}" if source else "recipe"
    unknown = set(data) - _KEYS
    if unknown:
        raise InvalidSpec(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
    default_name = source.stem if source else ""
    name = _string(data, "name", where, default_name)
    if not _NAME_RE.match(name):
        raise InvalidSpec(f"{where}: name {name!r} must be 1-64 of a-z 0-9 . _ - (starting with a letter or digit)")
    parent: Recipe | None = None
    if "extends" in data:
        ref = _string(data, "extends", where, "")
        base_dir = source.parent if source else Path.cwd()
        candidate = base_dir / ref if ref.endswith(".toml") else builtin_path(ref)
        if candidate is None:
            raise InvalidSpec(f"{where}: extends {ref!r}: no such built-in recipe or .toml file")
        parent = load_file(candidate, _seen)
    base_image = data.get("from")
    if base_image is not None:
        if parent is not None:
            raise InvalidSpec(f"{where}: use either 'extends' (merge a recipe) or 'from' (start from an image)")
        if not isinstance(base_image, str) or not _NAME_RE.match(base_image):
            raise InvalidSpec(f"{where}: from = {base_image!r} must name a built image")
        if "suite" in data or "mirror" in data:
            raise InvalidSpec(f"{where}: an image built 'from' another keeps its suite and mirror; "
                              "use 'extends' to merge recipes instead")
    suite = _string(data, "suite", where, parent.suite if parent else DEFAULT_SUITE)
    if suite not in SUITES:
        raise InvalidSpec(f"{where}: suite {suite!r} is not supported; use one of {', '.join(SUITES)}")
    mirror = _string(data, "mirror", where, parent.mirror if parent else DEFAULT_MIRROR)
    if not re.match(r"^https?://[A-Za-z0-9.-]+(:\d+)?(/[A-Za-z0-9._~/-]*)?$", mirror):
        raise InvalidSpec(f"{where}: mirror {mirror!r} must be an http(s) URL")
    apt = _strings(data, "apt", where, _APT_RE, "a Debian package name (optionally =version)")
    pip = _strings(data, "pip", where, _PIP_RE, "a pip requirement such as requests==2.32.3")
    npm = _strings(data, "npm", where, _NPM_RE, "an npm package such as left-pad@1.3.0")
    run = _strings(data, "run", where, None, "a shell command")
    files = _files(data.get("files", []), source, where)
    timeout = data.get("build_timeout", parent.build_timeout if parent else 1800.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
        raise InvalidSpec(f"{where}: build_timeout {timeout!r} must be seconds in (0, 86400]")
    memory = data.get("build_memory", parent.build_memory if parent else "2G")
    if not isinstance(memory, str):
        raise InvalidSpec(f"{where}: build_memory must be a size string such as '2G'")
    if parent is not None:
        apt, pip, npm = parent.apt + apt, parent.pip + pip, parent.npm + npm
        files, run = parent.files + files, parent.run + run
    return Recipe(
        name=name, source=source, description=_string(data, "description", where, ""), suite=suite,
        mirror=mirror, base_image=base_image, apt=tuple(dict.fromkeys(apt)), pip=pip, npm=npm,
        files=files, run=run, build_timeout=float(timeout), build_memory=memory,
    )


def _string(data: dict[str, Any], key: str, where: str, default: str) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise InvalidSpec(f"{where}: {key} must be a string, got {value!r}")
    return value


def _strings(data: dict[str, Any], key: str, where: str, pattern: re.Pattern[str] | None,
             what: str) -> tuple[str, ...]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise InvalidSpec(f"{where}: {key} must be a list of non-empty strings")
    for item in value:
        if "\0" in item or (pattern is not None and not pattern.match(item)):
            raise InvalidSpec(f"{where}: {key}: {item!r} is not {what}")
    return tuple(value)


def _check_source(path: Path, base: Path, src: str, where: str) -> None:
    """A ``files`` source is a regular file or a directory of regular files, directories and
    symlinks, inside the recipe's own directory (its build context, as Docker's ``COPY``): a
    recipe's ``../../etc/shadow``, or a link to it, put the host's file in an image every tenant's
    root could read; ``/dev/zero`` filled the image store; a fifo hung the build's hashing."""
    if not path.is_relative_to(base):
        raise InvalidSpec(f"{where}: files src {src!r} leads to {path}, outside the recipe's directory {base}")
    mode = path.stat().st_mode
    if stat.S_ISREG(mode):
        return
    if not stat.S_ISDIR(mode):
        raise InvalidSpec(f"{where}: files src {src!r} is not a regular file or a directory")
    for dirpath, dirnames, filenames in os.walk(path):
        for name in (*dirnames, *filenames):
            entry = os.lstat(os.path.join(dirpath, name))
            if not (stat.S_ISREG(entry.st_mode) or stat.S_ISDIR(entry.st_mode) or stat.S_ISLNK(entry.st_mode)):
                raise InvalidSpec(f"{where}: files src {src!r} holds {os.path.join(dirpath, name)}, which is "
                                  "not a regular file, a directory or a symlink")


def _files(value: Any, source: Path | None, where: str) -> tuple[FileCopy, ...]:
    if not isinstance(value, list):
        raise InvalidSpec(f"{where}: files must be a list of tables with src, dest and optional mode")
    base = source.parent if source else Path.cwd()
    out = []
    for entry in value:
        if not isinstance(entry, dict) or set(entry) - {"src", "dest", "mode"} or not {"src", "dest"} <= set(entry):
            raise InvalidSpec(f"{where}: each files entry needs src and dest (and optional mode), got {entry!r}")
        src, dest, mode = entry["src"], entry["dest"], entry.get("mode")
        if not isinstance(src, str) or not isinstance(dest, str):
            raise InvalidSpec(f"{where}: files src and dest must be strings")
        if not dest.startswith("/") or ".." in dest.split("/") or "\0" in dest or dest.rstrip("/") == "":
            raise InvalidSpec(f"{where}: files dest {dest!r} must be an absolute path inside the image (not /)")
        path = (base / src).resolve()
        if not path.exists():
            raise InvalidSpec(f"{where}: files src {src!r} does not exist (looked at {path})")
        _check_source(path, base.resolve(), src, where)
        parsed_mode: int | None = None
        if mode is not None:
            try:
                parsed_mode = int(mode, 8) if isinstance(mode, str) else None
            except ValueError:
                parsed_mode = None
            if parsed_mode is None or not 0 <= parsed_mode <= 0o777:
                raise InvalidSpec(f"{where}: files mode {mode!r} must be an octal string such as '0644'")
        out.append(FileCopy(path, dest, parsed_mode))
    return tuple(out)
