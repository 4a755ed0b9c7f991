"""The end of a log, for an error message: read from its end, never whole.

A log may be as big as what a sandbox made its writer print (a guest's console, a build step's
output): read whole, a failed build step's 500 MB took the builder to 4.9 GB (helper 91)."""

from __future__ import annotations

import os
from pathlib import Path


def tail(path: Path, limit: int) -> str:
    """The last ``limit`` bytes of ``path`` as text ("" if it cannot be read)."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - limit))
            return log.read(limit).decode(errors="replace")
    except OSError:
        return ""
