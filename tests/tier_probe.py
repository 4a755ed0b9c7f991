"""Skipping a tier's tests on a machine where the tier cannot run, with the tier's own reason."""

from __future__ import annotations

from pathlib import Path

import pytest


def skip_unless_tier(name: str, state_dir: Path) -> None:
    """Skip the calling test (or module, from an autouse fixture) with the tier's own reason."""
    from corral.tiers import tier_class

    availability = tier_class(name).probe(state_dir)
    if not availability.available:
        pytest.skip(f"tier {name} unavailable: {availability.reason}")
