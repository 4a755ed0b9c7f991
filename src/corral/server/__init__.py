"""``corral serve``: the sandbox API over HTTP (see :mod:`corral.server.app`)."""

from __future__ import annotations

from .config import ServerConfig


def serve(config: ServerConfig, log_level: str = "warning") -> None:
    """Run the server in the foreground until SIGINT/SIGTERM; every sandbox is destroyed on the way out."""
    import uvicorn

    from ..host.procs import raise_open_files_limit
    from .app import create_app

    # every connection and every sandbox costs descriptors: a soft limit of 1024 would make
    # accept() fail long before max_connections
    raise_open_files_limit()
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level, ws="websockets-sansio",
                timeout_graceful_shutdown=10, limit_concurrency=config.max_connections,
                # longer than clients keep idle connections (httpx: 5 s), so a reused connection is
                # never closed by the server just as a request goes out on it
                timeout_keep_alive=65)


__all__ = ["ServerConfig", "serve"]
