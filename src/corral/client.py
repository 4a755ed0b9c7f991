"""The remote SDK's old names, kept working: a server's sandbox is a :class:`corral.Sandbox`
whose transport is :class:`corral.http_transport.HTTPTransport`.

``RemoteSandbox.create(...)``/``connect(...)`` are ``Sandbox.create/connect`` that always
mean a server (``url=``, or ``CORRAL_URL``).
"""

from __future__ import annotations

from pathlib import Path

from .http_transport import BACKOFF as BACKOFF
from .http_transport import IDEMPOTENT as IDEMPOTENT
from .http_transport import MAX_RETRY_WAIT as MAX_RETRY_WAIT
from .http_transport import REQUEST_TIMEOUT as REQUEST_TIMEOUT
from .http_transport import RETRIES as RETRIES
from .http_transport import Client as Client
from .http_transport import HTTPTransport
from .sandbox import Sandbox
from .transport import Transport


class RemoteSandbox(Sandbox):
    """A sandbox living in a Corral server: :class:`corral.Sandbox`, always over HTTP."""

    @classmethod
    def _transport_for(cls, url: str | None, api_key: str | None, state: str | Path | None,
                       transport: Transport | None) -> Transport:
        del state  # the server owns its state directory
        return transport if transport is not None else HTTPTransport(url, api_key)
