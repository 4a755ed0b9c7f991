"""Background commands of a server's sandbox, by pid (the remote side of ``commands.run(background=True)``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import SandboxClosed, error_from_code
from .tiers.base import ExecResult

if TYPE_CHECKING:
    from .client import Client


class RemoteBackgroundHandle:
    """A command running in the background on the server: the same methods as ``CommandHandle``."""

    def __init__(self, client: Client, sandbox_path: str, sandbox_id: str, pid: int) -> None:
        self._client = client
        self._path = f"{sandbox_path}/commands/{pid}"
        self._sandbox_id = sandbox_id
        self.pid = pid
        self._result: ExecResult | None = None

    def send_stdin(self, data: str | bytes) -> None:
        self._client.request("POST", f"{self._path}/stdin", content=data.encode() if isinstance(data, str) else data,
                             headers={"content-type": "application/octet-stream"})

    def kill(self) -> bool:
        """Kill it (its whole tree); False if it had already ended."""
        from .errors import SandboxNotFound

        try:
            self._client.request("DELETE", self._path)
            return True
        except SandboxNotFound:
            return False

    @property
    def done(self) -> bool:
        return self._result is not None

    def wait(self, on_output: Callable[[str, bytes], None] | None = None) -> ExecResult:
        """Attach, get what it printed so far and then as it comes (to ``on_output``), and its result."""
        if self._result is not None:
            return self._result
        from websockets.sync.client import connect

        with connect(self._client.ws_url(f"{self._path}/stream"), additional_headers=self._client.headers,
                     max_size=None) as ws:
            for raw in ws:
                frame: dict[str, Any] = json.loads(raw)
                kind = frame.get("type")
                if kind in ("stdout", "stderr") and on_output is not None:
                    on_output(kind, frame["data"].encode())
                elif kind == "result":
                    frame.pop("type")
                    frame.pop("sandbox_id", None)
                    self._result = ExecResult(**frame)
                    return self._result
                elif kind == "error":
                    raise error_from_code(frame.get("error", ""), frame.get("message", ""), self._sandbox_id)
        raise SandboxClosed("the command's stream ended without a result", sandbox_id=self._sandbox_id)
