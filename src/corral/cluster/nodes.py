"""The Ray side shared by the SDK and the node hosts: joining a cluster, naming host actors,
listing the nodes that offer ``corral_slots``, and turning Ray's errors into Corral's.

Ray is imported only here and in :mod:`corral.cluster.node.actor`, and only when a cluster is
used (``pip install 'corral[cluster]'``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import ClusterUnauthenticated, ConnectionLost, HostNotSupported, InvalidSpec, SandboxError, SandboxLost

#: the Ray namespace of Corral's named actors
NAMESPACE = "corral"
#: the custom resource a node advertises to host sandboxes: ``ray start --resources '{"corral_slots": 8}'``
RESOURCE = "corral_slots"
#: ``CORRAL_RAY_UNAUTHENTICATED=1``: join a cluster that lets drivers in without a token
UNAUTHENTICATED_ENV = "CORRAL_RAY_UNAUTHENTICATED"


def host_name(node_id: str) -> str:
    """The name of the host actor of a node (one per node, detached)."""
    return f"corral-host-{node_id}"


def ray_module() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise HostNotSupported("a cluster needs Ray: pip install 'corral[cluster]'") from exc
    return ray


def join(address: str | bool | None) -> Any:
    """Ray, initialised: ``address`` is what ``ray.init(address=...)`` takes; True (or "auto") means
    the Ray this process already joined (else the cluster ``RAY_ADDRESS``/``ray start`` names).
    Raises :class:`ClusterUnauthenticated` for a cluster that lets drivers in without a token."""
    ray = ray_module()
    if ray.is_initialized():
        require_token_auth("the Ray this process joined")
        return ray
    if address is True or address in ("1", "true", "auto"):
        address = "auto"
    if not isinstance(address, str) or not address:
        raise InvalidSpec(f"cluster: {address!r} must be a Ray address or True")
    try:
        ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING", configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConnectionLost(f"cannot join the Ray cluster at {address}: {exc}") from exc
    try:
        require_token_auth(f"the Ray cluster at {address}")
    except ClusterUnauthenticated:
        ray.shutdown()  # joined here, for nothing: leave no connection behind
        raise
    return ray


def require_token_auth(which: str) -> None:
    """Refuse a cluster this process joined without a token (unless ``CORRAL_RAY_UNAUTHENTICATED``).

    A driver in Ray's token mode was let in with the cluster's token (a cluster that enforces it
    refuses a driver without it, or with another); a driver that is not, joined a cluster that
    asks nobody.  Ray runs any code its drivers send, as root on Corral's nodes, and binds its
    ports to every interface (the loopback alone in its one-machine mode, which every local user
    reaches): such a cluster is root on its nodes for anyone who reaches it."""
    if os.environ.get(UNAUTHENTICATED_ENV, "").strip().lower() in ("1", "true", "yes"):
        return
    if _token_mode():
        return
    raise ClusterUnauthenticated(
        f"{which} lets drivers in without a token: whoever reaches its ports runs code as root on its "
        "nodes. Enable Ray's token authentication on every node and driver (RAY_AUTH_MODE=token, the "
        "token from `ray get-auth-token --generate` in ~/.ray/auth_token or RAY_AUTH_TOKEN; see "
        f"docs/cluster.md), or set {UNAUTHENTICATED_ENV}=1 if nobody else can reach the cluster")


def _token_mode() -> bool:
    """Whether this process speaks to Ray with a token (Ray 2.52+; its mode is read from
    ``RAY_AUTH_MODE``, which ``ray.init`` also sets when it found a token file to use)."""
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode  # type: ignore[attr-defined]
    except ImportError:  # a Ray without token authentication: no cluster of it asks for one
        return False
    return bool(get_authentication_mode() == AuthenticationMode.TOKEN)


def address_from_env() -> str | bool | None:
    """``CORRAL_CLUSTER``: a Ray address, or 1/true/auto for the Ray this process joined."""
    value = os.environ.get("CORRAL_CLUSTER", "").strip()
    if not value or value.lower() in ("0", "false", "no"):
        return None
    return True if value.lower() in ("1", "true", "yes", "auto") else value


@dataclass(frozen=True)
class Node:
    """A live Ray node that offers slots."""

    node_id: str
    slots: int
    address: str


def slot_nodes(ray: Any) -> list[Node]:
    """Every live node whose resources include ``corral_slots`` (from the GCS: no dashboard needed)."""
    nodes = []
    for node in ray.nodes():
        slots = int(node.get("Resources", {}).get(RESOURCE, 0))
        if node.get("Alive") and slots > 0:
            nodes.append(Node(node["NodeID"], slots, str(node.get("NodeManagerAddress", ""))))
    return nodes


def node_alive(ray: Any, node_id: str) -> bool:
    return any(node["NodeID"] == node_id and node.get("Alive") for node in ray.nodes())


def lost(sandbox_id: str | None, node_id: str, why: str) -> SandboxLost:
    return SandboxLost(f"sandbox {sandbox_id} was lost with node {node_id[:12]}: {why}", sandbox_id=sandbox_id)


@contextmanager
def ray_errors(sandbox_id: str | None, node_id: str) -> Iterator[None]:
    """Ray's answers as Corral's: an error the host raised is re-raised as it was; a host actor that
    died (with its node) is :class:`SandboxLost`; any other Ray failure is :class:`ConnectionLost`."""
    from ray import exceptions as rx

    try:
        yield
    except rx.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, SandboxError):
            raise cause from None
        if isinstance(cause, rx.RayActorError):
            raise lost(sandbox_id, node_id, type(cause).__name__) from None
        raise SandboxError(f"node {node_id[:12]}: {cause!r}", sandbox_id=sandbox_id) from exc
    except rx.RayActorError as exc:  # ActorDiedError, ActorUnavailableError
        raise lost(sandbox_id, node_id, type(exc).__name__) from None
    except rx.RayError as exc:
        raise ConnectionLost(f"node {node_id[:12]}: {type(exc).__name__}: {exc}", sandbox_id=sandbox_id) from exc
