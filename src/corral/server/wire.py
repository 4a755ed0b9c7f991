"""What travels on the wire: request bodies, the error body and its HTTP status, and the
checks every text from a request goes through.

Every error is a JSON object ``{"error": code, "message": text}`` whose code is a
:mod:`corral.errors` code, so the remote SDK raises the same exception the embedded
library would; over the exec stream the same error closes the socket with
``4000 + status``.
"""

from __future__ import annotations

import base64
import json
from typing import Any
from urllib.parse import parse_qsl

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..errors import (
    FileError,
    FileNotFoundInSandbox,
    HostNotSupported,
    InvalidSpec,
    InvalidState,
    ResourceLimit,
    SandboxClosed,
    SandboxError,
    SandboxNotFound,
    SnapshotCorrupt,
    Unauthorized,
)
from ..spec import path_bytes

#: the HTTP status of each error class (the first that matches; anything else is 500)
STATUS: tuple[tuple[type[SandboxError], int], ...] = (
    (Unauthorized, 401), (SandboxNotFound, 404), (FileNotFoundInSandbox, 404), (InvalidSpec, 400),
    (ResourceLimit, 429), (SandboxClosed, 410), (FileError, 400), (HostNotSupported, 503),
    (InvalidState, 409), (SnapshotCorrupt, 422),
)


def status_for(exc: SandboxError) -> int:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500


#: seconds a client should wait before retrying: a quota frees up as sandboxes end (429); a
#: host that cannot run a tier now may after its operator acts (503)
RETRY_AFTER = {429: "1", 503: "5"}


