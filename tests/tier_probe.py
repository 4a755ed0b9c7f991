"""Skipping a tier's tests on a machine where the tier cannot run, with the tier's own reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


def skip_unless_tier(name: str, state_dir: Path) -> None:
    """Skip the calling test (or module, from an autouse fixture) with the tier's own reason."""
    from corral.tiers import tier_class

    availability = tier_class(name).probe(state_dir)
    if not availability.available:
        pytest.skip(f"tier {name} unavailable: {availability.reason}")


@pytest.fixture(params=["process", "gvisor"], name="tier")
def overlay_tier(request: pytest.FixtureRequest, state_dir: Path) -> Iterator[str]:
    """``tier``: each tier whose workspace is an overlay (gVisor where this host runs it).  A test
    module takes it with ``from .tier_probe import overlay_tier``."""
    if request.param != "process":
        skip_unless_tier(request.param, state_dir)
    yield request.param
