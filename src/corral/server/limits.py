"""Request-size limit as a plain ASGI middleware: answered before any handler reads the body.

A declared ``Content-Length`` over the limit is refused at once; a chunked body
is buffered up to the limit and refused as soon as it goes over, so a client
can neither make the server buffer without bound nor reach a handler with a
half-read body.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"error": "resource_limit",
                           "message": f"request body is larger than the server's limit of {self.max_bytes} bytes"})
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body.encode()})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared < 0 or declared > self.max_bytes:
                await self._refuse(send)
                return
        # count what actually arrives, whatever was declared
        chunks: list[bytes] = []
        total = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        await self.app(scope, replay_body(b"".join(chunks), receive), send)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app ``body`` (already read from ``receive``) as one message,
    then whatever ``receive`` says next (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
