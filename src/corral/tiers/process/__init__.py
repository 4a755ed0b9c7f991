"""The process tier: Linux namespaces + cgroups + seccomp, launched by bubblewrap.

``tier`` (tier and sandbox) → ``launcher`` (the thread that forks bwrap), ``spares`` (placing
the agent's spare ahead of time);
the root and the agent channel come from :mod:`corral.tiers.linux`.
"""

from .tier import ProcessSandbox, ProcessTier

TIER = ProcessTier

__all__ = ["TIER", "ProcessSandbox", "ProcessTier"]
