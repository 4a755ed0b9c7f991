"""Test targets for the egress tests, run inside a test network namespace.

``python egress_targets.py CONFIG.json`` serves every server in the config and
prints ``ready``.  Each request is logged (server, path, headers) as one JSON
line to the config's log file, which the test reads to see what arrived.
``/bytes/N`` streams N bytes; ``/git/...`` is ``git http-backend`` (smart HTTP).
"""

from __future__ import annotations

import gzip
import importlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from echo_payloads import echo_body, ordinary_body

LOCK = threading.Lock()
with open(sys.argv[1]) as _config:
    CONFIG: dict[str, Any] = json.load(_config)


def make_handler(name: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _log(self) -> None:
            with LOCK, open(CONFIG["log"], "a") as f:
                f.write(json.dumps({"server": name, "method": self.command, "path": self.path,
                                    "headers": dict(self.headers.items())}) + "\n")

        def do_GET(self) -> None:
            self._log()
            if self.path.startswith("/git/"):
                return self._git()
            if self.path.startswith("/bytes/"):
                total = int(self.path.split("/")[2])
                self.send_response(200)
                self.send_header("Content-Length", str(total))
                self.end_headers()
                block = b"x" * (1 << 20)
                while total > 0:
                    self.wfile.write(block[: min(total, len(block))])
                    total -= min(total, len(block))
                return
            if self.path.startswith(("/echoenc", "/ordinary")):
                return self._encoded()
            if self.path.startswith("/redirect?to="):  # an open redirect (the browser test aims it at metadata)
                self.send_response(302)
                self.send_header("Location", parse_qs(urlsplit(self.path).query)["to"][0])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path.startswith("/html/"):  # a page a test wrote next to the log (tests/test_browser.py)
                page = os.path.join(os.path.dirname(CONFIG["log"]), "html", os.path.basename(self.path))
                with open(page, "rb") as f:
                    html = f.read()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(html)))
                self.end_headers()
                self.wfile.write(html)
                return
            if self.path.startswith("/echo"):  # a careless API that echoes a credential back
                body = f"you sent {self.headers.get('X-Key')}\n".encode()
            else:
                body = f"hello from {name}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _encoded(self) -> None:
            """``/echoenc``: X-Key back in every encoding of echo_payloads; ``/ordinary``: data with no
            secret.  ``?ce=gzip|deflate|br|zstd|bad-gzip`` is applied whatever the client accepts;
            ``?chunk=N`` sends chunked, N bytes a chunk, each its own write."""
            query = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
            body = echo_body(self.headers.get("X-Key", "")) if self.path.startswith("/echoenc") else ordinary_body()
            coding = query.get("ce", "identity")
            if coding == "gzip":
                body = gzip.compress(body)
            elif coding == "bad-gzip":
                body = gzip.compress(body)[:40] + b"not gzip at all" * 4
            elif coding == "deflate":
                body = zlib.compress(body)
            elif coding in ("br", "zstd"):
                try:  # the library if installed; if not, bytes that a proxy without it cannot check either
                    module = importlib.import_module("brotli" if coding == "br" else "zstandard")
                    body = module.compress(body)
                except ImportError:
                    body = b"\x1b opaque " + body[::-1]
            self.send_response(200)
            if coding != "identity":
                self.send_header("Content-Encoding", "gzip" if coding == "bad-gzip" else coding)
            chunk = int(query.get("chunk", 0))
            self.send_header("Transfer-Encoding" if chunk else "Content-Length", "chunked" if chunk else str(len(body)))
            self.end_headers()
            if not chunk:
                self.wfile.write(body)
                return
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(0, len(body), chunk):
                piece = body[i:i + chunk]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")

        def do_POST(self) -> None:
            self._log()
            self._git()

        def _git(self) -> None:
            path, _, query = self.path[len("/git"):].partition("?")
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            env = {
                "PATH": "/usr/bin:/bin", "GIT_PROJECT_ROOT": CONFIG["git_root"], "GIT_HTTP_EXPORT_ALL": "1",
                "PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": self.command,
                "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
                "REMOTE_ADDR": "10.0.0.1", "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
                "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
            }
            out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True).stdout
            head, _, payload = out.partition(b"\r\n\r\n")
            status = 200
            headers = []
            for line in head.split(b"\r\n"):
                key, _, value = line.decode().partition(":")
                if key.lower() == "status":
                    status = int(value.split()[0])
                elif key:
                    headers.append((key, value.strip()))
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler


def main() -> None:
    servers = []
    for spec in CONFIG["servers"]:
        family_server = type("S", (ThreadingHTTPServer,), {"daemon_threads": True})
        server = family_server((spec["addr"], spec["port"]), make_handler(spec["name"]))
        if spec.get("cert"):
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(spec["cert"], spec["key"])
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    try:
        sys.stdin.read()  # serve until the test closes our stdin
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
