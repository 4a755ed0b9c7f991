"""The server's port proxy, ``/v1/sandboxes/{id}/ports/{port}/…``: HTTP and WebSocket (a
DevTools session with the sandboxed Chromium), the owning tenant only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from .server_fixtures import KEYS, ServerProcess
from .test_browser import CHROMIUM, wait_for


@pytest.fixture(scope="module")
def server(state_dir: Path, browser_image: str) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-ports", keys=KEYS) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser_image(state_dir: Path) -> str:
    from corral.images import recipe as recipes
    from corral.images.build import build

    build(recipes.load("browser"), state_dir)
    return "browser"


def test_port_proxy_http_and_devtools_websocket_for_the_owner_only(server: ServerProcess) -> None:
    alice, bob, nobody = server.client("alice"), server.client("bob"), server.client()
    created = alice.post("/v1/sandboxes", json={"image": "browser", "limits": {"memory": "1G", "pids": 512}})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    start = ("cd /tmp && echo served > index.html && (setsid python3 -m http.server 8000 --bind 127.0.0.1 "
             f"& setsid {CHROMIUM} --remote-debugging-port=9222 about:blank &) >/dev/null 2>&1")
    assert alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": start}).json()["exit_code"] == 0
    base = f"/v1/sandboxes/{sid}/ports"
    served = wait_for(lambda: (r := alice.get(f"{base}/8000/index.html")).status_code == 200 and r, "the server")
    assert served.text == "served\n"  # type: ignore[attr-defined]
    # only the owner: another tenant gets exactly what a missing sandbox gets; no key, 401
    assert bob.get(f"{base}/8000/index.html").status_code == 404
    assert bob.get("/v1/sandboxes/sb-0000000000000000/ports/8000/").status_code == 404
    assert nobody.get(f"{base}/8000/index.html").status_code == 401
    assert alice.get(f"{base}/8001/").status_code == 502  # nothing listens there
    # the port's own origin (PORT-ID.localhost) is the same proxy: the owner's key, or nothing
    own = {"host": f"8000-{sid}.localhost:{server.port}"}
    assert alice.get("/index.html", headers=own).text == "served\n"
    assert bob.get("/index.html", headers=own).status_code == 404
    assert nobody.get("/index.html", headers=own).status_code == 401
    # Chromium's DevTools: its JSON over HTTP, then the browser's WebSocket, through the proxy
    version = wait_for(lambda: (r := alice.get(f"{base}/9222/json/version")).status_code == 200 and r.json(),
                       "Chromium's DevTools endpoint", 60)
    browser_path = version["webSocketDebuggerUrl"].split("9222", 1)[1]  # type: ignore[index]
    ws_url = server.url.replace("http://", "ws://") + f"{base}/9222{browser_path}"
    with connect(ws_url, additional_headers=server.headers("alice"), open_timeout=30) as ws:
        ws.send(json.dumps({"id": 1, "method": "Browser.getVersion"}))
        reply = json.loads(ws.recv(timeout=30))
        assert reply["id"] == 1 and "HeadlessChrome/" in reply["result"]["userAgent"], reply
    for headers, code in ((server.headers("bob"), 4404), ({}, 4401)):
        with connect(ws_url, additional_headers=headers, open_timeout=30) as ws, \
                pytest.raises(ConnectionClosed) as refused:
            ws.recv(timeout=30)
        assert refused.value.rcvd is not None and refused.value.rcvd.code == code
    assert alice.delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert alice.get(f"{base}/8000/index.html").status_code == 404
    for client in (alice, bob, nobody):
        client.close()


def test_port_proxy_refuses_bad_ports(server: ServerProcess) -> None:
    with server.client("alice") as alice:
        sid = alice.post("/v1/sandboxes", json={}).json()["id"]
        try:
            assert alice.get(f"/v1/sandboxes/{sid}/ports/0/").status_code in (400, 422)
            assert alice.get(f"/v1/sandboxes/{sid}/ports/70000/").status_code in (400, 422)
        finally:
            alice.delete(f"/v1/sandboxes/{sid}")

