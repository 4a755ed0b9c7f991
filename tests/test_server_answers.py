"""An answer the server has made is counted against its tenant until the client has taken it.

A blocking exec's (and a code cell's, and a listing's) answer is built whole in the server and
queued on the client's socket; the tenant's output bound (``max_output_bytes_per_tenant``)
counted a command only while it ran.  A client that asks and never reads made the server hold
every answer: 16 unread answers of 30 MB each ran 16 commands and grew the server by ~850 MB
(RSS), and by more with more requests.  Now an answer is counted at its size until it is sent
(``server.output_shares.HeldUntilSent``): the tenant's later commands wait their turn.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .server_fixtures import KEYS, ServerProcess

PRINT_30M = "touch /tmp/ran-$$; head -c 30M /dev/zero | tr '\\0' x"


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-answers", keys=KEYS, config={"max_output_bytes_per_tenant": "128M"}) as srv:
        yield srv


def _ask_and_never_read(server: ServerProcess, sandbox_id: str) -> socket.socket:
    host, port = server.url.split("//")[1].split(":")
    body = json.dumps({"cmd": PRINT_30M, "timeout": 60}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(f"POST /v1/sandboxes/{sandbox_id}/exec HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS['alice']}"
                 f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_answers_nobody_reads_hold_back_their_tenants_next_commands_not_the_server(server: ServerProcess) -> None:
    with server.client("alice") as alice, server.client("bob") as bob:
        ids = [alice.post("/v1/sandboxes", json={"limits": {"max_output": "32M"}}).json()["id"] for _ in range(3)]
        socks = [_ask_and_never_read(server, ids[n % 3]) for n in range(16)]
        try:
            time.sleep(8)  # long enough for all 16 to run, were they let
            ran = sum(len([e for e in alice.get(f"/v1/sandboxes/{i}/files", params={"path": "/tmp"}).json()["entries"]
                           if e["name"].startswith("ran-")]) for i in ids)
            assert 1 <= ran <= 5, ran  # 128M: four answers of 30 MB, and one running
            # another tenant is served at once
            started = time.monotonic()
            made = bob.post("/v1/sandboxes", json={}).json()["id"]
            assert bob.post(f"/v1/sandboxes/{made}/exec", json={"cmd": "echo served"}).json()["stdout"] == "served\n"
            assert time.monotonic() - started < 10
        finally:
            for sock in socks:
                sock.close()
        # the clients gone, what they held is given back: the tenant's next command runs
        answer = alice.post(f"/v1/sandboxes/{ids[0]}/exec", json={"cmd": "echo back"}, timeout=120)
        assert answer.json()["stdout"] == "back\n"
