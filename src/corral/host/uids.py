"""Host uids for sandboxes: one unprivileged uid per sandbox (and per image build).

A uid is reserved by creating ``state_dir/uids/<uid>`` (``O_EXCL``), holding
its owner's name, and released by removing the file; the janitor releases the
uids a dead owner's reap record names.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from ..errors import ResourceLimit

#: host uids handed to sandboxes: far above any real or subordinate range
UID_BASE = 2_100_000_000
UID_RANGE = 1_000_000


def allocate_uid(state_dir: Path, owner: str) -> int:
    """Reserve a host uid no other live sandbox uses (a file per uid, O_EXCL)."""
    uid_dir = state_dir / "uids"
    uid_dir.mkdir(mode=0o700, exist_ok=True)
    rng = random.SystemRandom()
    for _ in range(100):
        uid = UID_BASE + rng.randrange(UID_RANGE)
        try:
            fd = os.open(uid_dir / str(uid), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            continue
        try:
            os.write(fd, owner.encode())
        finally:
            os.close(fd)
        return uid
    raise ResourceLimit("could not reserve a free host uid for the sandbox")


def release_uid(state_dir: Path, uid: int) -> None:
    try:
        (state_dir / "uids" / str(uid)).unlink()
    except FileNotFoundError:
        pass
