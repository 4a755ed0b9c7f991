"""``/v1/sandboxes/{id}/commands``: background commands, found again by pid.

``POST`` starts a command that outlives the request (E2B's ``run(background=True)``);
``GET`` lists the running ones; ``DELETE .../{pid}`` kills one; ``POST .../{pid}/stdin``
writes to it; the WebSocket ``.../{pid}/stream`` attaches to it: first the output kept so far
(up to ``max_output`` per stream), then what follows, then the result.  Closing an attached
WebSocket leaves the command running; destroying the sandbox ends it.

Each attachment streams at most ``max_output`` per stream, replay included (like the exec
stream; the result says ``truncated``): a client that attaches and does not read holds the
server to that much, however long the command writes.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response, WebSocket, WebSocketDisconnect

from ..errors import InvalidSpec, ResourceLimit, SandboxError
from .context import Context, Tenant, context_of
from .wire import ExecBody, SignalBody, error_response, require_unicode

router = APIRouter()
PREFIX = "/v1/sandboxes/{sandbox_id}/commands"

Event = tuple[str, Any]
#: finished background commands whose output can still be attached to, per sandbox
KEEP_FINISHED = 16


class Recorded:
    """What a background command said so far, and who is listening (one per command)."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._kept = {"stdout": 0, "stderr": 0}
        self._events: list[Event] = []
        #: each listener, and the bytes per stream it may still be sent
        self._listeners: dict[Callable[[Event], None], dict[str, int]] = {}
        self.finished = False

    def output(self, stream: str, chunk: bytes) -> None:  # on the sandbox's reader thread
        with self._lock:
            room = self._limit - self._kept[stream]
            if room > 0:
                self._events.append((stream, chunk[:room]))
                self._kept[stream] += min(room, len(chunk))
            for listener, left in self._listeners.items():
                if left[stream] > 0:
                    listener((stream, chunk[: left[stream]]))
                    left[stream] -= len(chunk)

    def finish(self, event: Event) -> None:
        with self._lock:
            self.finished = True
            self._events.append(event)
            for listener in self._listeners:
                listener(event)

    def attach(self, listener: Callable[[Event], None]) -> list[Event]:
        """Start calling ``listener``; returns what came before (atomically: nothing is lost or doubled).
        What came before and what ``listener`` is given add up to at most the limit per stream."""
        with self._lock:
            self._listeners[listener] = {s: self._limit - kept for s, kept in self._kept.items()}
            return list(self._events)

    def detach(self, listener: Callable[[Event], None]) -> None:
        with self._lock:
            self._listeners.pop(listener, None)


@router.post(PREFIX, status_code=201, summary="Start a command in the background")
async def start_command(sandbox_id: str, body: ExecBody, who: Tenant, ctx: Context) -> dict[str, Any]:
    entry = ctx.manager.get(who, sandbox_id)
    require_unicode(body.model_dump())
    # each running one keeps up to max_output per stream here and in its process: bounded in number
    limit = ctx.config.max_background_commands
    if sum(not r.finished for r in entry.background.values()) >= limit:
        raise ResourceLimit(f"sandbox {sandbox_id} already runs {limit} background commands (the server's "
                            "max_background_commands): kill one or wait for one to end")
    recorded = Recorded(entry.spec.limits.max_output)
    placeholder = -id(recorded)  # counted while it starts (no pid is negative)
    entry.background[placeholder] = recorded

    def start() -> Any:
        handle = entry.sandbox.commands.run(body.cmd, timeout=body.timeout, env=body.env, cwd=body.cwd, user=body.user,
                                            stdin=body.stdin_bytes(), on_output=recorded.output,
                                            background=True)

        def wait() -> None:
            try:
                recorded.finish(("result", handle.wait()))
            except SandboxError as exc:
                recorded.finish(("failed", exc))

        threading.Thread(target=wait, name="corral-background-wait", daemon=True).start()
        return handle

    try:
        handle = await ctx.run_for(who, start)
    finally:
        del entry.background[placeholder]
    if handle.pid is None:
        raise InvalidSpec("the command ended before it started")
    # what ended stays attachable for a while; beyond KEEP_FINISHED the oldest goes (memory: each
    # keeps up to max_output per stream)
    finished = [p for p, r in entry.background.items() if r.finished]
    for old in finished[: max(0, len(finished) - KEEP_FINISHED)]:
        del entry.background[old]
    entry.background[handle.pid] = recorded
    return {"pid": handle.pid, "sandbox_id": sandbox_id}