def error_response(status: int, code: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    if status in RETRY_AFTER:
        headers["Retry-After"] = RETRY_AFTER[status]
    return JSONResponse({"error": code, "message": message}, status_code=status, headers=headers or None)


#: why JSON nested thousands deep is refused: Python's parser recurses once per level, and past
#: ~900 levels (fewer on a deep stack) it raises RecursionError, which the fast routes and the
#: exec stream answered 500 / by dropping the connection
JSON_TOO_DEEP = "JSON nested too deep to parse (a request nests a few levels; this one thousands)"


def parse_json(data: str | bytes, where: str = "body") -> Any:
    """JSON from a client: ``json.loads``, but nesting too deep to parse is :class:`InvalidSpec`
    (400) naming ``where``; malformed JSON is a ``ValueError`` as from ``json.loads``."""
    try:
        return json.loads(data)
    except RecursionError:
        raise InvalidSpec(f"{where}: {JSON_TOO_DEEP}") from None


# -- request bodies (unknown fields are refused by name) -----------------------
class CreateSandbox(BaseModel):
    """A sandbox spec (as ``SandboxSpec.from_dict``) plus its lifetimes."""

    model_config = ConfigDict(extra="allow")
    image: str | None = None
    tier: str | None = None
    limits: dict[str, int | float | str] | None = None
    env: dict[str, str] | None = None
    network: Any = None
    cwd: str | None = None
    user: str | None = Field(None, description="who commands run as: 'user' (uid 1000, the default) or 'root' "
                             "(root of the sandbox's own user namespace; process and gVisor tiers)")
    # strict numbers: "5" and true were taken for 5 and 1 (the library refuses both)
    idle_timeout: float | None = Field(None, strict=True, description="seconds without use before the sandbox is destroyed")
    lifetime: float | None = Field(None, strict=True, description="seconds from creation before the sandbox is destroyed")
    metadata: dict[str, str] | None = Field(None, description="your labels; Sandbox.list(metadata=) filters by them")
    snapshot: str | None = Field(None, description="start from this snapshot of yours (its tier, image and files)")


class PauseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to_disk: bool = Field(False, description="save the live state to disk and release the sandbox's memory "
                                             "(microvm); it survives a server restart")


class ForkBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int = Field(1, ge=1, le=64, strict=True, description="how many sandboxes to make from the sandbox's files")


class ExecBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cmd: str | list[str]
    timeout: float | None = Field(None, strict=True)
    env: dict[str, str] | None = None
    cwd: str | None = None
    user: str | None = Field(None, description="'root' or 'user' for this command (default: the sandbox's user)")
    stdin: str | None = None
    stdin_b64: str | None = Field(None, description="stdin as base64, for bytes that are not UTF-8")

    def stdin_bytes(self) -> bytes | None:
        if self.stdin is not None and self.stdin_b64 is not None:
            raise InvalidSpec("stdin and stdin_b64: give one")
        if self.stdin_b64 is not None:
            try:
                return base64.b64decode(self.stdin_b64, validate=True)
            except ValueError:  # binascii.Error, and non-ASCII text (which b64decode refuses first)
                raise InvalidSpec("stdin_b64: not base64") from None
        return self.stdin.encode() if self.stdin is not None else None


class CodeBody(BaseModel):
    """A code cell for the sandbox's interpreter (``POST /v1/sandboxes/{id}/code``)."""

    model_config = ConfigDict(extra="forbid")
    code: str
    language: str | None = Field(None, description="python (default) or javascript; a context's own if omitted")
    timeout: float | None = Field(None, strict=True, description="seconds before the cell is interrupted")
    context: str | None = Field(None, description="a code context made by POST .../contexts (default: the "
                                "sandbox's interpreter for the language)")
    envs: dict[str, str] | None = Field(None, description="environment variables for this cell only")


class ContextBody(BaseModel):
    """A new code context (``POST /v1/sandboxes/{id}/contexts``): an interpreter with its own variables."""

    model_config = ConfigDict(extra="forbid")
    language: str = "python"
    cwd: str | None = None


class SignalBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    signal: int = Field(ge=1, le=64, strict=True)


class StreamExecBody(ExecBody):
    """The exec stream's first frame: an exec request, optionally on a terminal of ``pty=[rows, cols]``."""

    pty: tuple[int, int] | None = None
    #: the client keeps its stdin within the server's window, acknowledged frame by frame
    #: (server/stream.py); without it the stream is as before acks existed
    stdin_acks: bool = False


class TimeoutBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(strict=True, description="seconds from now until the sandbox is destroyed")


# -- checks on what a request carries ---------------------------------------------
def require_unicode(value: Any, where: str = "body") -> None:
    """JSON may carry lone surrogates ("\\ud800"); no argv, environment, path or answer can hold them."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise InvalidSpec(f"{where}: text is not valid Unicode (a lone surrogate)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            require_unicode(key, where)
            require_unicode(item, f"{where}.{key}" if isinstance(key, str) and key.isprintable() else where)
    elif isinstance(value, (list, tuple)):
        for item in value:
            require_unicode(item, where)


def checked_path(path: str) -> str:
    """A sandbox path from a request: no NUL, no '..' component (nothing may walk out of where it
    names).  Bytes that are not UTF-8 (from ``path_b64``) are surrogates, as Python's ``os`` has them."""
    if not path or "\0" in path:
        raise InvalidSpec("path: must be a non-empty path without NUL bytes")
    if ".." in path.split("/"):
        raise InvalidSpec(f"path {path!r}: '..' components are not allowed")
    if len(path_bytes(path)) > 4000:
        raise InvalidSpec("path: longer than 4000 bytes")
    return path


def path_of_query(query_string: bytes, path: str | None, path_b64: str | None, default: str | None = None) -> str:
    """The sandbox path a request's query names: ``path`` (text), or ``path_b64`` (its bytes,
    base64: a name that is not UTF-8).  A ``%``-escape that is not UTF-8 is refused by name (it
    was taken as U+FFFD, and a file of that other name was written)."""
    try:
        parse_qsl(query_string.decode("latin-1"), keep_blank_values=True, errors="strict")
    except UnicodeDecodeError:
        raise InvalidSpec("query: a %-escape is not UTF-8; send a path that is not UTF-8 as path_b64 "
                          "(its bytes, base64)") from None
    if path is not None and path_b64 is not None:
        raise InvalidSpec("path and path_b64: give one")
    if path_b64 is not None:
        try:
            path = base64.b64decode(path_b64, validate=True).decode("utf-8", "surrogateescape")
        except ValueError:
            raise InvalidSpec("path_b64: not base64") from None
    if path is None:
        if default is None:
            raise InvalidSpec("path: required (or path_b64)")
        path = default
    return checked_path(path)


# -- output frames -------------------------------------------------------------------
def _complete_upto(data: bytes) -> int:
    """Where a UTF-8 character cut off at the end of ``data`` starts (``len(data)`` if none is)."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the last character's first byte
            need = 2 if 0xC0 <= byte < 0xE0 else 3 if 0xE0 <= byte < 0xF0 else 4 if 0xF0 <= byte < 0xF8 else 1
            return len(data) - back if need > back else len(data)
    return len(data)


class OutputFrames:
    """A command's output as frames of the exec stream and of an attached background command.

    ``data`` is the output as text.  A chunk that is not UTF-8 also carries its exact bytes in
    ``data_b64`` (its ``data`` then has U+FFFD in their place, as every frame had before): a
    client that reads ``data`` gets text as ever, one that wants the bytes gets them whole (they
    came as ~2x as many U+FFFD bytes).  A character cut between two chunks is held for the next,
    so text split anywhere is never taken for bytes that are not UTF-8."""

    def __init__(self) -> None:
        self._held = {"stdout": b"", "stderr": b""}

    def frame(self, stream: str, chunk: bytes) -> dict[str, str] | None:
        data = self._held[stream] + chunk
        cut = _complete_upto(data)
        self._held[stream] = data[cut:]
        return self._frame(stream, data[:cut])

    def flush(self) -> list[dict[str, str]]:
        """What is held (the start of a character the command never finished), as frames."""
        held, self._held = self._held, {"stdout": b"", "stderr": b""}
        return [frame for stream, data in held.items() if (frame := self._frame(stream, data))]

    @staticmethod
    def _frame(stream: str, data: bytes) -> dict[str, str] | None:
        if not data:
            return None
        try:
            return {"type": stream, "data": data.decode()}
        except UnicodeDecodeError:
            return {"type": stream, "data": data.decode(errors="replace"), "data_b64": base64.b64encode(data).decode()}
