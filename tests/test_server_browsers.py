"""A server without API keys answers local clients, never a web page (server/host_guard.py).

Before the guard, a page that had its own name resolve to 127.0.0.1 (DNS rebinding) read and
drove the whole keyless API -- ``Host: evil.example`` was served like ``127.0.0.1`` -- and any
page could open the exec WebSocket of a sandbox. Checked both ways: local clients (the SDK,
``localhost``, ``[::1]``, a page served from the loopback) go on working.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from corral import Sandbox

from .server_fixtures import KEYS, ServerProcess

EVIL = "evil.example"


@pytest.fixture(scope="module")
def keyless(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-browsers") as srv:
        yield srv


def test_a_rebound_name_is_refused_and_makes_nothing(keyless: ServerProcess) -> None:
    with keyless.client() as http:
        rebound = {"host": f"{EVIL}:{keyless.port}"}
        listed = http.get("/v1/sandboxes", headers=rebound)
        assert (listed.status_code, listed.json()["error"]) == (421, "misdirected_request"), listed.text
        made = http.post("/v1/sandboxes", json={"network": "allow", "allow": [EVIL]}, headers=rebound)
        assert made.status_code == 421, made.text
        for host in (f"127.0.0.1.{EVIL}", f"localhost.{EVIL}:{keyless.port}", f"localhost:{keyless.port}@{EVIL}",
                     "", f"[::1].{EVIL}"):
            assert http.get("/v1/sandboxes", headers={"host": host}).status_code == 421, host
        assert http.get("/v1/sandboxes").json()["sandboxes"] == []  # nothing was made
        for host in (f"127.0.0.1:{keyless.port}", f"localhost:{keyless.port}", f"[::1]:{keyless.port}", "localhost"):
            assert http.get("/v1/sandboxes", headers={"host": host}).status_code == 200, host


def test_a_foreign_page_cannot_run_a_command_a_local_one_can(keyless: ServerProcess) -> None:
    with Sandbox.create(url=keyless.url) as sb, keyless.client() as http:  # the SDK: no Origin, served
        exec_url = f"/v1/sandboxes/{sb.id}/exec"
        for origin in (f"http://{EVIL}", "null", f"http://127.0.0.1.{EVIL}", f"https://{EVIL}:{keyless.port}"):
            refused = http.post(exec_url, json={"cmd": "touch /tmp/ran"}, headers={"origin": origin})
            assert (refused.status_code, refused.json()["error"]) == (403, "forbidden_origin"), refused.text
        assert not sb.files.exists("/tmp/ran")
        local_page = http.post(exec_url, json={"cmd": "echo ok"}, headers={"origin": "http://localhost:5173"})
        assert local_page.json()["stdout"] == "ok\n"

        ws_url = keyless.url.replace("http", "ws") + f"/v1/sandboxes/{sb.id}/exec/stream"
        with pytest.raises(InvalidStatus) as refused_ws:
            connect(ws_url, origin=f"http://{EVIL}", open_timeout=10)  # type: ignore[arg-type]
        assert refused_ws.value.response.status_code == 403
        with connect(ws_url, open_timeout=10) as ws:
            ws.send(json.dumps({"cmd": "echo streamed", "timeout": 10}))
            frames = [json.loads(ws.recv(timeout=10)) for _ in range(3)]
        assert {"type": "stdout", "data": "streamed\n"}.items() <= frames[1].items(), frames
        assert not sb.files.exists("/tmp/ran")


def test_with_api_keys_any_name_reaches_the_server(state_dir: Path) -> None:
    with ServerProcess(state_dir / "srv-browsers-keys", keys=KEYS) as srv, srv.client("alice") as http:
        assert http.get("/v1/sandboxes", headers={"host": f"sandboxes.example:{srv.port}"}).status_code == 200
        assert http.get("/v1/sandboxes", headers={"host": EVIL}).status_code == 200
        assert httpx.get(srv.url + "/v1/sandboxes", headers={"host": EVIL}).status_code == 401  # the key decides
