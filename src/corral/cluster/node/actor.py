"""The host actors: one :class:`~corral.cluster.node.host.NodeHost` per node offering
``corral_slots``, as a named, detached Ray actor pinned to its node.

``start_hosts()`` (what ``corral cluster up`` runs) starts the missing ones and returns them; it
is idempotent (``get_if_exists``).  Each host then looks after its siblings: every few seconds
it starts a host on any node that joined since, so a node added to the cluster gets its host
without another ``up``.  A host is pinned with ``NodeAffinitySchedulingStrategy(soft=False)``:
it never runs anywhere but on its node, and dies with it (``max_restarts=0``: a new one on a
node that came back starts empty and reaps what the old one left).
"""

from __future__ import annotations

import threading
from typing import Any

from ..nodes import NAMESPACE, host_name, join, slot_nodes
from .host import NodeHost

#: concurrent calls one host serves (commands waiting, polls, file calls, creates)
MAX_CONCURRENCY = 256
#: how often a host looks for nodes without one
SIBLING_INTERVAL = 5.0
#: how long ``start_hosts`` waits for the hosts to answer
START_TIMEOUT = 120.0


class HostActor(NodeHost):
    """A :class:`NodeHost` that knows it runs as a Ray actor."""

    def __init__(self, slots: int, state: str | None = None, pools: list[dict[str, Any]] | None = None,
                 janitor_interval: float = 2.0, config: dict[str, Any] | None = None) -> None:
        import ray

        super().__init__(ray.get_runtime_context().get_node_id(), slots, state, pools, janitor_interval)
        #: how to start a sibling host (the arguments this one was started with)
        self._config = {**(config or {}), "state": state, "pools": pools, "janitor_interval": janitor_interval}
        threading.Thread(target=self._siblings_loop, name="corral-node-siblings", daemon=True).start()

    def ping(self) -> tuple[str, int]:
        import os

        return self.node_id, os.getpid()

    def _siblings_loop(self) -> None:
        import ray

        while not self._closed.wait(SIBLING_INTERVAL):
            try:
                start_hosts(ray, **self._config)
            except Exception:  # the next round tries again
                pass


_actor_class: Any = None


def actor_class(ray: Any) -> Any:
    """The Ray actor class of :class:`HostActor` (made once per process: Ray exports it on first use)."""
    global _actor_class
    if _actor_class is None:
        _actor_class = ray.remote(HostActor)
    return _actor_class


def start_hosts(ray: Any, state: str | None = None, pools: list[dict[str, Any]] | None = None,
                janitor_interval: float = 2.0, wait: bool = True) -> dict[str, Any]:
    """A host actor on every live node that offers slots (started where missing): node id -> actor."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cls = actor_class(ray)
    hosts: dict[str, Any] = {}
    for node in slot_nodes(ray):
        hosts[node.node_id] = cls.options(
            name=host_name(node.node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_concurrency=MAX_CONCURRENCY, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        ).remote(node.slots, state, pools, janitor_interval)
    if wait:  # each answers once its node has started it (a node that cannot fails the call here)
        ray.get([actor.ping.remote() for actor in hosts.values()], timeout=START_TIMEOUT)
    return hosts


def up(address: str | bool = True, **kwargs: Any) -> dict[str, Any]:
    """Join the cluster at ``address`` and start the missing host actors (``corral cluster up``)."""
    return start_hosts(join(address), **kwargs)


def down(address: str | bool = True) -> int:
    """Destroy every sandbox of every host and end the hosts (``corral cluster down``); how many sandboxes."""
    ray = join(address)
    destroyed = 0
    for node in slot_nodes(ray):
        try:
            actor = ray.get_actor(host_name(node.node_id), namespace=NAMESPACE)
        except ValueError:
            continue
        destroyed += int(ray.get(actor.shutdown.remote()))
        ray.kill(actor)
    return destroyed
