"""The gVisor tier: the sandbox's userland runs on gVisor's user-space kernel (``runsc``).

``tier`` (tier, bundle, lifecycle) → ``platform`` (finding runsc, choosing the
platform), ``memory`` (the memory guard), ``net`` (runsc's side of
``network="open"``), ``seccomp`` (the policy runsc loads inside); the root and the agent
channel come from :mod:`corral.tiers.linux`.
"""

from .tier import GVisorSandbox, GVisorTier

TIER = GVisorTier

__all__ = ["TIER", "GVisorSandbox", "GVisorTier"]
