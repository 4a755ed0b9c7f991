"""The dpkg order of a derived image's apt packages follows apt's plan (images/aptplan.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from corral.errors import ImageBuildFailed
from corral.images.aptplan import Action, dpkg_script, plan

SIMULATION = """NOTE: This is only a simulation!
Inst libsystemd-shared (252.39-1~deb12u2 Debian:12.15/oldstable [amd64])
Inst systemd (252.39-1~deb12u2 Debian:12.15/oldstable [amd64])
Conf libsystemd-shared (252.39-1~deb12u2 Debian:12.15/oldstable [amd64])
Conf systemd (252.39-1~deb12u2 Debian:12.15/oldstable [amd64])
Inst systemd-sysv (252.39-1~deb12u2 Debian:12.15/oldstable [amd64])
Inst libgtk-3-0:amd64 (3.24.38-2~deb12u3 Debian:12.15/oldstable [amd64])
Conf systemd-sysv (252.39-1~deb12u2 Debian:12.15/oldstable [amd64])
Conf libgtk-3-0:amd64 (3.24.38-2~deb12u3 Debian:12.15/oldstable [amd64])
"""
FILES = ["libsystemd-shared_252.39-1~deb12u2_amd64.deb", "systemd_252.39-1~deb12u2_amd64.deb",
         "systemd-sysv_252.39-1~deb12u2_amd64.deb", "libgtk-3-0_3.24.38-2~deb12u3_amd64.deb"]


def archives(tmp_path: Path, names: list[str]) -> Path:
    for name in names:
        (tmp_path / name).touch()
    return tmp_path


def test_pre_dependencies_are_configured_before_their_dependents_unpack(tmp_path: Path) -> None:
    actions = plan(SIMULATION, archives(tmp_path, FILES))
    assert actions[:2] == [Action("unpack", FILES[0]), Action("unpack", FILES[1])]
    order = [(a.verb, a.target) for a in actions]
    assert order.index(("configure", "systemd")) < order.index(("unpack", FILES[2]))  # the Pre-Depends
    script = dpkg_script(actions, "/debs").splitlines()
    assert script[0] == "set -e" and script[-2:] == [
        "dpkg --force-unsafe-io --force-confdef --force-confold --configure --pending", "dpkg --audit"]
    quoted = " ".join(shlex.quote(f"/debs/{name}") for name in FILES[:2])
    assert script[1].endswith(f"--unpack {quoted}")  # consecutive ones: one call
    assert script[2].endswith("--configure libsystemd-shared systemd")


def test_a_plan_that_does_not_match_the_download_fails(tmp_path: Path) -> None:
    with pytest.raises(ImageBuildFailed, match="not downloaded"):
        plan(SIMULATION, archives(tmp_path, FILES[:3]))
    with pytest.raises(ImageBuildFailed, match="not in apt's plan"):
        plan(SIMULATION, archives(tmp_path, [*FILES, "extra_1_all.deb"]))
