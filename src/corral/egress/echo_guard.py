"""What a secret-bound server answers, made safe before any byte of it reaches the sandbox.

The response is parsed as HTTP/1.x: its framing (``Content-Length``, chunked, or
until close) is undone, its content codings are decoded (gzip and deflate always;
br and zstd when the ``brotli`` / ``zstandard`` modules are importable), and the
decoded bytes go through an :class:`~.echo_forms.EchoStream`.  What comes out is
served decoded and re-framed (chunked to an HTTP/1.1 client, until close to an
HTTP/1.0 one), because a replacement changes lengths and a compressed body
cannot be patched in place.  The head is scanned whole.

Refused rather than passed on (an error reply when nothing was sent yet, else the
connection is cut so that the client sees a truncated transfer): a coding that
cannot be decoded here, a malformed body, and, after ``101 Switching Protocols``
(where frames carry their own lengths and nothing can be replaced), any echo.
"""

from __future__ import annotations

import contextlib
import importlib
import socket
import ssl
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from ..host import fdwait
from .echo_forms import EchoMatcher, EchoStream, Form

MAX_HEAD = 64 * 1024
#: bytes read from a secret-bound server at a time (TLS hands out at most a record, 16 KiB); larger
#: reads measured slower here: each copy of a buffer that size is a fresh mmap, page faults included
RECV_SIZE = 256 * 1024
#: decoded bytes produced per step: a small compressed body may expand enormously
STEP = 1 << 20
_DROPPED = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"trailer"}


class Cut(Exception):
    """The response cannot be passed on safely: stop, sending ``reply`` if nothing was sent yet."""

    def __init__(self, rule: str | None, reply: bytes = b"") -> None:
        super().__init__(rule)
        self.rule = rule
        self.reply = reply


