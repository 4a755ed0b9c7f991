"""The Ray side shared by the SDK and the node hosts: joining a cluster, naming host actors,
listing the nodes that offer ``corral_slots``, and turning Ray's errors into Corral's.

Ray is imported only here and in :mod:`corral.cluster.node.actor`, and only when a cluster is
used (``pip install 'corral[cluster]'``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
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
        address = local_cluster_address()
    if not isinstance(address, str) or not address:
        raise InvalidSpec(f"cluster: {address!r} must be a Ray address or True")
    try:
        ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING", configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConnectionLost(f"cannot join the Ray cluster at {address}: {exc}") from exc
    try:
        require_token_auth(f"the Ray cluster at {address}")
    except SandboxError:  # refused, or it could not be asked
        ray.shutdown()  # joined here, for nothing: leave no connection behind
        raise
    return ray


def local_cluster_address(proc: Path = Path("/proc")) -> str:
    """The cluster ``True``/"auto" means: ``RAY_ADDRESS`` if the operator set it, else the one
    cluster whose raylet root runs on this machine.  Not Ray's own "auto": it takes an address
    from any process's command line and from its temporary directory (mode 0777), so a local user
    whose fake ``raylet`` named a relay of the real GCS was joined through it, and read the
    cluster's token from the driver's first call (then ran code as root on the node)."""
    named = os.environ.get("RAY_ADDRESS", "").strip()
    if named and named != "auto":
        return named
    found = sorted(root_raylets_gcs(proc))
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConnectionLost("cluster: no Ray cluster of root's runs on this machine (no raylet of root's); "
                             "start one (`ray start`, `corral cluster up`) or name it (RAY_ADDRESS)")
    raise InvalidSpec(f"cluster: root's raylets here name several clusters ({', '.join(found)}): name one "
                      "(RAY_ADDRESS or the address itself)")


def root_raylets_gcs(proc: Path = Path("/proc")) -> set[str]:
    """The GCS addresses the raylets that root runs here were started with (``--gcs-address``):
    only root makes a process of root's, whatever its name or arguments."""
    found: set[str] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != 0:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile
        if not argv or os.path.basename(argv[0]) != b"raylet":
            continue
        pieces = [piece for arg in argv for piece in arg.split(b" ")]  # (a title set as one string)
        found.update(piece.partition(b"=")[2].decode(errors="replace") for piece in pieces
                     if piece.startswith(b"--gcs-address=") and len(piece) > len(b"--gcs-address="))
    return found


def require_token_auth(which: str) -> None:
    """Refuse a cluster that lets drivers in without a token (unless ``CORRAL_RAY_UNAUTHENTICATED``).

    Ray runs any code its drivers send, as root on Corral's nodes, and binds its ports to every
    interface (the loopback alone in its one-machine mode, which every local user reaches): such a
    cluster is root on its nodes for anyone who reaches it.  A driver that speaks without a token
    joined a cluster that asks nobody.  One that speaks with a token may have joined a cluster that
    asks nobody too (Ray's token mode is the driver's choice: any token is let into such a cluster),
    so the cluster itself is asked, by a process that has no token (:func:`_lets_anyone_in`)."""
    if os.environ.get(UNAUTHENTICATED_ENV, "").strip().lower() in ("1", "true", "yes"):
        return
    if _token_mode() and not _lets_anyone_in(ray_module().get_runtime_context().gcs_address):
        return
    raise ClusterUnauthenticated(
        f"{which} lets drivers in without a token: whoever reaches its ports runs code as root on its "
        "nodes. Enable Ray's token authentication on every node and driver (RAY_AUTH_MODE=token, the "
        "token from `ray get-auth-token --generate` in ~/.ray/auth_token or RAY_AUTH_TOKEN; see "
        f"docs/cluster.md), or set {UNAUTHENTICATED_ENV}=1 if nobody else can reach the cluster")


#: a process with no token asks the cluster at argv[1] for its nodes: "answered" or "refused"
_ASK_WITHOUT_A_TOKEN = """
import sys
from ray._raylet import GcsClient
from ray.exceptions import AuthenticationError
try:
    GcsClient(address=sys.argv[1]).get_all_node_info(timeout=float(sys.argv[2]))
except AuthenticationError:
    print("refused")
else:
    print("answered")
"""
#: seconds the question may take (a Python that imports Ray: ~0.7 s here)
ASK_TIMEOUT = 30.0
#: each cluster's answer, by its GCS address: asked once a process
_let_anyone_in: dict[str, bool] = {}


def _lets_anyone_in(gcs_address: str) -> bool:
    """Whether the cluster answers a process that speaks to it without a token.  Ray's token mode
    is a whole process's (read from RAY_AUTH_MODE at its start), hence a process of its own."""
    if gcs_address not in _let_anyone_in:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
        env["RAY_AUTH_MODE"] = "disabled"
        try:
            done = subprocess.run([sys.executable, "-P", "-c", _ASK_WITHOUT_A_TOKEN, gcs_address, str(ASK_TIMEOUT / 3)],
                                  env=env, cwd="/", capture_output=True, text=True, timeout=ASK_TIMEOUT)
        except subprocess.TimeoutExpired:
            done = None
        answer = done.stdout.strip() if done is not None else ""
        if answer not in ("answered", "refused"):
            why = "no answer in time" if done is None else (done.stderr.strip().splitlines() or ["nothing said"])[-1]
            raise ConnectionLost(f"cannot tell whether the Ray cluster at {gcs_address} asks for a token: {why}")
        _let_anyone_in[gcs_address] = answer == "answered"
    return _let_anyone_in[gcs_address]


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
