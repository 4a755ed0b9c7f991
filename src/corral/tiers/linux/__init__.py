"""What the tiers that run Linux userland (process, gVisor, microVM) share.

``sandbox``: the base of their sandboxes, owning uid, cgroup, run directory, network and
the idempotent close (each tier writes only its launch);
``agent``: the host side of the in-sandbox agent's protocol (the agent channel);
``agent_build``: the agent's static binary, built and installed for launchers;
``rootfs``: the overlay root on a size-limited tmpfs (process and gVisor), and the
janitor's teardown of a sandbox whose processes all live in its host cgroup.
"""