def _bad_gateway(text: str) -> bytes:
    body = f"corral egress: {text}\n".encode()
    return (b"HTTP/1.1 502 Bad Gateway\r\nConnection: close\r\nContent-Type: text/plain\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _Inflate:
    """gzip (several members too) and deflate (zlib-wrapped, or raw as some servers send it)."""

    def __init__(self, gzip: bool) -> None:
        self._gzip = gzip
        self._d: Any = zlib.decompressobj(31) if gzip else None
        self._first = b""

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self._d is None:  # deflate: a zlib header, or none at all; two bytes tell
            data = self._first + data
            if len(data) < 2:
                self._first = data
                return
            zlib_header = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._d = zlib.decompressobj(15 if zlib_header else -15)
        while data:
            if self._d.eof:
                if not self._gzip:
                    return  # trailing bytes after a deflate stream mean nothing
                data, self._d = self._d.unused_data + data, zlib.decompressobj(31)
                continue
            out = self._d.decompress(data, STEP)
            data = self._d.unconsumed_tail
            if self._d.eof and self._d.unused_data and self._gzip:
                data = self._d.unused_data + data
                self._d = zlib.decompressobj(31)
            if out:
                yield out

    def finish(self) -> Iterator[bytes]:
        if self._d is None and self._first:  # a single byte: no zlib header
            self._d = zlib.decompressobj(-15)
            yield from self.feed(self._first)
        if self._d is not None and not self._d.eof:
            tail = self._d.flush()
            if tail:
                yield tail


class _Library:
    """br or zstd through a module that may or may not be installed."""

    def __init__(self, step: Callable[[bytes], bytes]) -> None:
        self._step = step

    def feed(self, data: bytes) -> Iterator[bytes]:
        out = self._step(data) if data else b""
        if out:
            yield out

    def finish(self) -> Iterator[bytes]:
        return iter(())


def _decoder(coding: str) -> _Inflate | _Library | None:
    if coding in ("gzip", "x-gzip"):
        return _Inflate(gzip=True)
    if coding == "deflate":
        return _Inflate(gzip=False)
    try:
        if coding == "br":
            brotli: Any = importlib.import_module("brotli")
            return _Library(brotli.Decompressor().process)
        if coding == "zstd":
            zstandard: Any = importlib.import_module("zstandard")
            return _Library(zstandard.ZstdDecompressor().decompressobj().decompress)
    except ImportError:
        return None
    return None


class _Dechunker:
    """``Transfer-Encoding: chunked`` undone; trailers are read and dropped."""

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0
        self._state = "size"
        self.done = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        buf = self._buf + data if self._buf else data
        pos = 0
        while pos < len(buf) and not self.done:
            if self._state == "data":
                n = min(self._left, len(buf) - pos)
                yield buf[pos:pos + n]
                pos += n
                self._left -= n
                if not self._left:
                    self._state = "crlf"
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if len(buf) - pos > 4096:
                    raise Cut("malformed-response")
                break
            line, pos = buf[pos:end], end + 2
            if self._state == "crlf":
                if line:
                    raise Cut("malformed-response")
                self._state = "size"
            elif self._state == "size":
                try:
                    self._left = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise Cut("malformed-response")
                self._state = "data" if self._left else "trailer"
            elif not line:  # the blank line after the trailers
                self.done = True
        self._buf = buf[pos:]


class ResponseGuard:
    """Feed it what the server sends; send on what it yields.  ``done`` once the response ended."""

    def __init__(self, matcher: EchoMatcher, echoed: Callable[[Form, str], None], *,
                 head_request: bool = False, http11_client: bool = True) -> None:
        self._matcher = matcher
        self._echoed = echoed
        self._head_request = head_request
        self._http11 = http11_client
        self._reported: set[tuple[str, str]] = set()
        self._buf = bytearray()  # the head so far (appended in place)
        self._searched = 0  # where in it the search for its end resumes: only new bytes are searched
        self._state = "head"  # head, body, opaque, done
        self._codings: list[str] = []
        self._decoders: list[_Inflate | _Library] = []
        self._dechunk: _Dechunker | None = None
        self._left: int | None = None  # Content-Length still to come
        self._chunked_out = False
        self._scan = EchoStream(matcher, lambda form: self._found(form))
        self._in_head = False
        self.done = False

    def _found(self, form: Form) -> None:
        if self._in_head:
            where = f"{form.encoding} in the head"
        else:
            where = form.encoding + (f" inside {'+'.join(self._codings)}" if self._codings else "")
        if (form.secret, where) not in self._reported:
            self._reported.add((form.secret, where))
            self._echoed(form, where)
        if self._state == "opaque":
            raise Cut(None)

    # -- the head ------------------------------------------------------------
    def _head(self, head: bytes) -> Iterator[bytes | memoryview]:
        lines = head.split(b"\r\n")
        try:
            code = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise Cut("malformed-response", _bad_gateway("the server's response could not be read"))
        headers = [(line.split(b":", 1)[0].strip().lower(), line) for line in lines[1:] if line]

        def tokens(name: bytes) -> list[str]:
            values = b",".join(line.split(b":", 1)[1] for n, line in headers if n == name)
            return [t.strip().decode("latin-1").lower() for t in values.split(b",") if t.strip()]

        transfer, content = tokens(b"transfer-encoding"), tokens(b"content-encoding")
        interim = 100 <= code < 200 and code != 101
        out = [lines[0]]
        if interim or code == 101:
            rewritten = self._rewrite_head(out + [line for _, line in headers])
            self._state = "opaque" if code == 101 else "head"
            yield rewritten
            return
        chunked = bool(transfer) and transfer[-1] == "chunked"
        self._codings = [c for c in content + [t for t in transfer if t != "chunked"] if c != "identity"]
        for coding in reversed(self._codings):
            decoder = _decoder(coding)
            if decoder is None:
                raise Cut(f"unscannable-encoding:{coding}",
                          _bad_gateway(f"a response in content coding {coding!r} cannot be checked for "
                                       "brokered secrets here (the proxy asked for identity)"))
            self._decoders.append(decoder)
        has_body = not (self._head_request or code in (204, 304))
        length = [line.split(b":", 1)[1].strip() for n, line in headers if n == b"content-length"]
        for name, line in headers:
            if name in _DROPPED and not (name == b"content-length" and not has_body and not self._codings):
                continue
            if name == b"content-encoding":
                continue
            out.append(line)
        out.append(b"Connection: close")
        if has_body:
            self._chunked_out = self._http11
            if self._chunked_out:
                out.append(b"Transfer-Encoding: chunked")
            if chunked:
                self._dechunk = _Dechunker()
            elif not transfer and length:
                try:
                    self._left = int(length[0])
                except ValueError:
                    raise Cut("malformed-response", _bad_gateway("the server's Content-Length is not a number"))
        self._state = "body" if has_body else "done"
        yield self._rewrite_head(out)

    def _rewrite_head(self, lines: list[bytes]) -> bytes:
        head = b"\r\n".join(lines) + b"\r\n\r\n"
        self._in_head = True
        try:
            return bytes(self._matcher.rewrite(head, len(head), lambda f: self._found(f))[0])
        finally:
            self._in_head = False

    # -- the body --------------------------------------------------------------
    def _decoded(self, data: bytes, last: bool) -> Iterator[bytes]:
        pieces: Iterator[bytes] = iter((data,))
        try:
            for decoder in self._decoders:
                pieces = self._through(decoder, pieces, last)
            yield from pieces
        except zlib.error:
            raise Cut("malformed-response")

    @staticmethod
    def _through(decoder: _Inflate | _Library, pieces: Iterator[bytes], last: bool) -> Iterator[bytes]:
        for piece in pieces:
            yield from decoder.feed(piece)
        if last:
            yield from decoder.finish()

    def _frame(self, data: bytes | memoryview) -> Iterator[bytes | memoryview]:
        if not data:
            return
        if self._chunked_out:
            yield b"%x\r\n" % len(data)
            yield data
            yield b"\r\n"
        else:
            yield data

    def _body(self, data: bytes, last: bool) -> Iterator[bytes | memoryview]:
        for piece in self._decoded(data, last):
            yield from self._frame(self._scan.feed(piece))
        if last:
            yield from self._frame(self._scan.finish())
            if self._chunked_out:
                yield b"0\r\n\r\n"
            self._state = "done"

    # -- what the copy loop calls ------------------------------------------------
    def feed(self, data: bytes) -> Iterator[bytes | memoryview]:
        """What the server sent, in; what the client may see, out (possibly nothing yet)."""
        if self._state == "head":
            # a head the server dribbles costs the owner by its length, not its square: each piece
            # was copied with all before it and the whole searched again
            self._buf += data
            while self._state == "head":
                end = self._buf.find(b"\r\n\r\n", self._searched)
                if end < 0:
                    if len(self._buf) > MAX_HEAD:
                        raise Cut("malformed-response", _bad_gateway("the server's response head is too large"))
                    self._searched = max(0, len(self._buf) - 3)
                    return
                head, rest = bytes(self._buf[:end]), bytes(self._buf[end + 4:])
                self._buf, self._searched = bytearray(), 0
                yield from self._head(head)
                if self._state == "head":  # an interim (1xx) response: the real head follows
                    self._buf = bytearray(rest)
            data = rest
        if self._state == "opaque":
            yield from self._frame(self._scan.feed(data))  # never chunked: 101 leaves HTTP behind
        elif self._state == "body":
            yield from self._body_feed(data)
        self.done = self._state == "done"

    def _body_feed(self, data: bytes) -> Iterator[bytes | memoryview]:
        if self._dechunk is not None:
            for piece in self._dechunk.feed(data):
                yield from self._body(piece, False)
            if self._dechunk.done:
                yield from self._body(b"", True)
        elif self._left is not None:
            data = data[:self._left]
            self._left -= len(data)
            yield from self._body(data, self._left == 0)
        elif data:
            yield from self._body(data, False)

    def finish(self) -> Iterator[bytes | memoryview]:
        """The server closed.  A body that had a length or chunks and did not end is passed on
        scanned but unterminated, so that the client sees the truncation the server caused."""
        if self._state == "opaque":
            yield from self._frame(self._scan.finish())
        elif self._state == "body":
            complete = self._dechunk is None and self._left is None
            if complete:
                yield from self._body(b"", True)
            else:
                for piece in self._decoded(b"", True):
                    yield from self._frame(self._scan.feed(piece))
                yield from self._frame(self._scan.finish())
        elif self._state == "head" and self._buf:
            raise Cut("malformed-response", _bad_gateway("the server closed before its response head ended"))
        self._state = "done"
        self.done = True


def copy_guarded(client: socket.socket, server: socket.socket, guard: ResponseGuard,
                 refused: Callable[[str], None]) -> None:
    """Copy both ways on one thread (an SSL object must not be shared between threads); what the
    server sends goes through ``guard`` first.  Returns once the response is over or was cut."""
    client.settimeout(None)
    server.settimeout(None)
    sent = False
    open_ = {client, server}
    try:
        while open_:
            ready: list[socket.socket] = [s for s in open_ if isinstance(s, ssl.SSLSocket) and s.pending()]
            if not ready:
                ready = fdwait.readable(list(open_))
            for sock in ready:
                try:
                    data = sock.recv(RECV_SIZE)
                except ssl.SSLWantReadError:
                    continue
                except (OSError, ssl.SSLError):
                    data = b""
                if sock is server:
                    pieces = list(guard.feed(data) if data else guard.finish())
                    if pieces:
                        _send(client, pieces)
                        sent = True
                    if guard.done:
                        with contextlib.suppress(OSError, ssl.SSLError):
                            client.shutdown(socket.SHUT_WR)
                        return  # the response is over: so is the request (one per connection)
                elif data:
                    server.sendall(data)
                else:
                    open_.discard(client)
                    with contextlib.suppress(OSError, ssl.SSLError):
                        server.shutdown(socket.SHUT_WR)
    except Cut as cut:
        if cut.rule:
            refused(cut.rule)
        if cut.reply and not sent:
            with contextlib.suppress(OSError, ssl.SSLError):
                client.sendall(cut.reply)
        # otherwise the connection closes mid-response: the client sees the transfer cut short


def _send(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    """One system call for a chunk's size line, data and CRLF where the socket allows it."""
    if isinstance(sock, ssl.SSLSocket) or len(pieces) == 1:
        sock.sendall(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        return
    views = [memoryview(p) for p in pieces]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
