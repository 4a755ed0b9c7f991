"""The agent's end of a port forward, for tiers whose loopback is not the host kernel's.

gVisor's loopback lives in its own network stack (the Sentry's), which no host
thread can enter, and ``runsc port-forward`` refuses ``--network=none``.  So
each forwarded connection runs one command in the sandbox, ``/.corral/agent
--connect PORT`` (``agent/relay.c``), which connects to the sandbox's
``127.0.0.1:PORT`` and copies its stdin and stdout to and from it; the host
end is one side of a socketpair, relayed to that command's stdin and stdout
over the agent channel.  The command is an ordinary one: in the sandbox's
limits (it counts against ``pids``), killed with the sandbox.

Flow control: the agent channel is shared by every command of the sandbox, so
the channel's reader never blocks on a slow client: what the sandbox sends is
queued for a writer thread, and a connection whose client leaves more than
:data:`MAX_QUEUED` bytes unread is cut on the host's side, and what the sandbox sends it
afterwards is dropped.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable

from ..base import ExecRequest, OutputCallback, Process

#: bytes the sandbox may send ahead of a client that does not read, per connection
MAX_QUEUED = 16 << 20
_WEEK = 7 * 86400.0

Start = Callable[[ExecRequest, OutputCallback | None], Process]


def agent_connect(start: Start, agent_path: str, port: int) -> socket.socket:
    """A socket whose peer is a fresh ``--connect PORT`` command in the sandbox (see above)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    chunks: queue.Queue[bytes | None] = queue.Queue()
    queued = [0]
    lock = threading.Lock()
    proc: list[Process] = []
    cut = threading.Event()

    def cut_off() -> None:
        """The client reads no more: end its connection here and drop what is queued.  The
        command's kill is the sandbox's to carry out (a microVM's agent), and a guest that ignored
        it had its output queued on: 1.5 GiB of the owner's memory for a 16 MiB bound."""
        cut.set()
        with contextlib.suppress(OSError):
            ours.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(queue.Empty):
            while True:
                chunks.get_nowait()
        with lock:
            queued[0] = 0
        if proc:
            proc[0].kill()
        chunks.put(None)

    def on_output(stream: str, chunk: bytes) -> None:  # on the agent channel's reader: never blocks
        if stream != "stdout" or not chunk or cut.is_set():
            return
        with lock:
            queued[0] += len(chunk)
            over = queued[0] > MAX_QUEUED
        if over:
            cut_off()
        else:
            chunks.put(chunk)

    request = ExecRequest(argv=[agent_path, "--connect", str(port)], env={}, cwd="/", timeout=_WEEK, max_output=0)
    try:
        process = start(request, on_output)
    except BaseException:
        ours.close()
        theirs.close()
        raise
    proc.append(process)

    def to_client() -> None:
        while (chunk := chunks.get()) is not None:
            with lock:
                queued[0] -= len(chunk)
            try:
                ours.sendall(chunk)
            except OSError:
                cut_off()
                break
        with contextlib.suppress(OSError):
            ours.shutdown(socket.SHUT_WR)

    def to_sandbox() -> None:
        try:
            while data := ours.recv(1 << 16):
                process.write_stdin(data)
            process.close_stdin()
        except Exception:  # the client or the sandbox went away
            process.kill()

    def waiter() -> None:
        try:
            process.wait()
        except Exception:
            pass
        chunks.put(None)  # the command's output is all there: the client gets end of stream after it
        writer.join()
        with contextlib.suppress(OSError):
            ours.shutdown(socket.SHUT_RDWR)
        reader.join()
        ours.close()

    writer = threading.Thread(target=to_client, name=f"portfwd-agent-{port}-out", daemon=True)
    reader = threading.Thread(target=to_sandbox, name=f"portfwd-agent-{port}-in", daemon=True)
    writer.start()
    reader.start()
    threading.Thread(target=waiter, name=f"portfwd-agent-{port}-wait", daemon=True).start()
    return theirs
