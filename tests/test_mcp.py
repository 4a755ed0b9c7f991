"""``corral mcp`` over stdio, driven by the official MCP SDK's own client."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from corral.host import cgroups

from .server_fixtures import CORRAL


def _payload(result: Any) -> dict[str, Any]:
    assert not result.is_error, result
    if result.structured_content:
        return dict(result.structured_content)
    return dict(json.loads(result.content[0].text))


def test_mcp_round_trip_and_session_cleanup(state_dir: Path) -> None:
    from mcp import ClientSession, StdioServerParameters, stdio_client

    state = state_dir / "mcp"
    state.mkdir()
    os.chmod(state_dir, 0o711)  # sandbox launchers (unprivileged uids) traverse it
    env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_API_KEY")}
    params = StdioServerParameters(command=CORRAL, args=["--state-dir", str(state), "mcp"], env=env)

    async def session() -> tuple[str, set[str]]:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            tools = {t.name for t in (await client.list_tools()).tools}
            assert {"create_sandbox", "run_command", "write_file", "read_file", "list_files",
                    "destroy_sandbox"} <= tools
            sid = _payload(await client.call_tool("create_sandbox", {"memory": "128M"}))["sandbox_id"]
            other = _payload(await client.call_tool("create_sandbox", {}))["sandbox_id"]
            ran = _payload(await client.call_tool("run_command", {"sandbox_id": sid, "command": "echo hi; exit 3"}))
            assert (ran["exit_code"], ran["stdout"]) == (3, "hi\n")
            _payload(await client.call_tool("write_file", {"sandbox_id": sid, "path": "n.txt", "content": "note"}))
            read = _payload(await client.call_tool("read_file", {"sandbox_id": sid, "path": "n.txt"}))
            assert read["content"] == "note"
            names = [e["name"] for e in _payload(await client.call_tool("list_files", {"sandbox_id": sid}))["entries"]]
            assert names == ["n.txt"]
            _payload(await client.call_tool("destroy_sandbox", {"sandbox_id": sid}))
            gone = await client.call_tool("run_command", {"sandbox_id": sid, "command": "true"})
            assert gone.is_error and "no sandbox" in gone.content[0].text
            live = {other}
            assert other in cgroups.list_sandbox_groups()
            return sid, live

    destroyed, left_open = asyncio.run(session())
    # the session ended with `other` still open: the server destroyed it on the way out
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (left_open & cgroups.list_sandbox_groups()):
        time.sleep(0.1)
    assert not ({destroyed} | left_open) & cgroups.list_sandbox_groups()
    assert list((state / "sandboxes").iterdir()) == []
