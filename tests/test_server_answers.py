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
from typing import Any

import pytest

from .server_fixtures import KEYS, ServerProcess

PRINT_30M = "echo r >> /tmp/ran; head -c 30M /dev/zero | tr '\\0' x"


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


def _size(http: Any, sandbox_id: str, path: str) -> int:
    answer = http.get(f"/v1/sandboxes/{sandbox_id}/files/stat", params={"path": path})
    return int(answer.json()["size"]) if answer.status_code == 200 else 0


def test_answers_nobody_reads_hold_back_their_tenants_next_commands_not_the_server(server: ServerProcess) -> None:
    with server.client("alice") as alice, server.client("bob") as bob:
        ids = [alice.post("/v1/sandboxes", json={"limits": {"max_output": "32M"}}).json()["id"] for _ in range(3)]
        socks = [_ask_and_never_read(server, ids[n % 3]) for n in range(16)]
        try:
            time.sleep(8)  # long enough for all 16 to run, were they let
            # (a stat, not a listing: a listing waits its turn behind the tenant's unread answers too)
            ran = sum(_size(alice, i, "/tmp/ran") // 2 for i in ids)
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


def test_a_large_answer_is_built_without_stalling_other_tenants(state_dir: Path) -> None:
    """A blocking exec's answer (and a listing's) was rendered to JSON on the event loop: alice's
    command printing 2 x 64 MiB of control bytes (768 MiB of JSON) stalled every request of every
    tenant for 2 s.  It is now rendered on alice's thread, a piece per call, so bob's requests
    are answered meanwhile."""
    import threading

    import httpx

    config = {"max_output_bytes_per_tenant": "1G"}
    with ServerProcess(state_dir / "srv-big-answer", keys=KEYS, config=config) as server, \
            server.client("alice") as alice, server.client("bob") as bob:
        sid = alice.post("/v1/sandboxes", json={"limits": {"max_output": "64M", "memory": "256M"}}).json()["id"]
        bobs = bob.post("/v1/sandboxes", json={"limits": {"memory": "64M"}}).json()["id"]
        loud = "head -c 64M /dev/zero | tr '\\0' '\\1'; head -c 64M /dev/zero | tr '\\0' '\\1' >&2"
        done = threading.Event()
        sizes: list[int] = []

        def ask() -> None:
            try:
                with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEYS['alice']}"},
                                  timeout=300) as own:
                    answer = own.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": loud, "timeout": 240})
                    sizes.append(len(answer.content))
            finally:
                done.set()

        asker = threading.Thread(target=ask)
        asker.start()
        worst = 0.0
        try:
            deadline = time.monotonic() + 240
            while not done.is_set() and time.monotonic() < deadline:
                t0 = time.monotonic()
                assert bob.get(f"/v1/sandboxes/{bobs}").status_code == 200
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.01)
        finally:
            asker.join(300)
            alice.delete(f"/v1/sandboxes/{sid}")
            bob.delete(f"/v1/sandboxes/{bobs}")
        assert sizes and sizes[0] > 6 * (128 << 20), sizes  # (each byte is \u0001 in JSON)
        assert worst < 0.5, f"bob waited {worst:.2f} s for an answer while alice's was built"


def _peak_rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmHWM"))


