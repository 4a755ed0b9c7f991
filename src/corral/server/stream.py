"""``/v1/sandboxes/{id}/exec/stream``: a command's output as it is produced.

Protocol (JSON text frames):

* client, first frame: ``{"cmd": "..." | [...], "timeout": s, "env": {...}, "cwd": "...", "pty": [rows, cols], "user": "root"}``
  (``pty`` optional: the command runs on a terminal and all output arrives as stdout)
* server: ``{"type": "started"}``, then ``{"type": "stdout"|"stderr", "data": text}`` in the order
  the sandbox produced them (a chunk that is not UTF-8 also has ``"data_b64"``: its exact bytes,
  base64; ``data`` then has U+FFFD in their place: :class:`~corral.server.wire.OutputFrames`), then ``{"type": "result", ...}`` (fields of ``corral run --json``), then close.
* client, any time: ``{"type": "stdin", "data": text}`` (or ``"data_b64"``: any bytes, base64), ``{"type": "stdin_close"}``,
  ``{"type": "signal", "signal": N}``, ``{"type": "kill"}``, ``{"type": "resize", "rows": R, "cols": C}``
  (a command started with ``pty``; otherwise answered with an error frame).
* stdin is flow-controlled: with ``"stdin_acks": true`` in the first frame (the SDKs send it), the
  "started" frame says ``stdin_window`` (bytes), the server answers
  each stdin frame with ``{"type": "stdin_ack", "bytes": n}`` once the command has it (or it was
  dropped after a ``stdin_not_taken`` error), and a client keeps at most ``stdin_window`` bytes
  unacknowledged.  Control frames are never queued behind stdin: a kill, a signal and the
  connection's keepalive pings go through while the command is slow to read.  A client that
  sends more is not read from until there is room (its pings then wait too).
* errors: ``{"type": "error", "error": code, "message": text}``, then close.  A control frame the
  stream cannot take (not JSON, unknown, or binary: stdin bytes go as ``data_b64``) is answered
  with such an error frame and the stream goes on; a first frame that is not an exec request
  closes it (``4400``).

Closing the socket kills the command's whole process tree.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from ..errors import InvalidSpec, ResourceLimit, SandboxError, StdinNotTaken
from .context import context_of
from .limits import TenantTally
from .wire import OutputFrames, StreamExecBody, parse_json, require_unicode, status_for

if TYPE_CHECKING:
    from ..commands import CommandHandle

#: close codes: 4000 + the HTTP status the same error gets over REST
CLOSE_NORMAL = 1000
#: stdin bytes a client may have sent on one stream that the command does not have yet: two of
#: the SDK's 4 MiB frames, so one is under way while the next is read
STDIN_STREAM_WINDOW = 8 << 20


router = APIRouter()


async def _send_error(websocket: WebSocket, exc: SandboxError) -> None:
    with contextlib.suppress(Exception):
        await websocket.send_json({"type": "error", "error": exc.code, "message": str(exc)})
        await websocket.close(code=4000 + status_for(exc))


@router.websocket("/v1/sandboxes/{sandbox_id}/exec/stream")
async def exec_stream(websocket: WebSocket, sandbox_id: str) -> None:
    ctx = context_of(websocket)
    await websocket.accept()
    manager = ctx.manager
    metrics = ctx.metrics
    try:
        tenant = ctx.tenant_of(websocket.headers.get("authorization"))
        entry = manager.get(tenant, sandbox_id)
        try:
            first = await asyncio.wait_for(_receive_text(websocket), timeout=30)
            if first is None:
                raise InvalidSpec(BINARY_REFUSED)
            body = StreamExecBody.model_validate(parse_json(first, "first frame"))
            require_unicode(body.model_dump())
        except (ValueError, ValidationError) as exc:
            raise InvalidSpec(f"first frame must be a JSON exec request {{cmd, timeout, env, cwd, pty}}: {exc}") from None
        except TimeoutError:
            raise InvalidSpec("no exec request received within 30 s") from None
    except SandboxError as exc:
        await _send_error(websocket, exc)
        return
    except WebSocketDisconnect:
        return

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    frames = OutputFrames()

    # what is streamed is capped like what is kept (max_output per stream; the result says
    # "truncated"), so a command writing without end to a client that does not read cannot make
    # the server buffer without bound
    room = {"stdout": entry.spec.limits.max_output, "stderr": entry.spec.limits.max_output}

    def on_output(stream: str, chunk: bytes) -> None:  # called on the sandbox's reader thread
        if room[stream] <= 0:
            return
        chunk = chunk[: room[stream]]
        room[stream] -= len(chunk)
        loop.call_soon_threadsafe(queue.put_nowait, (stream, chunk))

    # a client that does not read holds up to 2 x max_output queued here, counted for its tenant
    release = await ctx.hold_output(tenant, entry.spec.limits.max_output)
    try:
        with manager.exec_slot(entry):
            handle: CommandHandle = await ctx.run_for(
                tenant, entry.sandbox.commands.start, body.cmd, timeout=body.timeout, env=body.env, cwd=body.cwd,
                on_output=on_output, pty=body.pty, user=body.user)

            # "started" means the process exists: a signal or kill sent before the agent forked it
            # would find nothing to hit and the command would run on regardless
            await ctx.run_for(tenant, _wait_until_forked, handle)

            def wait_then_report() -> None:
                # queued after every output chunk the reader thread delivered before the exit
                try:
                    result = handle.wait()
                    loop.call_soon_threadsafe(queue.put_nowait, ("result", result))
                except BaseException as exc:
                    loop.call_soon_threadsafe(queue.put_nowait, ("failed", exc))

            # the tenant's thread share is held while the command runs, like a blocking exec's
            waiter = asyncio.ensure_future(ctx.run_for(tenant, wait_then_report))
            # stdin the command has not taken yet counts with the tenant's WebSocket messages held
            # (8 streams whose commands read nothing held 2 x 12 MiB frames each: +520 MiB)
            control = functools.partial(ctx.run_control, tenant)
            stdin = _StdinWriter(websocket, control, handle, body.stdin_acks, ctx.ws_messages, tenant)
            receiver = asyncio.create_task(_receive_control(websocket, handle, queue, body.pty is not None,
                                                            control, stdin))
            try:
                started: dict[str, Any] = {"type": "started", "pid": handle.pid}
                if body.stdin_acks:
                    started["stdin_window"] = STDIN_STREAM_WINDOW
                await websocket.send_json(started)
                await _pump(websocket, queue, frames, metrics, sandbox_id)
            finally:
                receiver.cancel()
                stdin.cancel()  # (also if the reader never ran)
                # no-op once the command ended; kills the tree if the client left early
                with contextlib.suppress(Exception):
                    await ctx.run_control(tenant, handle.kill)
                with contextlib.suppress(BaseException):
                    await waiter
    except SandboxError as exc:
        await _send_error(websocket, exc)
    except UnicodeError as exc:
        await _send_error(websocket, InvalidSpec(f"text is not valid Unicode (lone surrogate?): {exc}"))
    except (WebSocketDisconnect, RuntimeError):
        return
    finally:
        release()


def _wait_until_forked(handle: CommandHandle, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while handle.pid is None and time.monotonic() < deadline:
        time.sleep(0.001)


async def _pump(websocket: WebSocket, queue: asyncio.Queue[tuple[str, Any]],
                frames: OutputFrames, metrics: Any, sandbox_id: str) -> None:
    while True:
        kind, payload = await queue.get()
        if kind in ("stdout", "stderr"):
            frame = frames.frame(kind, payload)
            if frame:
                await websocket.send_json(frame)
        elif kind == "result":
            for frame in frames.flush():
                await websocket.send_json(frame)
            metrics.record_exec(payload.timed_out, payload.oom_killed)
            await websocket.send_json({"type": "result", "sandbox_id": sandbox_id, **payload.to_dict()})
            await websocket.close(code=CLOSE_NORMAL)
            return
        elif kind == "failed":
            if isinstance(payload, SandboxError):
                raise payload
            raise SandboxError(f"command failed: {payload}")
        elif kind == "disconnect":
            raise WebSocketDisconnect(code=1001)


class _StdinWriter:
    """One stream's stdin, written to its command in order by a task of its own while the
    stream's reader goes on reading control frames (a write waits while the command does not
    read, as a pipe's writer does; the reader must not).  What is queued is bounded by
    :data:`STDIN_STREAM_WINDOW`: past it the reader waits for room; and counted for the tenant in
    ``held`` (its WebSocket messages held by the server): past that bound a frame is refused."""

    def __init__(self, websocket: WebSocket, run: Callable[..., Awaitable[Any]], handle: CommandHandle,
                 acks: bool, held: TenantTally, tenant: str) -> None:
        self._held, self._tenant = held, tenant
        self._websocket = websocket
        self._acks = acks
        self._run = run
        self._handle = handle
        #: stdin chunks (or None: close stdin) not yet written, and their bytes
        self._queue: collections.deque[bytes | None] = collections.deque()
        self._queued = 0
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._write_all())

    async def put(self, item: bytes | None) -> None:
        size = len(item or b"")
        # counted from now: while it waits for room it is held here too
        if size and not self._held.take(self._tenant, size):
            await self._websocket.send_json({"type": "error", "error": ResourceLimit.code, "message": (
                f"stdin: {size} bytes more would pass this tenant's bytes of WebSocket messages held in the "
                "server (max_request_bytes_per_tenant): send it again once its commands have read what they were "
                "sent")})
            return
        try:
            while item is not None and self._queued and self._queued + size > STDIN_STREAM_WINDOW:
                self._changed.clear()
                await self._changed.wait()
        except BaseException:  # cancelled: the stream ends
            if size:
                self._held.give(self._tenant, size)
            raise
        self._queue.append(item)
        self._queued += size
        self._changed.set()

    def _taken(self, size: int) -> None:
        """``size`` bytes of what was queued are written or dropped: no longer counted."""
        self._queued -= size
        if size:
            self._held.give(self._tenant, size)

    def cancel(self) -> None:
        self._task.cancel()
        self._taken(self._queued)

    async def _ack(self, size: int) -> None:
        if self._acks:
            await self._websocket.send_json({"type": "stdin_ack", "bytes": size})

    async def _write_all(self) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):  # the client left
            await self._write_in_order()

    async def _write_in_order(self) -> None:
        while True:
            while not self._queue:
                self._changed.clear()
                await self._changed.wait()
            item = self._queue[0]
            try:
                if item is None:
                    await self._run(self._handle.close_stdin)
                else:
                    await self._run(self._handle.send_stdin, item)
            except StdinNotTaken as exc:
                # what is queued behind it is dropped too (acknowledged, so a client waiting for
                # room goes on), and the client's next stdin call says so
                await self._websocket.send_json({"type": "error", "error": exc.code, "message": str(exc)})
                dropped = [chunk for chunk in self._queue if chunk is not None]
                self._queue = collections.deque(chunk for chunk in self._queue if chunk is None)
                self._taken(self._queued)
                self._changed.set()
                await self._ack(sum(len(chunk) for chunk in dropped))
                continue
            except SandboxError:
                return  # the command already ended: its result is on its way
            self._queue.popleft()
            self._taken(len(item or b""))
            self._changed.set()
            if item is not None:
                await self._ack(len(item))


BINARY_REFUSED = ("binary frames are not part of the exec stream: send JSON text frames "
                  "(bytes for stdin as {\"type\": \"stdin\", \"data_b64\": ...})")


async def _receive_text(websocket: WebSocket) -> str | None:
    """The next frame's text; None for a binary frame; raises WebSocketDisconnect when the client left."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
    text = message.get("text")
    return text if isinstance(text, str) else None


