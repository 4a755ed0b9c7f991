"""Isolation tiers behind one interface (:mod:`corral.tiers.base`).

One package per tier (``process``, ``gvisor``, ``microvm``, ``wasm``), each
exposing its :class:`Tier` as ``TIER`` from its ``__init__``; what the Linux
tiers share is in :mod:`corral.tiers.linux`.  The tier names are listed once,
in :data:`corral.spec.TIERS`.

Tiers are imported lazily: a host without QEMU or wasmtime must still run
the process tier, and ``corral run`` must not pay for modules it does not use.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import HostNotSupported, InvalidSpec
from ..spec import TIERS
from .base import Availability, Tier

_instances: dict[tuple[str, Path], Tier] = {}


def tier_class(name: str) -> type[Tier]:
    if name not in TIERS:
        raise InvalidSpec(f"tier {name!r}: use one of {', '.join(TIERS)}")
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        raise HostNotSupported(f"tier {name!r} is not available in this build ({exc})") from exc
    cls: type[Tier] = module.TIER
    return cls


def get_tier(name: str, state_dir: Path) -> Tier:
    """The (cached) tier instance for a state directory."""
    key = (name, state_dir)
    tier = _instances.get(key)
    if tier is None:
        tier = tier_class(name)(state_dir)  # type: ignore[call-arg]
        _instances[key] = tier
    return tier


def probe_all(state_dir: Path) -> list[Availability]:
    results = []
    for name in TIERS:
        try:
            results.append(tier_class(name).probe(state_dir))
        except HostNotSupported as exc:
            results.append(Availability(name, False, str(exc), "install the tier's dependencies"))
    return results
