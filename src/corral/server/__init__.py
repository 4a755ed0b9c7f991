"""``corral serve``: the sandbox API over HTTP (see :mod:`corral.server.app`)."""

from __future__ import annotations

from .config import ServerConfig


def serve(config: ServerConfig, log_level: str = "warning") -> None:
    """Run the server in the foreground until SIGINT/SIGTERM; every sandbox is destroyed on the way out."""
    import uvicorn

    from .app import create_app

    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level, ws="websockets-sansio",
                timeout_graceful_shutdown=10, limit_concurrency=1000)


__all__ = ["ServerConfig", "serve"]
