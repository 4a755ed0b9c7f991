"""Waiting in tests: for a condition, and for what a background process in a sandbox writes to a
file there."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from corral import Sandbox
from corral.errors import FileError

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float = 10.0, every: float = 0.05) -> T:
    """``check()`` every ``every`` seconds until it is true or ``timeout`` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def lines_written(sb: Sandbox, path: str, lines: int, seconds: float) -> str:
    """The file ``path`` in ``sb`` once it holds ``lines`` lines; AssertionError after ``seconds``.

    Read by the sandbox's agent, not by a command: a sandbox whose processes hold every task
    its uid may have cannot start one."""
    deadline = time.monotonic() + seconds
    text = ""
    while time.monotonic() < deadline:
        try:
            text = sb.files.read(path)
        except FileError:  # not there yet
            text = ""
        if text.count("\n") >= lines:
            return text
        time.sleep(0.2)
    raise AssertionError(f"{path} in the sandbox: {text!r} after {seconds} s")
