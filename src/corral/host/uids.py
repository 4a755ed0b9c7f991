"""Host uids for sandboxes: one unprivileged uid per sandbox (and per image build).

A uid is reserved twice, both with ``O_EXCL`` files holding its owner's name:

- ``state_dir/uids/<uid>``: the record the janitor reads (a dead owner's reap
  record names its uids, and ``gc`` releases them);
- ``/run/corral/uids/<uid>``: the host-wide claim.  Two Corral instances with
  different state directories (two servers, parallel test runs) would
  otherwise be able to hand the same host uid to two live sandboxes, which
  could then reach each other's files and processes as the same user.  A claim
  whose state-directory record no longer exists (its state directory was
  removed without a ``gc``) is stale and is taken over.

Both are released by removing the files.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from ..errors import ResourceLimit

#: host uids handed to sandboxes: far above any real or subordinate range
UID_BASE = 2_100_000_000
UID_RANGE = 1_000_000
#: the host-wide claims (tmpfs: claims die with the boot, as the processes using them do)
CLAIMS = Path("/run/corral/uids")


def _create(path: Path, content: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, content.encode())
    finally:
        os.close(fd)
    return True


def _claim(uid: int, record: Path) -> bool:
    """Claim ``uid`` host-wide for the record at ``record``; take over a stale claim."""
    claim = CLAIMS / str(uid)
    if _create(claim, str(record)):
        return True
    try:
        holder = Path(claim.read_text())
    except (FileNotFoundError, ValueError):
        return _create(claim, str(record))
    if holder == record or holder.exists():
        return False
    # the record behind the claim is gone (its state directory was deleted): stale
    claim.unlink(missing_ok=True)
    return _create(claim, str(record))


def allocate_uid(state_dir: Path, owner: str) -> int:
    """Reserve a host uid no other live sandbox on this host uses."""
    uid_dir = state_dir / "uids"
    uid_dir.mkdir(mode=0o700, exist_ok=True)
    CLAIMS.mkdir(mode=0o700, parents=True, exist_ok=True)
    rng = random.SystemRandom()
    for _ in range(100):
        uid = UID_BASE + rng.randrange(UID_RANGE)
        record = uid_dir / str(uid)
        if not _create(record, owner):
            continue
        if _claim(uid, record.resolve()):
            return uid
        record.unlink(missing_ok=True)  # another state directory's live sandbox holds it
    raise ResourceLimit("could not reserve a free host uid for the sandbox")


def release_uid(state_dir: Path, uid: int) -> None:
    record = state_dir / "uids" / str(uid)
    claim = CLAIMS / str(uid)
    try:
        if Path(claim.read_text()) == record.resolve():
            claim.unlink(missing_ok=True)
    except (FileNotFoundError, ValueError):
        pass
    record.unlink(missing_ok=True)
