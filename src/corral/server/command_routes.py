"""``/v1/sandboxes/{id}/commands``: background commands, found again by pid.

``POST`` starts a command that outlives the request (E2B's ``run(background=True)``);
``GET`` lists the running ones; ``DELETE .../{pid}`` kills one; ``POST .../{pid}/stdin``
writes to it; the WebSocket ``.../{pid}/stream`` attaches to it: first the output kept so far
(up to ``max_output`` per stream), then what follows, then the result (frames as the exec
stream's: output that is not UTF-8 also in ``data_b64``).  Closing an attached
WebSocket leaves the command running; destroying the sandbox ends it.

Each attachment streams at most ``max_output`` per stream, replay included (like the exec
stream; the result says ``truncated``): a client that attaches and does not read holds the
server to that much, however long the command writes.

What the server keeps is bounded per tenant too (32 sandboxes with 16 commands each kept up to
2 x ``max_output`` twice over, and 2 sandboxes' worth already held 5.4 GB): a running command
counts against ``max_output_bytes_per_tenant`` like any other (past it a start is 429), and an
ended one's output against ``max_kept_output_per_tenant`` (past it it keeps none: its result is
``truncated``, with empty output).

An attachment's output not yet sent to its client counts against ``max_output_bytes_per_tenant``
too, past the bound if need be (as an answer not yet taken does): its queue holds the chunks after
the command's own share is given back at its end and its record's at the sandbox's destroy.  A
client that never reads is cut off once its connection's writes made no progress for the server's
``ws_send_timeout`` (.ws_protocol); before, one held its command's whole output (2 x 64 MiB)
uncounted for as long as it kept its socket open, sandbox destroyed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response, WebSocket, WebSocketDisconnect

from ..errors import InvalidSpec, ResourceLimit, SandboxError
from ..host.heap import return_free_memory
from .context import Context, Tenant, context_of
from .limits import TenantTally
from .output_shares import OutputShares, Release
from .wire import ExecBody, OutputFrames, SignalBody, error_response, require_unicode
from .ws_protocol import TRIM_AFTER

router = APIRouter()
PREFIX = "/v1/sandboxes/{sandbox_id}/commands"

Event = tuple[str, Any]
#: finished background commands whose output can still be attached to, per sandbox
KEEP_FINISHED = 16


class _Charge:
    """What one ended command's record counts for its tenant; once given back, nothing more is taken."""

    def __init__(self, tally: TenantTally, tenant: str) -> None:
        self.tally, self.tenant = tally, tenant
        self.amount = 0
        self.given_back = False
        self.lock = threading.Lock()

    def take(self, amount: int) -> bool:
        with self.lock:
            if self.given_back or not self.tally.take(self.tenant, amount):
                return False
            self.amount = amount
            return True

    def give_back(self) -> None:  # the record's finalizer: explicit, or when it is collected
        with self.lock:
            self.given_back = True
            amount, self.amount = self.amount, 0
        if amount:
            self.tally.give(self.tenant, amount)


class Recorded:
    """What a background command said so far, and who is listening (one per command)."""

    def __init__(self, limit: int, kept: TenantTally, tenant: str) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._kept = {"stdout": 0, "stderr": 0}
        self._events: list[Event] = []
        #: each listener, and the bytes per stream it may still be sent
        self._listeners: dict[Callable[[Event], None], dict[str, int]] = {}
        self.finished = False
        #: once ended, what it keeps is counted for its tenant, until it is dropped (or collected)
        self._charge = _Charge(kept, tenant)
        self._give_back = weakref.finalize(self, self._charge.give_back)

    def release(self) -> None:
        """Drop what it keeps (its sandbox went, or newer ended commands pushed it out): no longer
        counted, so no longer held either, though an attachment still refers to the record."""
        self._give_back()
        with self._lock:
            self._events = [event for event in self._events if event[0] not in self._kept]
            self._kept = {"stdout": self._limit, "stderr": self._limit}  # nothing more is kept

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
            kept = self._keep_within_tally(event)
            self._events.append(kept)
            # those listening get the result whole when it is not kept because its sandbox went
            # (they were given the output already; before, their result came back empty, with
            # no word of why); past the tenant's bound they get what is kept
            sent = event if self._charge.given_back else kept
            for listener in self._listeners:
                listener(sent)

    def _keep_within_tally(self, event: Event) -> Event:
        """Count what this ended command keeps for its tenant; past the tenant's bound keep none of
        its output (the result says truncated)."""
        kind, payload = event
        size = sum(len(chunk) for stream, chunk in self._events if stream in self._kept)
        if kind == "result":
            size += sys.getsizeof(payload.stdout) + sys.getsizeof(payload.stderr)
        if not size or self._charge.take(size):
            return event
        # past the bound, or the record already dropped (its sandbox went while it ended)
        self._events = [e for e in self._events if e[0] not in self._kept]
        self._kept = {"stdout": self._limit, "stderr": self._limit}  # nothing more for late attachments
        if kind == "result":
            event = (kind, dataclasses.replace(payload, stdout="", stderr="", truncated=True))
        return event

    def attach(self, listener: Callable[[Event], None]) -> list[Event]:
        """Start calling ``listener``; returns what came before (atomically: nothing is lost or doubled).
        What came before and what ``listener`` is given add up to at most the limit per stream."""
        with self._lock:
            self._listeners[listener] = {s: self._limit - kept for s, kept in self._kept.items()}
            return list(self._events)

    def detach(self, listener: Callable[[Event], None]) -> None:
        with self._lock:
            self._listeners.pop(listener, None)


