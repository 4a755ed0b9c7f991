"""``corral mcp``: sandboxes as Model Context Protocol tools (official ``mcp`` SDK, stdio).

Tools: ``create_sandbox``, ``run_command``, ``write_file``, ``read_file``,
``list_files``, ``destroy_sandbox`` (and ``run_code`` when the sandbox API has
it).  Sandboxes are embedded (this process owns them) unless ``CORRAL_URL``
names a server.  Every sandbox created in a session is destroyed when the
session ends (stdin closes, or the process is told to stop): they live in the
session's state, which the server's lifespan tears down.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

from .errors import InvalidSpec, ResourceLimit, SandboxError, SandboxNotFound
from .sandbox import Sandbox, build_spec

#: sandboxes one MCP session may hold at once
MAX_SANDBOXES_PER_SESSION = 8
MAX_READ = 1 << 20


class Session:
    """The sandboxes of one MCP session, destroyed together."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, Any] = {}

    def get(self, sandbox_id: str) -> Any:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} in this session")
        return sb

    async def create(self, **kwargs: Any) -> Any:
        if len(self.sandboxes) >= MAX_SANDBOXES_PER_SESSION:
            raise ResourceLimit(f"this session already has {MAX_SANDBOXES_PER_SESSION} sandboxes; destroy one first")
        if os.environ.get("CORRAL_URL"):
            sb: Any = await asyncio.to_thread(Sandbox.create, **kwargs)
        else:
            from .pool import create_on_launcher

            # created on a launcher thread: the sandbox must not die with a short-lived worker thread
            sb = await asyncio.wrap_future(create_on_launcher(build_spec(None, **kwargs)))
        self.sandboxes[sb.id] = sb
        return sb

    async def destroy(self, sandbox_id: str) -> None:
        sb = self.sandboxes.pop(sandbox_id, None)
        if sb is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} in this session")
        await asyncio.to_thread(sb.kill)

    def close(self) -> None:
        for sandbox_id in list(self.sandboxes):
            self.sandboxes.pop(sandbox_id).kill()


def _anticipated(fn: Callable[..., Awaitable[dict[str, Any]]]) -> Callable[..., Awaitable[dict[str, Any]]]:
    """Report Corral's own errors to the model as tool errors with their message (not as crashes)."""
    from mcp.server.mcpserver.exceptions import ToolError

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return await fn(*args, **kwargs)
        except SandboxError as exc:
            raise ToolError(f"{exc.code}: {exc}") from exc

    return wrapper


def build_server() -> MCPServer[Session]:
    from mcp.server.mcpserver import MCPServer

    session = Session()

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[Session]:
        try:
            yield session
        finally:
            await asyncio.to_thread(session.close)

    server: MCPServer[Session] = MCPServer("corral", instructions=(
        "Isolated, ephemeral Linux sandboxes. Create one, run shell commands and move files in it, destroy it "
        "when done. Every sandbox of this session is destroyed when the session ends."), lifespan=lifespan)

    @server.tool()
    @_anticipated
    async def create_sandbox(image: str = "host", memory: str = "512M", cpus: float = 1.0, timeout: float = 60.0,
                             env: dict[str, str] | None = None, allow: list[str] | None = None) -> dict[str, Any]:
        """Create a sandbox; returns its id. memory like 512M, timeout = default seconds per command.
        No network unless ``allow`` lists destinations (host, *.domain, IP or CIDR, optional :port)."""
        # secrets are deliberately not offered: the model would choose where they may be sent
        sb = await session.create(image=image, memory=memory, cpus=cpus, timeout=timeout, env=env,
                                  allow=allow or None)
        return {"sandbox_id": sb.id}

    @server.tool()
    @_anticipated
    async def run_command(sandbox_id: str, command: str, timeout: float | None = None,
                          cwd: str | None = None) -> dict[str, Any]:
        """Run a shell command to completion; returns exit_code, stdout, stderr, timed_out, oom_killed."""
        sb = session.get(sandbox_id)
        result = await asyncio.to_thread(sb.commands.run, command, timeout=timeout, cwd=cwd)
        return dict(result.to_dict())

    @server.tool()
    @_anticipated
    async def write_file(sandbox_id: str, path: str, content: str) -> dict[str, Any]:
        """Write a text file (relative paths are under /workspace)."""
        await asyncio.to_thread(session.get(sandbox_id).files.write, path, content)
        return {"path": path, "bytes": len(content.encode())}

    @server.tool()
    @_anticipated
    async def read_file(sandbox_id: str, path: str) -> dict[str, Any]:
        """Read a text file (at most 1 MiB)."""
        content = await asyncio.to_thread(session.get(sandbox_id).files.read, path, "text", MAX_READ)
        return {"path": path, "content": content}

    @server.tool()
    @_anticipated
    async def list_files(sandbox_id: str, path: str = ".") -> dict[str, Any]:
        """List a directory: name, type, size of each entry."""
        entries = await asyncio.to_thread(session.get(sandbox_id).files.list, path)
        return {"path": path, "entries": [{"name": e.name, "type": e.type, "size": e.size} for e in entries]}

    @server.tool()
    @_anticipated
    async def destroy_sandbox(sandbox_id: str) -> dict[str, Any]:
        """Destroy a sandbox and everything in it."""
        await session.destroy(sandbox_id)
        return {"destroyed": sandbox_id}

    if hasattr(Sandbox, "run_code"):  # the code interpreter, once it exists

        @server.tool()
        @_anticipated
        async def run_code(sandbox_id: str, code: str, language: str = "python") -> dict[str, Any]:
            """Run code in the sandbox's interpreter."""
            sb = session.get(sandbox_id)
            result = await asyncio.to_thread(sb.run_code, code, language=language)
            return dict(result.to_dict()) if hasattr(result, "to_dict") else {"result": result}

    return server


def main(transport: str = "stdio", host: str = "127.0.0.1", port: int = 7334) -> None:
    server = build_server()
    if transport == "stdio":
        server.run("stdio")
    elif transport == "http":
        from .server.config import is_loopback

        if not is_loopback(host):
            raise InvalidSpec("corral mcp --http listens on loopback only (it has no authentication)")
        server.run("streamable-http", host=host, port=port)
    else:
        raise InvalidSpec(f"transport {transport!r}: use stdio or http")
