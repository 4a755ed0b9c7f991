"""Isolation tiers behind one interface (:mod:`corral.tiers.base`).

Tiers are imported lazily: a host without QEMU or wasmtime must still run
the process tier, and ``corral run`` must not pay for modules it does not use.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import HostNotSupported, InvalidSpec
from .base import Availability, Tier

#: tier name -> "module:Class"
TIER_CLASSES: dict[str, str] = {
    "process": "corral.tiers.process:ProcessTier",
    "gvisor": "corral.tiers.gvisor:GVisorTier",
    "microvm": "corral.tiers.microvm:MicroVMTier",
    "wasm": "corral.tiers.wasm:WasmTier",
}

_instances: dict[tuple[str, Path], Tier] = {}


def tier_class(name: str) -> type[Tier]:
    target = TIER_CLASSES.get(name)
    if target is None:
        raise InvalidSpec(f"tier {name!r}: use one of {', '.join(TIER_CLASSES)}")
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise HostNotSupported(f"tier {name!r} is not available in this build ({exc})") from exc
    cls: type[Tier] = getattr(module, cls_name)
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
    for name in TIER_CLASSES:
        try:
            results.append(tier_class(name).probe(state_dir))
        except HostNotSupported as exc:
            results.append(Availability(name, False, str(exc), "install the tier's dependencies"))
    return results
