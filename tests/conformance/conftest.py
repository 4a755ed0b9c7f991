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
