"""The conformance suite reports what a tier lacks instead of failing on it.

A tier may leave parts of the contract out (a newcomer, see ``stub_tier.py``)
by raising ``NotImplementedError`` from them; a test that reaches one is
skipped as "tier NAME lacks Contract.method", naming the method of
:mod:`corral.tiers.base` it needs.
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest

from corral.tiers.base import Process, Tier, TierSandbox

_CONTRACT = (Tier, TierSandbox, Process)


def missing_part(exc: NotImplementedError) -> str:
    """The contract method whose implementation raised ``exc`` (innermost such frame)."""
    part = "an unnamed part of the contract"
    tb: types.TracebackType | None = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
        if owner is not None:
            owner_type = owner if isinstance(owner, type) else type(owner)
            for base in _CONTRACT:
                if issubclass(owner_type, base) and frame.f_code.co_name in vars(base):
                    part = f"{base.__name__}.{frame.f_code.co_name}"
        tb = tb.tb_next
    return part


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    except NotImplementedError as exc:
        tier = getattr(item, "callspec", None) and item.callspec.params.get("tier")
        pytest.skip(f"tier {tier} lacks {missing_part(exc)}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The microVM's items last within the conformance suite: on a fresh machine its first-use
    builds (the host image's disk, ~40 s; `make test` starts them beside lint) then overlap the
    other tiers' items instead of holding up the suite's first microVM item.  Only the order
    changes, and only among this suite's own items (the slots they hold stay theirs)."""
    slots = [i for i, item in enumerate(items) if item.nodeid.startswith("tests/conformance/")]

    def microvm(item: pytest.Item) -> bool:
        callspec = getattr(item, "callspec", None)
        return callspec is not None and callspec.params.get("tier") == "microvm"

    ordered = sorted((items[i] for i in slots), key=microvm)
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item