def test_a_large_answer_holds_no_more_of_the_server_than_its_output_is_counted_at(state_dir: Path) -> None:
    """A blocking exec's answer was rendered whole before it was sent: output made of control
    characters is six bytes of JSON a byte (``\\u0001``), so one exec counted at 2 x 64 MiB held
    1 GiB of the server (and one with ``max_output`` 1G, run alone, ~16 GiB).  A large answer is
    now rendered as its client takes it (chunked), its command counted until it is all sent; a
    listing's too."""
    import httpx

    with ServerProcess(state_dir / "srv-answer-memory", keys=KEYS) as server, server.client("alice") as alice:
        sid = alice.post("/v1/sandboxes", json={"limits": {"max_output": "32M", "memory": "256M"}}).json()["id"]
        made = alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": [
            "python3", "-c", "import os\nos.makedirs('/tmp/c')\nopen('/tmp/seed', 'w').close()\n"
            "for i in range(40_000): os.link('/tmp/seed', '/tmp/c/' + chr(1) * 250 + str(i))"], "timeout": 60})
        assert made.json()["exit_code"] == 0, made.text
        before = _peak_rss_mib(server.proc.pid)
        listing = alice.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/c"}, timeout=120)
        grown = _peak_rss_mib(server.proc.pid) - before
        assert len(listing.json()["entries"]) == 40_000
        # ~20 MiB of names and paths, 120 MiB as JSON (helper 90: 6 such listings of 99,000 entries
        # held 2.3 GB of a server, each counted at LISTING_HOLD, 152 MiB)
        # (made whole, the JSON: 176 MiB; rendered as sent: 79-86, the agent's answer, the entries
        # and their JSON dictionaries)
        assert grown < 130, f"the server grew by {grown} MiB for a listing of 20 MiB of names and paths"
        before = _peak_rss_mib(server.proc.pid)
        loud = "head -c 32M /dev/zero | tr '\\0' '\\1'; head -c 32M /dev/zero | tr '\\0' '\\2' >&2"
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=120) as own:
            answer = own.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": loud, "timeout": 100})
        grown = _peak_rss_mib(server.proc.pid) - before
        # counted at 2 x 32 MiB: its bytes and their text, not the 384 MiB of JSON
        assert grown < 4 * 64, f"the server grew by {grown} MiB for an answer counted at 64 MiB"
        assert answer.headers.get("transfer-encoding") == "chunked", answer.headers
        result = answer.json()
        assert result["stdout"] == "\x01" * (32 << 20) and result["stderr"] == "\x02" * (32 << 20)
        assert result["exit_code"] == 0 and not result["truncated"]
        small = alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo small"})
        assert small.headers.get("content-length") and small.json()["stdout"] == "small\n"
        # HTTP/1.0 has no chunked encoding: its answer comes with its length (helper 93: uvicorn
        # sent a 1.0 client chunks it could not read)
        head, body = _ask_http10(server, sid, "head -c 6M /dev/zero | tr '\\0' y")
        assert b"transfer-encoding" not in head.lower() and f"content-length: {len(body)}".encode() in head.lower()
        assert json.loads(body)["stdout"] == "y" * (6 << 20)
        alice.delete(f"/v1/sandboxes/{sid}")


def _ask_http10(server: ServerProcess, sandbox_id: str, cmd: str) -> tuple[bytes, bytes]:
    host, port = server.url.split("//")[1].split(":")
    body = json.dumps({"cmd": cmd, "timeout": 60}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST /v1/sandboxes/{sandbox_id}/exec HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                     f"{KEYS['alice']}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)
        answer = b""
        while chunk := sock.recv(1 << 20):
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    return head, rest


def test_a_listing_nobody_reads_holds_back_the_tenants_next_one_not_the_server(state_dir: Path) -> None:
    """A directory listing was made whether or not the tenant's answers were still held: six
    listings asked and never read (88,000 entries, 3,769-character paths) held 2 GiB of the
    server.  A listing is now held against the tenant's output bound while it is made, an answer
    not yet taken counts there, and a listing's paths are bounded (past them, E2BIG).  (The
    unread answer here, ~9 MB, is more than the sockets' buffers hold.)"""
    import httpx

    from corral.tiers.base import MAX_LIST_PATH_CHARS

    with ServerProcess(state_dir / "srv-listings", keys=KEYS, config={"max_output_bytes_per_tenant": "128M"}) as server, \
            server.client("alice") as alice:
        sid = alice.post("/v1/sandboxes", json={"limits": {"memory": "1G"}}).json()["id"]
        deep = "/tmp/" + "/".join(["d" * 250] * 15)  # ~3,800 characters
        made = alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": [
            "python3", "-c", f"import os\nos.makedirs({deep!r})\nos.makedirs('/tmp/wide')\n"
            f"for i in range(20_000): open(f'{deep}/{{i}}', 'w').close(); open(f'/tmp/wide/{{i:0200}}', 'w').close()"],
            "timeout": 120})
        assert made.json()["exit_code"] == 0, made.text
        refused = alice.get(f"/v1/sandboxes/{sid}/files", params={"path": deep})
        assert refused.status_code >= 400 and "Mi characters" in refused.json()["message"], refused.text[:300]
        assert 20_000 * len(deep) > MAX_LIST_PATH_CHARS
        host, port = server.url.split("//")[1].split(":")
        unread = socket.create_connection((host, int(port)))
        unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        unread.sendall(f"GET /v1/sandboxes/{sid}/files?path=/tmp/wide HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       f"Authorization: Bearer {KEYS['alice']}\r\n\r\n".encode())
        time.sleep(2)
        try:
            with pytest.raises(httpx.TimeoutException):  # waits its turn behind the unread answer
                alice.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/wide"}, timeout=3)
        finally:
            unread.close()
        listed = alice.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/wide"}, timeout=30)
        assert listed.status_code == 200 and len(listed.json()["entries"]) == 20_000
        alice.delete(f"/v1/sandboxes/{sid}")