def size_of(event: Event) -> int:
    """The bytes of output ``event`` holds (a result holds the command's whole output)."""
    kind, payload = event
    if kind in ("stdout", "stderr"):
        return len(payload)
    if kind == "result":
        return sys.getsizeof(payload.stdout) + sys.getsizeof(payload.stderr)
    return 0


class Undelivered:
    """One attachment's output queued for its client and not yet sent, counted for its tenant
    against its output shares (past the bound if need be) until it is sent or the attachment ends."""

    def __init__(self, shares: OutputShares, tenant: str) -> None:
        self._shares, self._tenant = shares, tenant
        self._lock = threading.Lock()
        self._counted = 0
        self._ended = False

    def queued(self, event: Event) -> None:  # also on the sandbox's reader thread
        size = size_of(event)
        with self._lock:  # counted and given back in one order, whichever thread comes first
            if size and not self._ended:
                self._counted += size
                self._shares.add(self._tenant, size)

    def sent(self, event: Event) -> None:
        self._give(size_of(event))

    def end(self) -> int:
        """The attachment is over: what it still queued is dropped with it; returns its size."""
        with self._lock:
            self._ended = True
            dropped = self._counted
        self._give(dropped)
        return dropped

    def _give(self, size: int) -> None:
        with self._lock:
            size = min(size, self._counted)
            self._counted -= size
            if size:
                self._shares.give(self._tenant, size)


@router.post(PREFIX, status_code=201, summary="Start a command in the background")
async def start_command(sandbox_id: str, body: ExecBody, who: Tenant, ctx: Context) -> dict[str, Any]:
    entry = ctx.manager.get(who, sandbox_id)
    require_unicode(body.model_dump())
    # each running one keeps up to max_output per stream here and in its process: bounded in number
    limit = ctx.config.max_background_commands
    if sum(not r.finished for r in entry.background.values()) >= limit:
        raise ResourceLimit(f"sandbox {sandbox_id} already runs {limit} background commands (the server's "
                            "max_background_commands): kill one or wait for one to end")
    # it may run for ever: refused at once, never made to wait for another command of the tenant
    running_share = ctx.output_shares.try_hold(who, 2 * entry.spec.limits.max_output)
    if running_share is None:
        raise ResourceLimit(f"tenant {who}'s running commands may print {ctx.output_shares.held.get(who, 0)} bytes, "
                            "the server's max_output_bytes_per_tenant: wait for some to end or kill some "
                            "(a lower max_output lets more run at once)")
    recorded = Recorded(entry.spec.limits.max_output, ctx.kept_output, who)
    placeholder = -id(recorded)  # counted while it starts (no pid is negative)
    entry.background[placeholder] = recorded
    handle = None
    try:
        handle = await ctx.run_for(who, _start, entry, body, recorded, running_share)
    finally:
        del entry.background[placeholder]
        if handle is None:
            running_share()
    if handle.pid is None:
        raise InvalidSpec("the command ended before it started")
    # what ended stays attachable for a while; beyond KEEP_FINISHED the oldest goes (memory: each
    # keeps up to max_output per stream)
    finished = [p for p, r in entry.background.items() if r.finished]
    for old in finished[: max(0, len(finished) - KEEP_FINISHED)]:
        entry.background.pop(old).release()
    entry.background[handle.pid] = recorded
    return {"pid": handle.pid, "sandbox_id": sandbox_id}


