"""Handing freed heap memory back to the host."""

from __future__ import annotations

import ctypes
from typing import Any

_malloc_trim: Any = None


def return_free_memory() -> None:
    """glibc keeps freed memory of its heap for reuse (a 15 MiB buffer freed below another
    allocation, or once its mmap threshold has grown, stays resident): megabytes a connection or
    a command held are handed back to the host (``malloc_trim``; a no-op where there is no glibc)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)
