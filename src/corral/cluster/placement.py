"""Where a new sandbox goes: the best of K nodes, by warm-pool hit, free slots, then memory.

Asking every node before every create costs a round trip per node; asking K at random (the
"power of K choices") costs K, done at once, and keeps the load as even as asking all.  Only
when none of the K has a free slot are the others asked, so a free slot anywhere is found
before the create waits.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

#: nodes asked for their load before each create
DEFAULT_K = 2


def rank(loads: Sequence[dict[str, Any]], memory: int) -> list[dict[str, Any]]:
    """Nodes with a free slot, best first: a warm-pool hit first, then the most free slots, then
    the most memory not yet promised to sandboxes (a node where ``memory`` does not fit comes last)."""
    free = [load for load in loads if load["free"] > 0]
    return sorted(free, key=lambda load: (load["warm"] > 0, load["free_memory"] >= memory, load["free"],
                                          load["free_memory"]), reverse=True)


def sample(nodes: Sequence[str], k: int, rng: random.Random | None = None) -> tuple[list[str], list[str]]:
    """K nodes at random, and the rest (asked only if none of the K has room)."""
    order = list(nodes)
    (rng or random).shuffle(order)
    return order[:k], order[k:]
