"""The order in which ``dpkg`` installs a derived image's apt packages.

The ``apt download`` step fetches every missing package on the host; the
``apt install`` step runs ``dpkg`` inside the build sandbox, where there is no
apt.  A single ``dpkg -i`` of every file unpacks them in file-name order, which
breaks ``Pre-Depends``: ``systemd-sysv`` (which ``chromium`` pulls in through
``libpam-systemd``) pre-depends on ``systemd``, which must be *configured*
before ``systemd-sysv`` is even unpacked, and ``systemd-sysv_…deb`` sorts
before ``systemd_…deb``.  apt solves this for every install it makes; here apt
runs on the host once more in simulation (``apt-get -s install``, against the
same parent database and lists, running nothing), and its ``Inst``/``Conf``/
``Remv`` lines, in order, become the sandbox's ``dpkg --unpack``/
``--configure``/``--remove`` calls.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from ..errors import ImageBuildFailed

_VERBS = {"Inst": "unpack", "Conf": "configure", "Remv": "remove"}


@dataclass(frozen=True)
class Action:
    """One dpkg action: ``unpack`` a file (name relative to the download directory),
    ``configure`` or ``remove`` a package."""

    verb: str
    target: str


def plan(simulation: str, archives: Path) -> list[Action]:
    """Actions from ``apt-get -s install`` output, with each ``Inst`` mapped to its downloaded file.

    Every downloaded file must be installed, and every package apt installs must have been downloaded.
    """
    files: dict[str, str] = {}
    for deb in archives.glob("*.deb"):
        files.setdefault(deb.name.split("_", 1)[0], deb.name)  # name_version_arch.deb; names have no "_"
    actions: list[Action] = []
    used: set[str] = set()
    for line in simulation.splitlines():
        word, _, rest = line.partition(" ")
        verb = _VERBS.get(word)
        if verb is None or not rest:
            continue
        package = rest.split()[0].split(":", 1)[0]
        if verb == "unpack":
            name = files.get(package)
            if name is None:
                raise ImageBuildFailed(f"apt plans to install {package}, which was not downloaded", "apt download")
            used.add(name)
            actions.append(Action(verb, name))
        else:
            actions.append(Action(verb, package))
    unplanned = sorted(set(files.values()) - used)
    if unplanned:
        raise ImageBuildFailed(f"downloaded but not in apt's plan: {', '.join(unplanned)}", "apt download")
    return actions


def dpkg_script(actions: list[Action], debs_dir: str) -> str:
    """A shell script running ``actions`` in order, consecutive ones of a kind in one dpkg call."""
    options = "--force-unsafe-io --force-confdef --force-confold"
    lines = ["set -e"]
    batch: list[Action] = []

    def flush() -> None:
        if not batch:
            return
        verb = batch[0].verb
        targets = [f"{debs_dir}/{a.target}" if verb == "unpack" else a.target for a in batch]
        lines.append(f"dpkg {options} --{verb} " + " ".join(shlex.quote(t) for t in targets))
        batch.clear()

    for action in actions:
        if batch and batch[0].verb != action.verb:
            flush()
        batch.append(action)
    flush()
    lines.append(f"dpkg {options} --configure --pending")  # anything apt left to its final pass
    lines.append("dpkg --audit")
    return "\n".join(lines) + "\n"
