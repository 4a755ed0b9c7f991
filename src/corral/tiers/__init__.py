"""Isolation tiers behind one interface (:mod:`corral.tiers.base`).

One package per built-in tier (``process``, ``gvisor``, ``microvm``, ``wasm``),
each exposing its :class:`Tier` as ``TIER`` from its ``__init__``; what the
Linux tiers share is in :mod:`corral.tiers.linux`.  The built-in tier names are
listed once, in :data:`corral.spec.TIERS`; a tier from elsewhere (a plugin, a
test's stub) joins with :func:`register_tier`, touching none of them.

Tiers are imported lazily: a host without QEMU or wasmtime must still run
the process tier, and ``corral run`` must not pay for modules it does not use.
"""

from __future__ import annotations

import importlib
import re
import threading
from pathlib import Path

from ..errors import HostNotSupported, InvalidSpec
from ..spec import TIERS, add_tier_name, tier_names
from .base import Availability, Tier

_instances: dict[tuple[str, Path], Tier] = {}
_instances_lock = threading.Lock()
_registered: dict[str, type[Tier]] = {}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}\Z")


def register_tier(name: str, tier: type[Tier]) -> None:
    """Make ``tier`` (a :class:`Tier` subclass: ``tier(state_dir)`` builds it) available as
    ``tier=name`` to specs, ``corral doctor`` and the conformance suite."""
    if not _NAME_RE.match(name):
        raise InvalidSpec(f"tier name {name!r}: 1-32 characters of a-z, 0-9, '_', '-', starting with a letter")
    if name in TIERS or _registered.get(name, tier) is not tier:
        raise InvalidSpec(f"tier {name!r} is already registered")
    if not (isinstance(tier, type) and issubclass(tier, Tier)):
        raise InvalidSpec(f"tier {name!r}: {tier!r} is not a corral.tiers.base.Tier subclass")
    _registered[name] = tier
    add_tier_name(name)


def tier_class(name: str) -> type[Tier]:
    registered = _registered.get(name)
    if registered is not None:
        return registered
    if name not in TIERS:
        raise InvalidSpec(f"tier {name!r}: use one of {', '.join(tier_names())}")
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
        cls = tier_class(name)  # the import outside the lock: it takes the import lock
        with _instances_lock:  # one instance per key: a second would hold state of its own (spares)
            tier = _instances.get(key)
            if tier is None:
                tier = _instances[key] = cls(state_dir)  # type: ignore[call-arg]
    return tier


def probe_all(state_dir: Path) -> list[Availability]:
    results = []
    for name in tier_names():
        try:
            results.append(tier_class(name).probe(state_dir))
        except HostNotSupported as exc:
            results.append(Availability(name, False, str(exc), "install the tier's dependencies"))
    return results
