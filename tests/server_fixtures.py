"""A real ``corral serve`` process on a free loopback port, for the server tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

CORRAL = str(Path(sys.executable).with_name("corral"))
KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef00"}


def mcp_stdio(state_dir: Path, name: str, *args: str) -> tuple[Any, Path]:
    """``corral mcp [args]`` on stdio as the MCP SDK's ``stdio_client`` starts it, with a state
    directory of its own (``state_dir/name``): its server parameters, and that directory."""
    from mcp import StdioServerParameters

    state = state_dir / name
    state.mkdir()
    os.chmod(state_dir, 0o711)  # sandbox launchers (unprivileged uids) traverse it
    env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_API_KEY")}
    return StdioServerParameters(command=CORRAL, args=["--state-dir", str(state), "mcp", *args], env=env), state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, state: Path, *args: str, keys: dict[str, str] | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.state = state
        self.args = list(args)
        self.keys = keys
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        #: the server's stderr: a file, never a pipe (an undrained pipe fills and blocks the server's logging)
        self.log_path = state.parent / f"{state.name}-server-{self.port}.log"

    def start(self) -> ServerProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_API_KEY", "CORRAL_API_KEYS")}
        if self.keys:
            env["CORRAL_API_KEYS"] = ",".join(f"{t}={k}" for t, k in self.keys.items())
        args = list(self.args)
        # sandbox launchers run as unprivileged uids and must traverse every parent of the state dir
        self.state.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state.parent, 0o711)
        if self.config is not None:
            self.state.mkdir(parents=True, exist_ok=True)
            path = self.state / "server-config.json"
            path.write_text(json.dumps(self.config))
            args += ["--config", str(path)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([CORRAL, "--state-dir", str(self.state), "serve", "--port", str(self.port),
                                          *args], env=env, stderr=log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("server did not become healthy in 30 s")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def headers(self, tenant: str | None = None) -> dict[str, str]:
        if tenant is None or not self.keys:
            return {}
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def client(self, tenant: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(tenant), timeout=60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def as_user(uid: int, act: Callable[[], bytes]) -> bytes:
    """What ``act()`` returns when run by another user of the host: a forked child that drops to
    ``uid`` (b"" if it raised)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, only os._exit
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.write(write_end, act())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        said = answer.read()
    os.waitpid(pid, 0)
    return said


def reply_as_user(uid: int, port: int, request: bytes, whole: bool = False) -> bytes:
    """What a raw ``request`` to 127.0.0.1:``port`` gets back (its first line, or ``whole``: all
    until the server closes, at most 64 KiB) from a client running as ``uid``."""

    def ask() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request)
            head = b""
            while whole or b"\r\n" not in head:
                chunk = sock.recv(4096)
                if not chunk or len(head) > 65536:
                    break
                head += chunk
        return head[:65536] if whole else head[:200]

    return as_user(uid, ask)


def status_as_user(uid: int, port: int, request: bytes) -> int:
    """The HTTP status a raw ``request`` to 127.0.0.1:``port`` gets from a client running as ``uid``."""
    head = reply_as_user(uid, port, request)
    assert head.startswith(b"HTTP/1.1 "), head
    return int(head.split()[1])
