"""Corral on a Ray cluster: sandboxes placed across the nodes that offer ``corral_slots``.

- :mod:`corral.cluster.transport`: ``Sandbox.create(cluster=ADDRESS)``'s transport, with the
  placement (:mod:`corral.cluster.placement`) and the cluster registry (sandbox id -> node);
- :mod:`corral.cluster.node`: what runs on each node, the host actor that owns its sandboxes.

See docs/cluster.md.
"""