async def _refuse(websocket: WebSocket, message: str) -> None:
    await websocket.send_json({"type": "error", "error": InvalidSpec.code, "message": message})


async def _receive_control(websocket: WebSocket, handle: CommandHandle, queue: asyncio.Queue[tuple[str, Any]],
                           has_pty: bool, run: Callable[..., Awaitable[Any]], stdin: _StdinWriter) -> None:
    # this reader is what notices the client leaving (and so what gets the command killed): a
    # frame it cannot take is refused and reading goes on, and however it ends but by the
    # command's own end, the stream ends with it (a binary frame once ended it silently, and
    # the command then ran on after the client closed)
    command_ended = False
    try:
        while websocket.application_state == WebSocketState.CONNECTED:
            text = await _receive_text(websocket)
            if text is None:
                await _refuse(websocket, BINARY_REFUSED)
                continue
            try:
                message = parse_json(text, "control frame")
            except ValueError as exc:  # not JSON, or (InvalidSpec) nested too deep
                await _refuse(websocket, str(exc) if isinstance(exc, InvalidSpec) else "control frames must be JSON")
                continue
            finally:
                del text  # a stdin frame's text is not kept while its bytes wait for the command
            await _control(websocket, handle, message, has_pty, run, stdin)
            del message
    except SandboxError:
        command_ended = True  # its result is on its way
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        stdin.cancel()
        if not command_ended:
            queue.put_nowait(("disconnect", None))


