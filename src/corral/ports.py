"""``sandbox.ports``: reach a port the sandbox listens on from the host.

    with Sandbox.create(image="browser") as sb:
        sb.commands.start("chromium --headless --no-sandbox --remote-debugging-port=9222 about:blank")
        port = sb.ports.expose(9222)          # ExposedPort(host='127.0.0.1', port=41234, url=...)
        urllib.request.urlopen(port.url + "json/version")

The forward goes through Corral's host side (see :mod:`corral.host.portfwd`):
the sandbox's network stays what its mode made it, ``none`` included.  A
forward lives until :meth:`Ports.close` or the sandbox is destroyed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .host.portfwd import PortForward
    from .sandbox import Sandbox


@dataclass(frozen=True)
class ExposedPort:
    """Where the host reaches a sandbox's port: ``host:port`` (TCP on 127.0.0.1) or ``unix_socket``."""

    #: the port inside the sandbox
    sandbox_port: int
    #: "127.0.0.1", or "" for a Unix socket
    host: str
    #: the host's TCP port (0 for a Unix socket)
    port: int
    #: ``http://127.0.0.1:PORT/``, or ``http+unix://<escaped path>/`` for a Unix socket
    url: str
    #: the Unix socket's path (0600, root's), or None
    unix_socket: str | None = None

    @classmethod
    def of(cls, forward: PortForward) -> ExposedPort:
        path = str(forward.unix_path) if forward.unix_path is not None else None
        return cls(forward.sandbox_port, forward.host, forward.port, forward.url, path)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Ports:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox
        self._forwards: list[tuple[ExposedPort, Callable[[], None]]] = []

    def expose(self, port: int, *, unix_socket: bool = False) -> ExposedPort:
        """Forward a new listener on the host (TCP on 127.0.0.1, or a 0600 Unix socket in the
        sandbox's run directory with ``unix_socket=True``) into ``port`` on the sandbox's loopback.
        Each connection is made when a client connects: the port need not be listening yet."""
        exposed = self._sb._backend.expose_port(port, unix_socket)
        self._forwards.append(exposed)
        return exposed[0]

    def list(self) -> list[ExposedPort]:
        return [exposed for exposed, _ in self._forwards]

    def close(self, exposed: ExposedPort) -> None:
        """Close one forward (its relayed connections are cut)."""
        for entry in list(self._forwards):
            if entry[0] == exposed:
                entry[1]()
                self._forwards.remove(entry)
