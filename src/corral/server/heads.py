"""uvicorn's httptools protocol with a bound on a request's head (its request line and headers).

httptools keeps a URL or header being received in memory however long it grows, and uvicorn
sets no bound: one connection sending an endless header grew the server by a MiB per MiB sent
(360 MiB and on), before any key could be checked.  Past :data:`MAX_HEAD` bytes of one head the
client is answered 431 and the connection closed (h11, uvicorn's other parser, has such a bound
of its own: 16 KiB).
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: bytes of one request's head a client may send (uvicorn's h11 allows 16 KiB, nginx 8-32 KiB)
MAX_HEAD = 64 << 10

_BODY = json.dumps({"error": "resource_limit",
                    "message": f"the request's line and headers are over the server's {MAX_HEAD} bytes"}).encode()
_REFUSAL = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


class BoundedHeadProtocol(HttpToolsProtocol):
    #: a head is being received (from the connection's start, and after each request's end)
    _head_open = True
    #: its bytes so far
    _head_bytes = 0
    #: heads received whole on this connection
    _heads_done = 0

    def data_received(self, data: bytes) -> None:
        was_open, heads_done = self._head_open, self._heads_done
        super().data_received(data)
        # all of ``data`` is head only if a head was open before and after it and none ended in it
        # (a chunk where one ended, or where a new one began, is not counted: at most one read more)
        if not (was_open and self._head_open and heads_done == self._heads_done):
            return
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD and not self.transport.is_closing():
            self._head_open = False
            self.transport.write(_REFUSAL)
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._head_open, self._head_bytes = False, 0
        self._heads_done += 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open = True
