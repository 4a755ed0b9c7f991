"""What a request costs on its way (issue 16, target 3): the server's size limit hands a body that
came with its head to the route in the same turn of the event loop (``asyncio.wait_for``'s task
took one or two more); a spec's dict (every SDK create, every answer about a sandbox) is what
``dataclasses.asdict`` made, without its deep copy."""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import asdict
from typing import Any

from corral.server.limits import BodySizeLimit
from corral.spec import SandboxSpec


def test_a_body_that_came_with_its_head_reaches_the_route_in_the_same_turn() -> None:
    """The size limit read a small body with ``asyncio.wait_for``, whose task ran a turn of the
    loop later; a callback scheduled as the request began ran before the route did."""
    order: list[str] = []

    async def route(scope: Any, receive: Any, send: Any) -> None:
        order.append("route")
        assert (await receive())["body"] == b'{"cmd": "true"}'

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b'{"cmd": "true"}', "more_body": False}

    async def send(message: Any) -> None:
        raise AssertionError(message)

    async def request() -> None:
        asyncio.get_running_loop().call_soon(order.append, "next turn")
        scope = {"type": "http", "headers": [(b"content-length", b"15")], "method": "POST", "path": "/"}
        await BodySizeLimit(route, max_bytes=1 << 20)(scope, receive, send)
        await asyncio.sleep(0)

    asyncio.run(request())
    assert order == ["route", "next turn"]


def test_a_slow_small_body_is_still_answered_408() -> None:
    sent: list[Any] = []

    async def never() -> dict[str, Any]:
        await asyncio.sleep(10)
        raise AssertionError("not cancelled")

    async def send(message: Any) -> None:
        sent.append(message)

    async def route(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("a body that never came reached the route")

    scope = {"type": "http", "headers": [(b"content-length", b"15")], "method": "POST", "path": "/"}
    asyncio.run(BodySizeLimit(route, max_bytes=1 << 20, small_body_timeout=0.05)(scope, never, send))
    assert sent[0]["status"] == 408 and b"must arrive within 0.05 s" in sent[1]["body"]


def test_a_specs_dict_is_what_dataclasses_asdict_made_of_it() -> None:
    def as_before(spec: SandboxSpec) -> dict[str, Any]:
        data = asdict(spec)
        data["env"] = dict(spec.env)
        data["allow"] = list(spec.allow)
        data["unsafe_allow_ranges"] = list(spec.unsafe_allow_ranges)
        data["secrets"] = [f"{b.name}@{','.join(b.hosts)}" for b in spec.secrets]
        if spec.workspace is not None:
            data["workspace"] = {"path": str(spec.workspace.path), "mode": spec.workspace.mode}
        return data

    with tempfile.TemporaryDirectory() as workspace:
        specs = [SandboxSpec(), SandboxSpec.from_dict({"limits": {"memory": "128M", "cpus": 0.5}}),
                 SandboxSpec.from_dict({"env": {"A": "1"}, "network": "allow", "allow": ["example.com", "*.x.org:443"],
                                        "unsafe_allow_ranges": ["10.0.0.0/8"], "secrets": ["TOK@api.example.com,b.io"],
                                        "cwd": "/tmp", "user": "root", "workspace": f"{workspace}:ro"})]
        for spec in specs:
            assert json.dumps(spec.to_dict()) == json.dumps(as_before(spec))
            assert SandboxSpec.from_dict(spec.to_dict()) == spec