def _start(entry: Any, body: ExecBody, recorded: Recorded, running_share: Release) -> Any:
    handle = entry.sandbox.commands.run(body.cmd, timeout=body.timeout, env=body.env, cwd=body.cwd, user=body.user,
                                        stdin=body.stdin_bytes(), on_output=recorded.output, background=True)

    def wait() -> None:
        # its end starts the sandbox's idle clock, as a foreground command's does (exec_slot), and
        # before it reads as finished: the clock ran from the last request's start, so a sandbox
        # whose client had waited out a long command was idle at once, and reaped before the
        # client's next request came
        try:
            result = handle.wait()
            entry.last_used = time.time()
            recorded.finish(("result", result))
        except SandboxError as exc:
            entry.last_used = time.time()
            recorded.finish(("failed", exc))
        finally:
            running_share()  # what it keeps now is counted by its record

    threading.Thread(target=wait, name="corral-background-wait", daemon=True).start()
    return handle


@router.get(PREFIX, summary="List the running commands")
async def list_commands(sandbox_id: str, who: Tenant, ctx: Context) -> dict[str, Any]:
    entry = ctx.manager.get(who, sandbox_id)
    # off the event loop: a microVM fork's carried commands are each a round trip to its guest's
    # agent (up to 60 s), and a guest that froze its agent held every tenant's requests that long
    commands = await ctx.run_control(who, entry.sandbox.commands.list)
    return {"commands": [c.to_dict() for c in commands]}


@router.delete(PREFIX + "/{pid}", status_code=204, summary="Kill a running command (404 if none has this pid)")
async def kill_command(sandbox_id: str, pid: int, who: Tenant, ctx: Context) -> Response:
    entry = ctx.manager.get(who, sandbox_id)
    # a kill or a signal is not held behind the tenant's own long commands (it may be what ends them)
    if not await ctx.run_control(who, entry.sandbox.commands.kill, pid):
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
        await ctx.run_control(who, lambda: entry.sandbox.commands.connect(pid).send_signal(body.signal))
    except InvalidSpec as exc:
        return error_response(404, "not_found", str(exc))
    return Response(status_code=204)


@router.websocket(PREFIX + "/{pid}/stream")
async def attach_command(websocket: WebSocket, sandbox_id: str, pid: int) -> None:
    ctx = context_of(websocket)
    await websocket.accept()
    try:
        tenant = ctx.tenant_of(websocket.headers.get("authorization"))
        entry = ctx.manager.get(tenant, sandbox_id)
        recorded = entry.background.get(pid)
        if recorded is None:
            raise InvalidSpec(f"no background command with pid {pid} in sandbox {sandbox_id}")
    except SandboxError as exc:
        from .stream import _send_error

        await _send_error(websocket, exc)
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()
    undelivered = Undelivered(ctx.output_shares, tenant)

    def listener(event: Event) -> None:
        undelivered.queued(event)
        loop.call_soon_threadsafe(queue.put_nowait, event)

    async def watch() -> None:
        # a client that leaves must end this handler now, not when the command next writes or ends
        # (a quiet command kept every closed attachment's handler and queue until then)
        with contextlib.suppress(Exception):
            while (await websocket.receive())["type"] != "websocket.disconnect":
                pass
        queue.put_nowait(("gone", None))

    for event in recorded.attach(listener):
        undelivered.queued(event)
        queue.put_nowait(event)
    frames = OutputFrames()
    watcher = asyncio.create_task(watch())
    try:
        while True:
            event = await queue.get()
            kind, payload = event
            if kind == "gone":
                break
            if kind in ("stdout", "stderr"):
                frame = frames.frame(kind, payload)
                if frame:
                    await websocket.send_json(frame)
                undelivered.sent(event)
                continue
            for frame in frames.flush():  # the end of its output, before its result
                await websocket.send_json(frame)
            if kind == "result":
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
        while not queue.empty():
            queue.get_nowait()
        if undelivered.end() >= TRIM_AFTER:
            return_free_memory()  # glibc kept the freed chunks resident (+110 MiB a 2 x 64 MiB attachment)
        with contextlib.suppress(Exception):
            await websocket.close()
