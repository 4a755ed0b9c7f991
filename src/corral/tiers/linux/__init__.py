"""What the tiers that run Linux userland (process, gVisor, microVM) share.

``agent``: the host side of the in-sandbox agent's protocol (the agent channel);
``rootfs``: the overlay root on a size-limited tmpfs (process and gVisor), and the
janitor's teardown of a sandbox whose processes all live in its host cgroup.
"""
