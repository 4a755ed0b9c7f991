"""The host's end of an agent-relayed port forward (``tiers/linux/ports.py``) against a sandbox
that does not stop sending: a microVM guest's root can stop its agent and forge the forward's
output frames, and the kill the host asks for is the guest's to carry out.  What such a guest
makes the owner hold must stay bounded by ``MAX_QUEUED``, whatever it sends.

The sandbox side is a stand-in here (a process whose kill does nothing, as a hijacked guest's),
because the property is the host's queue, not an isolation wall; the forward itself is tested
against real sandboxes in ``test_sdk_parity.py``, ``test_browser.py`` and the gVisor tests."""

from __future__ import annotations

import threading
import time

from corral.tiers.base import ExecRequest, ExecResult, OutputCallback, Process
from corral.tiers.linux import ports


class _DeafProcess(Process):
    """A forward's command whose sandbox ignores kills and sends on."""

    pid = 7

    def __init__(self) -> None:
        self.killed = 0
        self.ended = threading.Event()

    @property
    def done(self) -> bool:
        return self.ended.is_set()

    def write_stdin(self, data: bytes) -> None:
        pass

    def close_stdin(self) -> None:
        pass

    def send_signal(self, signum: int) -> None:
        pass

    def kill(self) -> None:
        self.killed += 1  # asked, not done: the guest decides

    def wait(self) -> ExecResult:
        self.ended.wait(30)
        return ExecResult(exit_code=0, stdout="", stderr="", duration_ms=0.0)


def test_a_sandbox_that_sends_past_the_bound_after_its_kill_costs_the_owner_at_most_the_bound() -> None:
    """Before: past MAX_QUEUED the host asked for a kill and queued on: 24 x 64 MiB forged by a
    guest grew the owner by 1.5 GiB.  Now the connection is cut on the host's side and the rest
    is dropped."""
    process = _DeafProcess()
    emit: list[OutputCallback] = []

    def start(request: ExecRequest, on_output: OutputCallback | None) -> Process:
        assert on_output is not None
        emit.append(on_output)
        return process

    client = ports.agent_connect(start, "/.corral/agent", 8000)  # a client that never reads
    try:
        chunk = b"x" * (4 << 20)
        sends = 4 * ports.MAX_QUEUED // len(chunk)  # four times the bound
        for _ in range(sends):
            emit[0]("stdout", chunk)
        assert process.killed >= 1
        # what is still queued is what the bound allows (the first chunks, until the socket filled)
        held = _queued_bytes(emit[0])
        assert held <= ports.MAX_QUEUED, held
        # and the client sees its connection end (reset or end of stream) once it reads
        client.settimeout(10)
        deadline = time.monotonic() + 10
        got = 0
        while time.monotonic() < deadline:
            try:
                data = client.recv(1 << 20)
            except ConnectionResetError:
                break
            if not data:
                break
            got += len(data)
        assert got <= ports.MAX_QUEUED + len(chunk), got
    finally:
        process.ended.set()
        client.close()


def _queued_bytes(on_output: OutputCallback) -> int:
    """The bytes the forward's queue holds (read from the closure: the queue is its own)."""
    cells = {name: cell.cell_contents for name, cell in
             zip(on_output.__code__.co_freevars, on_output.__closure__ or (), strict=True)}
    return sum(len(c) for c in list(cells["chunks"].queue) if c is not None)
