"""The fast routes (create, exec, destroy, /healthz without FastAPI's routing) answer exactly as
FastAPI's routes do, with the same checks: two real servers on loopback, one with
``fast_routes: false``, asked the same questions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.server.trace import parse_header

from .server_fixtures import KEYS, ServerProcess

CONFIG = {"max_sandboxes_per_tenant": 2, "max_memory_per_tenant": "1G"}
SPEC = {"limits": {"memory": "128M"}}


@pytest.fixture(scope="module")
def servers(state_dir: Path) -> Iterator[dict[str, ServerProcess]]:
    """``fast`` and ``fastapi`` (fast_routes off), both reporting Server-Timing."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CORRAL_SERVER_TIMING", "1")
        with ServerProcess(state_dir / "srv-fast", keys=KEYS, config=CONFIG) as fast, \
                ServerProcess(state_dir / "srv-slow", keys=KEYS, config={**CONFIG, "fast_routes": False}) as slow:
            yield {"fast": fast, "fastapi": slow}


def ask(server: ServerProcess, method: str, path: str, tenant: str | None = "alice", *,
        headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    with server.client(tenant) as http:
        return http.request(method, path, headers=headers, **kwargs)


def answer(response: httpx.Response) -> tuple[int, str, dict[str, str]]:
    """What must be the same both ways: status, body, and the headers a client acts on."""
    kept = {k: v for k, v in response.headers.items() if k in ("content-type", "www-authenticate", "retry-after")}
    return response.status_code, response.text, kept


def fast_path_served(response: httpx.Response) -> bool:
    return "handler" in parse_header(response.headers.get("server-timing", ""))


def both(servers: dict[str, ServerProcess], method: str, path: str, **kwargs: Any) -> httpx.Response:
    """Ask both servers; assert they answer alike and that only the fast one took the fast path."""
    fast, slow = (ask(servers[name], method, path, **kwargs) for name in ("fast", "fastapi"))
    assert answer(fast) == answer(slow)
    assert not fast_path_served(slow)
    return fast


@pytest.mark.parametrize(("method", "path", "kwargs", "status"), [
    # the API key is checked first, on the fast path too
    ("POST", "/v1/sandboxes", {"tenant": None, "json": SPEC}, 401),
    ("POST", "/v1/sandboxes", {"tenant": None, "headers": {"Authorization": "Bearer not-a-key"}, "json": SPEC}, 401),
    ("POST", "/v1/sandboxes/sb-0000000000000000/exec", {"tenant": None, "json": {"cmd": "true"}}, 401),
    ("DELETE", "/v1/sandboxes/sb-0000000000000000", {"tenant": None}, 401),
    ("POST", "/v1/sandboxes/sb-0000000000000000/exec", {"json": {"cmd": "true"}}, 404),
    ("DELETE", "/v1/sandboxes/sb-0000000000000000", {}, 404),
    # the handler's own refusals, answered by the app's error handlers
    ("POST", "/v1/sandboxes", {"json": {"workspace": "/etc"}}, 400),
    ("POST", "/v1/sandboxes", {"json": {"limits": {"memory": "4G"}}}, 429),
    ("POST", "/v1/sandboxes", {"content": '{"env": {"A": "\\ud800"}}', "headers": {"content-type": "application/json"}},
     400),
    # bodies FastAPI refuses go to FastAPI: the same 422s, naming the field
    ("POST", "/v1/sandboxes", {"json": {"limits": "lots"}}, 422),
    ("POST", "/v1/sandboxes", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 422),
    ("POST", "/v1/sandboxes/sb-0000000000000000/exec", {"json": {"cmd": "true", "bogus": 1}}, 422),
    ("POST", "/v1/sandboxes/sb-0000000000000000/exec", {"content": b"", "headers": {"content-type": "application/json"}},
     422),
])
def test_refusals_are_the_same_both_ways(servers: dict[str, ServerProcess], method: str, path: str,
                                         kwargs: dict[str, Any], status: int) -> None:
    response = both(servers, method, path, **kwargs)
    assert response.status_code == status, response.text
    # only requests whose body FastAPI would refuse leave the fast path; a body without a valid key
    # is refused before either path, by the size limit, which reads no body before its key
    refused_before = status == 401 and "json" in kwargs
    assert fast_path_served(response) == (status != 422 and not refused_before)


def test_a_lifecycle_is_the_same_both_ways_and_tenants_stay_apart(servers: dict[str, ServerProcess]) -> None:
    made = {}
    for name, server in servers.items():
        created = ask(server, "POST", "/v1/sandboxes", json={**SPEC, "metadata": {"k": "v"}})
        assert created.status_code == 201, created.text
        assert fast_path_served(created) == (name == "fast")
        made[name] = created
    fast, slow = (made[name].json() for name in ("fast", "fastapi"))
    assert made["fast"].headers["content-type"] == made["fastapi"].headers["content-type"]
    assert list(fast) == list(slow) and fast["spec"] == slow["spec"] and fast["metadata"] == {"k": "v"}
    for name, server in servers.items():
        sid = made[name].json()["id"]
        # another tenant's sandbox is a 404 on the fast path too, and stays untouched
        assert ask(server, "POST", f"/v1/sandboxes/{sid}/exec", "bob", json={"cmd": "true"}).status_code == 404
        assert ask(server, "DELETE", f"/v1/sandboxes/{sid}", "bob").status_code == 404
        ran = ask(server, "POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "hi"], "env": {"A": "b"}})
        assert ran.status_code == 200 and fast_path_served(ran) == (name == "fast")
        result = ran.json()
        assert (result["sandbox_id"], result["stdout"], result["exit_code"]) == (sid, "hi\n", 0)
        made[name] = ran
    assert list(made["fast"].json()) == list(made["fastapi"].json())
    for name, server in servers.items():
        sid = made[name].json()["sandbox_id"]
        gone = ask(server, "DELETE", f"/v1/sandboxes/{sid}")
        assert (gone.status_code, gone.content) == (204, b"") and fast_path_served(gone) == (name == "fast")
        assert ask(server, "GET", f"/v1/sandboxes/{sid}").status_code == 404


def test_quota_and_healthz_on_the_fast_path(servers: dict[str, ServerProcess]) -> None:
    server = servers["fast"]
    ids = [ask(server, "POST", "/v1/sandboxes", "bob", json=SPEC).json()["id"] for _ in range(2)]
    try:
        over = ask(server, "POST", "/v1/sandboxes", "bob", json=SPEC)
        assert over.status_code == 429 and over.headers["retry-after"] == "1" and fast_path_served(over)
        assert "2 live sandboxes" in over.json()["message"]
        # alice's quota is her own
        mine = ask(server, "POST", "/v1/sandboxes", json=SPEC)
        assert mine.status_code == 201
        ids.append(mine.json()["id"])
    finally:
        for sid in ids[:2]:
            assert ask(server, "DELETE", f"/v1/sandboxes/{sid}", "bob").status_code == 204
        for sid in ids[2:]:
            assert ask(server, "DELETE", f"/v1/sandboxes/{sid}").status_code == 204
    health = {name: ask(s, "GET", "/healthz", None) for name, s in servers.items()}
    assert {name: list(h.json()) for name, h in health.items()} == {"fast": ["ok", "pid"], "fastapi": ["ok", "pid"]}
    assert health["fast"].headers["content-type"] == health["fastapi"].headers["content-type"]


def test_server_timing_is_off_unless_asked(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORRAL_SERVER_TIMING", raising=False)  # the module's servers have it
    with ServerProcess(state_dir / "srv-untimed", config=CONFIG) as server:
        gone = ask(server, "DELETE", "/v1/sandboxes/sb-0000000000000000", None)
        assert gone.status_code == 404 and "server-timing" not in gone.headers
