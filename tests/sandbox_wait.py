"""Waiting for what a background process in a sandbox writes to a file there."""

from __future__ import annotations

import time

from corral import Sandbox


def lines_written(sb: Sandbox, path: str, lines: int, seconds: float) -> str:
    """The file ``path`` in ``sb`` once it holds ``lines`` lines; AssertionError after ``seconds``."""
    deadline = time.monotonic() + seconds
    text = ""
    while time.monotonic() < deadline:
        text = sb.commands.run(f"cat {path} 2>/dev/null || true").stdout
        if text.count("\n") >= lines:
            return text
        time.sleep(0.2)
    raise AssertionError(f"{path} in the sandbox: {text!r} after {seconds} s")
