"""Secrets the sandbox uses but never holds.

``--secret NAME@host1,host2`` binds the caller's secret ``NAME`` to those hosts.
Inside the sandbox ``NAME`` holds a random placeholder unique to that sandbox;
the egress proxy swaps the placeholder for the real value in request headers
sent to a bound host, and only there.  The real value lives in the owner's
memory (never in a spec, an argv, the registry or the sandbox), and any output
or file read back that contains it is redacted as ``[REDACTED:NAME]``.
"""

from __future__ import annotations

import os
import re
import secrets as _random
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidSpec, quoted

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_HOST_RE = re.compile(r"^(\*\.)?[a-z0-9_][a-z0-9_.-]*\Z")
PLACEHOLDER_PREFIX = "corral-placeholder-"
#: a binding is held with its spec for the sandbox's life: its name, each host and their number are
#: bounded (a host name is at most 253 characters; spaces around one are stripped)
MAX_SECRET_NAME = 256
MAX_SECRET_HOST = 300
MAX_SECRET_HOSTS = 64
#: the most ``NAME@host1,host2`` text a binding may be parsed from (checked before it is split)
MAX_SECRET_TEXT = MAX_SECRET_NAME + 1 + MAX_SECRET_HOSTS * (MAX_SECRET_HOST + 1)


@dataclass(frozen=True)
class SecretBinding:
    """A secret's name and the hosts its real value may be sent to (no value here)."""

    name: str
    hosts: tuple[str, ...]

    def __post_init__(self) -> None:
        if (not isinstance(self.name, str) or len(self.name) > MAX_SECRET_NAME
                or not _NAME_RE.match(self.name)):
            raise InvalidSpec(f"secret {quoted(str(self.name))}: the name must be an environment variable name "
                              f"of at most {MAX_SECRET_NAME} characters")
        if len(self.hosts) > MAX_SECRET_HOSTS:
            raise InvalidSpec(f"secret {self.name}: {len(self.hosts)} hosts, more than the {MAX_SECRET_HOSTS} "
                              "a binding may name (a *.domain covers many)")
        for host in self.hosts:
            if not isinstance(host, str) or len(host) > MAX_SECRET_HOST:
                raise InvalidSpec(f"secret {self.name}: {quoted(str(host))} is not a host name of at most "
                                  f"{MAX_SECRET_HOST} characters")
        hosts = tuple(h.strip().lower().rstrip(".") for h in self.hosts)
        if not hosts:
            raise InvalidSpec(f"secret {self.name}: bind it to at least one host (NAME@host1,host2)")
        for host in hosts:
            if not _HOST_RE.match(host) or "*" in host[1:] or len(host) > 253:
                raise InvalidSpec(f"secret {self.name}: {host!r} is not a host name or *.domain wildcard")
        object.__setattr__(self, "hosts", hosts)

    @classmethod
    def parse(cls, text: str) -> SecretBinding:
        """``NAME@host1,host2``; the value is never part of the text."""
        text = str(text)
        if len(text) > MAX_SECRET_TEXT:  # before it is split: 32 MiB of "h," made 16 million strings
            raise InvalidSpec(f"secret {quoted(text.split('@', 1)[0])}: {len(text)} characters, over the "
                              f"{MAX_SECRET_TEXT} a NAME@host1,host2 binding may take")
        name, sep, hosts = text.partition("@")
        if not sep or "=" in name:
            raise InvalidSpec(
                f"secret {quoted(text.split('=', 1)[0])}: expected NAME@host1,host2; the value comes from the "
                "environment or a secrets file, never from the command line"
            )
        return cls(name, tuple(h for h in hosts.split(",") if h))

    def bound_to(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == h or (h.startswith("*.") and host.endswith(h[1:])) for h in self.hosts)


