"""``sandbox.ports``: reach a port the sandbox listens on from the host.

    with Sandbox.create(image="browser") as sb:
        sb.commands.start("chromium --headless --no-sandbox --remote-debugging-port=9222 about:blank")
        port = sb.ports.expose(9222)          # ExposedPort(host='127.0.0.1', port=41234, url=...)
        urllib.request.urlopen(port.url + "json/version")

The forward goes through Corral's host side (see :mod:`corral.host.portfwd`):
the sandbox's network stays what its mode made it, ``none`` included.  A
forward lives until :meth:`Ports.close` or the sandbox is destroyed.

Loopback TCP is open to every user of the host, so a TCP forward relays only
connections made by this process's user and root (the kernel is asked whose
each connecting socket is); ``local_users=["alice"]`` lets more users in, for
example a desktop browser that is not run as root.  Anyone else's connection
is closed before anything reaches the sandbox.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    #: where a browser shows it on an origin of its own: a TCP forward's ``url``; a keyless loopback
    #: server's ``http://PORT-ID.localhost:SERVERPORT/`` (its ``url`` serves the port's pages
    #: sandboxed, on the server's origin); None for a Unix socket or a server with keys
    browser_url: str | None = None

    @classmethod
    def of(cls, forward: PortForward) -> ExposedPort:
        path = str(forward.unix_path) if forward.unix_path is not None else None
        return cls(forward.sandbox_port, forward.host, forward.port, forward.url, path,
                   None if path is not None else forward.url)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def other_uids(local_users: Sequence[str | int], what: str = "local_users") -> tuple[int, ...]:
    """``local_users`` of :meth:`Ports.expose` as uids (InvalidSpec naming ``what`` for one this host lacks)."""
    from .errors import InvalidSpec
    from .host.peers import local_uid

    if isinstance(local_users, (str, int)):
        raise InvalidSpec(f"{what}: {local_users!r} must be a list of user names or uids")
    return tuple(local_uid(user, what) for user in local_users)


class Ports:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox
        self._forwards: list[tuple[ExposedPort, Callable[[], None]]] = []

    def expose(self, port: int, *, unix_socket: bool = False, local_users: Sequence[str | int] = ()) -> ExposedPort:
        """Forward a new listener on the host (TCP on 127.0.0.1, or a 0600 Unix socket in the
        sandbox's run directory with ``unix_socket=True``) into ``port`` on the sandbox's loopback.
        Each connection is made when a client connects: the port need not be listening yet.
        Only this process's user and root connect, and the ``local_users`` (names or uids)."""
        exposed = self._sb._backend.expose_port(port, unix_socket, other_uids(local_users))
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