async def _control(websocket: WebSocket, handle: CommandHandle, message: Any, has_pty: bool,
                   run: Callable[..., Awaitable[Any]], stdin: _StdinWriter) -> None:
    # each call to the command goes to a thread (``run``), never on the event loop: a write to a
    # sandbox's agent waits while the agent does not read (a fifo once held one for ever, and the
    # whole server's loop with it); stdin in order by its writer, the rest at once
    kind = message.get("type") if isinstance(message, dict) else None
    if kind == "stdin" and isinstance(message.get("data_b64"), str):
        try:
            data = base64.b64decode(message.pop("data_b64"), validate=True)
        except binascii.Error:
            await _refuse(websocket, "stdin: data_b64 is not base64")
            return
        await stdin.put(data)
    elif kind == "stdin" and isinstance(message.get("data"), str):
        try:
            data = message.pop("data").encode()
        except UnicodeEncodeError:
            await _refuse(websocket, "stdin: text is not valid Unicode (a lone surrogate)")
            return
        await stdin.put(data)
    elif kind == "stdin_close":
        await stdin.put(None)
    elif kind == "signal" and isinstance(message.get("signal"), int) and 1 <= message["signal"] <= 64:
        await run(handle.send_signal, message["signal"])
    elif kind == "kill":
        await run(handle.kill)
    elif kind == "resize":
        rows, cols = message.get("rows"), message.get("cols")
        if not has_pty:
            problem = "the command was not started with pty"
        elif not all(isinstance(n, int) and 0 < n < 10000 for n in (rows, cols)):
            problem = "rows and cols must be whole numbers from 1 to 9999"
        else:
            await run(handle.resize, rows, cols)
            return
        await _refuse(websocket, f"resize: {problem}")
    else:
        await _refuse(websocket, f"unknown control frame {str(message)[:200]!r}")
