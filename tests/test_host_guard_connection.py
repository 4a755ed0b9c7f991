"""A keyless server asks the kernel whose socket a connection is once per connection, not once per
request (``host_guard.PeerOfConnection``), and is as strict as before: another user's connection
is refused at every request, this user's is served at every one, and a connection only a served
user could have handed over (root ``fchown``-ing its socket) is its to give, as passing the socket
itself always was."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral.server import host_guard
from corral.server.host_guard import LoopbackCallersOnly

from .server_fixtures import ServerProcess, as_user


@pytest.fixture(scope="module")
def keyless(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-guard-connection") as srv:
        yield srv


def _listing(port: int) -> bytes:
    return f"GET /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()


def _statuses(sock: socket.socket, request: bytes, count: int) -> list[int]:
    """The statuses of ``count`` requests sent one after another on the kept-alive ``sock``."""
    statuses = []
    reader = sock.makefile("rb")
    for _ in range(count):
        sock.sendall(request)
        status = int(reader.readline().split()[1])
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        reader.read(length)
        statuses.append(status)
    return statuses


def test_another_users_connection_is_refused_at_every_request_and_this_users_served(keyless: ServerProcess) -> None:
    def three_on_one_connection() -> bytes:
        with socket.create_connection(("127.0.0.1", keyless.port), timeout=10) as sock:
            return " ".join(map(str, _statuses(sock, _listing(keyless.port), 3))).encode()

    assert as_user(65534, three_on_one_connection) == b"403 403 403"
    assert as_user(1000, three_on_one_connection) == b"403 403 403"
    assert three_on_one_connection() == b"200 200 200"  # root (the server's own user here)


def test_a_served_connection_is_its_owners_to_hand_over(keyless: ServerProcess) -> None:
    """Root's connection, served, then chowned to another user: still served (its requests come from
    the socket that was checked; root could as well have passed the socket on unchanged, which was
    always served). A connection made by that user is refused, as before."""
    with socket.create_connection(("127.0.0.1", keyless.port), timeout=10) as sock:
        assert _statuses(sock, _listing(keyless.port), 1) == [200]
        os.fchown(sock.fileno(), 65534, 65534)  # the kernel now says the socket is uid 65534's
        assert _statuses(sock, _listing(keyless.port), 2) == [200, 200]
    with socket.create_connection(("127.0.0.1", keyless.port), timeout=10) as sock:
        os.fchown(sock.fileno(), 65534, 65534)  # before any request: checked, and refused
        assert _statuses(sock, _listing(keyless.port), 2) == [403, 403]


class _Lookups:
    """A stand-in for the kernel's answer (``tcp_peer_uid``) that counts the questions."""

    def __init__(self, uid: int) -> None:
        self.uid = uid
        self.asked = 0

    def __call__(self, client: tuple[str, int], server: tuple[str, int]) -> int:
        self.asked += 1
        return self.uid


def _served(guard: LoopbackCallersOnly, connection: object | None) -> bool:
    scope: dict[str, Any] = {"type": "http", "headers": [(b"host", b"127.0.0.1:1")], "client": ("127.0.0.1", 40000),
                             "server": ("127.0.0.1", 1), "method": "GET", "path": "/"}
    if connection is not None:
        scope[host_guard.PEER_OF_CONNECTION] = connection
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(LoopbackCallersOnly(app, also=guard.users)(scope, receive, send))
    return bool(sent[0]["status"] == 200)


def test_the_kernel_is_asked_once_per_served_connection_and_at_every_refused_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from corral.server.host_guard import PeerOfConnection

    guard = LoopbackCallersOnly(lambda *_: None)
    served = _Lookups(os.geteuid())
    monkeypatch.setattr(host_guard, "tcp_peer_uid", served)
    connection = PeerOfConnection()
    assert all(_served(guard, connection) for _ in range(3))
    assert served.asked == 1 and connection.served == os.geteuid()
    refused = _Lookups(65534)
    monkeypatch.setattr(host_guard, "tcp_peer_uid", refused)
    other = PeerOfConnection()
    assert not any(_served(guard, other) for _ in range(3))
    assert refused.asked == 3 and other.served is None  # nothing kept: asked again every time
    assert not _served(guard, None) and refused.asked == 4  # no connection to keep it with (a WebSocket)
