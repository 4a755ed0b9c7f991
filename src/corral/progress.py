"""Progress for slow one-time work: image disks, microVM templates, guest kernels, wasm compiles.

Most creates take milliseconds, but a first use (or a rebuild after the host's
packages changed) can take a minute; silence for that long looks like a hang.
Any :func:`step` still running after :data:`REPORT_AFTER` seconds says what it
is doing and why on stderr (a live spinner when stderr is a terminal, through
rich; one plain line otherwise), and how long it took when it ends.
``CORRAL_QUIET=1`` silences it; a library user may route it with
:func:`set_reporter` (the server logs it).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: a step quicker than this says nothing
REPORT_AFTER = 1.0

Reporter = Callable[[str], None]
_reporter: Reporter | None = None


def set_reporter(reporter: Reporter | None) -> None:
    """Send progress lines to ``reporter`` instead of stderr (None: back to stderr)."""
    global _reporter
    _reporter = reporter


def _emit(line: str) -> None:
    if _reporter is not None:
        _reporter(line)
    else:
        print(line, file=sys.stderr, flush=True)


@contextmanager
def step(what: str, why: str = "") -> Iterator[None]:
    """Report ``what`` (and ``why``) if the body runs longer than :data:`REPORT_AFTER`."""
    if os.environ.get("CORRAL_QUIET"):
        yield
        return
    start = time.monotonic()
    lock = threading.Lock()
    shown: dict[str, Any] = {}
    label = f"{what} ({why})" if why else what

    def announce() -> None:
        with lock:
            if shown.get("over"):
                return
            if _reporter is None and sys.stderr.isatty():
                from rich.console import Console

                status = Console(stderr=True).status(f"corral: {label}")
                status.start()
                shown["status"] = status
            else:
                _emit(f"corral: {label} ...")
            shown["announced"] = True

    timer = threading.Timer(REPORT_AFTER, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            shown["over"] = True
            if "status" in shown:
                shown["status"].stop()
            if shown.get("announced"):
                _emit(f"corral: {what}: done in {time.monotonic() - start:.1f} s")
