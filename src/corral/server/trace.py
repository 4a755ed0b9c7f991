"""Per-request phase timings for the fast routes, sent as a ``Server-Timing`` header.

Off unless the server runs with ``CORRAL_SERVER_TIMING=1`` (``bench/server.py --profile``
sets it): then each fast-path request records marks -- ``read`` (the body), ``auth``, ``parse``,
``to_thread`` / ``work`` / ``to_loop`` (a hop to a worker thread, the work there, the hop back),
``handler`` (the route's own code) -- and its response says how long each phase took, in ms::

    Server-Timing: read;dur=0.011, auth;dur=0.004, parse;dur=0.020, handler;dur=0.180, total;dur=0.215

A phase that repeats (a route with two hops) is summed.  Off, every call here is one
context-variable read.
"""

from __future__ import annotations

import itertools
import os
import time
from contextvars import ContextVar

ENV = "CORRAL_SERVER_TIMING"
Marks = list[tuple[str, float]]
_marks: ContextVar[Marks | None] = ContextVar("corral_server_timing", default=None)


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def begin() -> Marks:
    marks: Marks = [("start", time.perf_counter())]
    _marks.set(marks)
    return marks


def current() -> Marks | None:
    return _marks.get()


def mark(phase: str, marks: Marks | None = None) -> None:
    """The time since the previous mark was spent in ``phase`` (nothing happens when off)."""
    marks = marks if marks is not None else _marks.get()
    if marks is not None:
        marks.append((phase, time.perf_counter()))


def end() -> Marks:
    marks = _marks.get() or []
    _marks.set(None)
    return marks


def phases(marks: Marks) -> dict[str, float]:
    """Milliseconds per phase, in the order they first appear, and their ``total``."""
    spent: dict[str, float] = {}
    for (_, before), (phase, after) in itertools.pairwise(marks):
        spent[phase] = spent.get(phase, 0.0) + (after - before) * 1000
    if marks:
        spent["total"] = (marks[-1][1] - marks[0][1]) * 1000
    return spent


def header(marks: Marks) -> str:
    return ", ".join(f"{phase};dur={ms:.3f}" for phase, ms in phases(marks).items())


def parse_header(value: str) -> dict[str, float]:
    """``phase -> ms`` from a ``Server-Timing`` header (the bench's side)."""
    spent: dict[str, float] = {}
    for item in value.split(","):
        name, _, rest = item.strip().partition(";dur=")
        if name and rest:
            spent[name] = float(rest)
    return spent