def read_secrets_file(path: str | Path) -> dict[str, str]:
    """``NAME=VALUE`` lines (``#`` comments, blank lines ignored). The file must not be world-readable."""
    path = Path(path)
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise InvalidSpec(f"secrets file {str(path)!r}: {exc.strerror or exc}") from None
    if st.st_mode & 0o004:
        raise InvalidSpec(f"secrets file {str(path)!r} is world-readable; chmod o-r it first")
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not _NAME_RE.match(key.strip()):
            raise InvalidSpec(f"secrets file {str(path)!r} line {number}: expected NAME=VALUE")
        values[key.strip()] = value.strip()
    return values


@dataclass(frozen=True)
class Secret:
    """A bound secret with its real value and this sandbox's placeholder."""

    binding: SecretBinding
    value: str
    placeholder: str

    @property
    def name(self) -> str:
        return self.binding.name


def materialize(bindings: Iterable[SecretBinding], values: Mapping[str, str] | None = None,
                secrets_file: str | Path | None = None) -> list[Secret]:
    """Look each secret's value up (explicit values, then the file, then the caller's environment)
    and give it a fresh placeholder."""
    from_file = read_secrets_file(secrets_file) if secrets_file else {}
    out: list[Secret] = []
    for binding in bindings:
        value = (values or {}).get(binding.name)
        if value is None:
            value = from_file.get(binding.name)
        if value is None:
            value = os.environ.get(binding.name)
        if not value:
            where = "the secrets file or " if secrets_file else ""
            raise InvalidSpec(f"secret {binding.name}: no value found in {where}the caller's environment")
        if len(value) < 4:
            raise InvalidSpec(f"secret {binding.name}: values shorter than 4 characters cannot be redacted safely")
        if "\r" in value or "\n" in value:
            raise InvalidSpec(f"secret {binding.name}: the value cannot contain line breaks")
        out.append(Secret(binding, value, PLACEHOLDER_PREFIX + _random.token_hex(16)))
    return out


class Redactor:
    """Replaces every real secret value by ``[REDACTED:NAME]`` in bytes.

    ``same_length=True`` masks with ``*`` instead, keeping byte counts (and so HTTP
    framing) intact: used on responses flowing back into the sandbox."""

    def __init__(self, secrets: Iterable[Secret], same_length: bool = False) -> None:
        # longest first, so a value containing another is replaced whole
        self._pairs = sorted(
            ((s.value.encode(), b"*" * len(s.value.encode()) if same_length else f"[REDACTED:{s.name}]".encode())
             for s in secrets),
            key=lambda p: -len(p[0]),
        )

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def redact(self, data: bytes) -> bytes:
        for value, mark in self._pairs:
            if value in data:
                data = data.replace(value, mark)
        return data

    def partial_tail(self, data: bytes) -> int:
        """Length of the longest end of ``data`` that could be the start of a value (to hold back)."""
        longest = 0
        for value, _ in self._pairs:
            for k in range(min(len(value) - 1, len(data)), longest, -1):
                if data.endswith(value[:k]):
                    longest = k
                    break
        return longest

    def redact_text(self, text: str) -> str:
        if not self._pairs:
            return text
        return self.redact(text.encode("utf-8", "surrogateescape")).decode("utf-8", "surrogateescape")


class StreamRedactor:
    """Redacts output as it streams, across chunk boundaries: an end of a chunk that could begin a
    value is held back until the next chunk (or :meth:`flush`) shows whether it does."""

    def __init__(self, redactor: Redactor, emit: Callable[[str, bytes], None]) -> None:
        self._redactor = redactor
        self._emit = emit
        self._held: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def feed(self, stream: str, chunk: bytes) -> None:
        with self._lock:
            data = self._redactor.redact(self._held.pop(stream, b"") + chunk)
            keep = self._redactor.partial_tail(data)
            if keep:
                self._held[stream] = data[-keep:]
                data = data[:-keep]
        if data:
            self._emit(stream, data)

    def flush(self) -> None:
        with self._lock:
            held, self._held = self._held, {}
        for stream, data in held.items():
            if data:
                self._emit(stream, data)
