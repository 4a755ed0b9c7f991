"""``corral serve``: the sandbox API over HTTP (see :mod:`corral.server.app`)."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import InvalidSpec
from .config import ServerConfig


def serve(config: ServerConfig, log_level: str = "warning",
          announce: Callable[[int], None] | None = None) -> None:
    """Run the server in the foreground until SIGINT/SIGTERM; every sandbox is destroyed on the way out.

    The listening socket is bound first and ``announce`` is told its port (``port=0`` picks a free
    one), before the app is built: a port in use fails at once, nothing made."""
    import socket

    import uvicorn

    from ..host.procs import raise_open_files_limit
    from .app import create_app

    # every connection and every sandbox costs descriptors: a soft limit of 1024 would make
    # accept() fail long before max_connections, and one tenant's sandboxes must not take them all
    raise_open_files_limit(to_kernel_bound=True)
    from .ws_protocol import bounded_ws_protocol

    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    try:
        listener = socket.create_server((config.host, config.port), family=family, backlog=2048)
    except OSError as exc:
        raise InvalidSpec(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    if announce is not None:
        announce(listener.getsockname()[1])
    app = create_app(config)
    # a WebSocket message being received counts like a request body (max_request_bytes_per_tenant)
    ws_protocol = bounded_ws_protocol(app.state.context.tenant_of, app.state.context.ws_messages,
                                      config.ws_send_timeout)
    settle_garbage_collector()
    settings = uvicorn.Config(app, log_level=log_level, ws=ws_protocol,
                              http=http_protocol(config.request_head_timeout, config.max_partial_heads_per_peer),
                              timeout_graceful_shutdown=10, limit_concurrency=config.max_connections,
                              # the client address is the connection's: it says whose socket it is (host_guard),
                              # and X-Forwarded-For from any local user would otherwise replace it
                              proxy_headers=False,
                              # longer than clients keep idle connections (httpx: 5 s), so a reused connection is
                              # never closed by the server just as a request goes out on it
                              timeout_keep_alive=65)
    uvicorn.Server(settings).run(sockets=[listener])


#: allocations between two young-generation collections (CPython's default: 700)
GC_YOUNG_THRESHOLD = 20_000


def settle_garbage_collector() -> None:
    """Keep the cyclic garbage collector off the request path of a long-running server.

    Everything imported and built before serving (FastAPI, pydantic, the routes: ~68,000
    objects) is moved out of the collector's sight (``gc.freeze``), and young
    collections run every 20,000 allocations instead of 700.  Under a burst of 1,000 lifecycles
    (``bench/server.py``, a busy host) the defaults made ~350 collections, 0.7 s in all, the longest
    pausing every request for 40 ms (an older generation) and 170 ms (a full one); with this, 11
    young ones, 61 ms in all.  Cyclic garbage is still collected, only in larger batches."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)


def http_protocol(head_timeout: float, max_partial_heads_per_peer: int) -> type | str:
    """httptools with bounds on request heads (.heads), or uvicorn's h11, which bounds their size
    (it times none: without httptools, ``request_head_timeout`` and ``max_partial_heads_per_peer``
    do not apply)."""
    try:
        from .heads import bounded_head_protocol
    except ImportError:  # no httptools
        return "h11"
    return bounded_head_protocol(head_timeout, max_partial_heads_per_peer)

__all__ = ["GC_YOUNG_THRESHOLD", "ServerConfig", "serve", "settle_garbage_collector"]

