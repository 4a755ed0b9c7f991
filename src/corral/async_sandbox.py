"""``AsyncSandbox``: the :class:`corral.Sandbox` surface for asyncio."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .commands import CommandInfo, Commands
from .egress.network import SandboxNetwork
from .sandbox import Files, Network, Sandbox
from .spec import SandboxSpec


class _AsyncCommands:
    def __init__(self, sync: Commands) -> None:
        self._sync = sync

    async def run(self, cmd: str | Sequence[str], **kwargs: Any) -> Any:
        """As :meth:`Commands.run` (``background=True`` returns the synchronous handle)."""
        import asyncio

        return await asyncio.to_thread(lambda: self._sync.run(cmd, **kwargs))

    def list(self) -> list[CommandInfo]:
        return self._sync.list()

    async def kill(self, pid: int) -> bool:
        import asyncio

        return await asyncio.to_thread(self._sync.kill, pid)


class _AsyncFiles:
    def __init__(self, sync: Files) -> None:
        self._sync = sync

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._sync, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            import asyncio

            return await asyncio.to_thread(method, *args, **kwargs)

        return call


class AsyncSandbox:
    """The same surface as :class:`Sandbox` for asyncio (blocking work runs in threads)."""

    def __init__(self, sync: Sandbox) -> None:
        self._sync = sync
        self.id = sync.id
        self.spec = sync.spec
        self.commands = _AsyncCommands(sync.commands)
        self.files = _AsyncFiles(sync.files)
        # expose() only opens a listener (the microVM: copies a file once): the same object; a server's
        # sandbox has none yet (its ports go through the server's route)
        self.ports = getattr(sync, "ports", None)

    @classmethod
    async def create(cls, spec: SandboxSpec | None = None, **kwargs: Any) -> AsyncSandbox:
        import asyncio

        return cls(await asyncio.to_thread(Sandbox.create, spec, **kwargs))

    def is_running(self) -> bool:
        return self._sync.is_running()

    async def run_code(self, code: str, **kwargs: Any) -> Any:
        import asyncio

        return await asyncio.to_thread(self._sync.run_code, code, **kwargs)

    @property
    def network(self) -> SandboxNetwork | Network:
        return self._sync.network

    @property
    def paused(self) -> bool:
        return self._sync.paused

    async def pause(self) -> None:
        import asyncio

        await asyncio.to_thread(self._sync.pause)

    async def resume(self) -> None:
        import asyncio

        await asyncio.to_thread(self._sync.resume)

    async def kill(self) -> None:
        """Destroy the sandbox (as :meth:`Sandbox.kill`); :meth:`close` is an alias."""
        import asyncio

        await asyncio.to_thread(self._sync.kill)

    close = kill

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()
