"""``corral serve``: the sandbox API over HTTP (see :mod:`corral.server.app`)."""

from __future__ import annotations

from .config import ServerConfig


def serve(config: ServerConfig, log_level: str = "warning") -> None:
    """Run the server in the foreground until SIGINT/SIGTERM; every sandbox is destroyed on the way out."""
    import uvicorn

    from .app import create_app

    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level, ws="websockets-sansio",
                timeout_graceful_shutdown=10, limit_concurrency=1000,
                # longer than clients keep idle connections (httpx: 5 s), so a reused connection is
                # never closed by the server just as a request goes out on it
                timeout_keep_alive=65)


__all__ = ["ServerConfig", "serve"]