@router.get(PREFIX, summary="List the running commands")
async def list_commands(sandbox_id: str, who: Tenant, ctx: Context) -> dict[str, Any]:
    entry = ctx.manager.get(who, sandbox_id)
    return {"commands": [c.to_dict() for c in entry.sandbox.commands.list()]}


@router.delete(PREFIX + "/{pid}", status_code=204, summary="Kill a running command (404 if none has this pid)")
async def kill_command(sandbox_id: str, pid: int, who: Tenant, ctx: Context) -> Response:
    entry = ctx.manager.get(who, sandbox_id)
    # a kill or a signal is not held behind the tenant's own long commands (it may be what ends them)
    if not await ctx.run_blocking(entry.sandbox.commands.kill, pid):
        return error_response(404, "not_found", f"sandbox {sandbox_id} has no running command with pid {pid}")
    return Response(status_code=204)


@router.post(PREFIX + "/{pid}/stdin", status_code=204,
             summary="Write the raw body to a running command's stdin (then close it with ?close=true)")
async def command_stdin(sandbox_id: str, pid: int, request: Request, who: Tenant, ctx: Context,
                        close: bool = False) -> Response:
    entry = ctx.manager.get(who, sandbox_id)
    data = await request.body()

    def feed() -> None:
        handle = entry.sandbox.commands.connect(pid)
        if data:
            handle.send_stdin(data)
        if close:
            handle.close_stdin()

    try:
        await ctx.run_for(who, feed)
    except InvalidSpec as exc:
        return error_response(404, "not_found", str(exc))
    return Response(status_code=204)


@router.post(PREFIX + "/{pid}/signal", status_code=204, summary="Send a signal to a running command")
async def command_signal(sandbox_id: str, pid: int, body: SignalBody, who: Tenant, ctx: Context) -> Response:
    entry = ctx.manager.get(who, sandbox_id)
    try:
        await ctx.run_blocking(lambda: entry.sandbox.commands.connect(pid).send_signal(body.signal))
    except InvalidSpec as exc:
        return error_response(404, "not_found", str(exc))
    return Response(status_code=204)


@router.websocket(PREFIX + "/{pid}/stream")
async def attach_command(websocket: WebSocket, sandbox_id: str, pid: int) -> None:
    ctx = context_of(websocket)
    await websocket.accept()
    try:
        entry = ctx.manager.get(ctx.tenant_of(websocket.headers.get("authorization")), sandbox_id)
        recorded = entry.background.get(pid)
        if recorded is None:
            raise InvalidSpec(f"no background command with pid {pid} in sandbox {sandbox_id}")
    except SandboxError as exc:
        from .stream import _send_error

        await _send_error(websocket, exc)
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()

    def listener(event: Event) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    async def watch() -> None:
        # a client that leaves must end this handler now, not when the command next writes or ends
        # (a quiet command kept every closed attachment's handler and queue until then)
        with contextlib.suppress(Exception):
            while (await websocket.receive())["type"] != "websocket.disconnect":
                pass
        queue.put_nowait(("gone", None))

    for event in recorded.attach(listener):
        queue.put_nowait(event)
    decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}
    watcher = asyncio.create_task(watch())
    try:
        while True:
            kind, payload = await queue.get()
            if kind == "gone":
                break
            if kind in decoders:
                text = decoders[kind].decode(payload)
                if text:
                    await websocket.send_json({"type": kind, "data": text})
            elif kind == "result":
                await websocket.send_json({"type": "result", "sandbox_id": sandbox_id, **payload.to_dict()})
                break
            else:
                await websocket.send_json({"type": "error", "error": payload.code, "message": str(payload)})
                break
        await websocket.close()
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        watcher.cancel()
        recorded.detach(listener)
        with contextlib.suppress(Exception):
            await websocket.close()
