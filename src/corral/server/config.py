"""Server configuration: bind address, API keys, quotas, lifetimes, pools.

API keys are kept only as SHA-256 digests (in memory and in any file Corral
writes); a key file may hold either ``tenant=KEY`` or ``tenant=sha256:HEX``
lines, so operators can keep plaintext keys out of it too.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import math
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidSpec
from ..host.peers import local_uid
from ..netrules import AllowRule
from ..spec import MiB, SandboxSpec, parse_size

_TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")
#: the tenant every request belongs to when no keys are configured (loopback only)
ANONYMOUS_TENANT = "local"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys(text: str, where: str) -> dict[str, str]:
    """``tenant=key`` items (comma- or newline-separated) -> {sha256 digest: tenant}."""
    digests: dict[str, str] = {}
    for raw in re.split(r"[,\n]", text):
        item = raw.strip()
        if not item or item.startswith("#"):
            continue
        tenant, sep, key = item.partition("=")
        tenant, key = tenant.strip(), key.strip()
        if not sep or not _TENANT_RE.match(tenant) or not key:
            raise InvalidSpec(f"{where}: expected tenant=KEY items, got {item.split('=')[0]!r}=...")
        if key.startswith("sha256:"):
            digest = key[len("sha256:"):].lower()
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise InvalidSpec(f"{where}: tenant {tenant}: sha256: must be followed by 64 hex digits")
        else:
            if len(key) < 16:
                raise InvalidSpec(f"{where}: tenant {tenant}: keys must be at least 16 characters")
            digest = hash_key(key)
        if digests.get(digest, tenant) != tenant:
            raise InvalidSpec(f"{where}: tenants {digests[digest]} and {tenant} have the same key "
                              "(it would be one of them, and the other would not exist)")
        digests[digest] = tenant
    return digests


def merge_keys(known: dict[str, str], more: dict[str, str], where: str) -> None:
    """Add ``more`` digests to ``known``, refusing a key given to two tenants across sources."""
    for digest, tenant in more.items():
        if known.get(digest, tenant) != tenant:
            raise InvalidSpec(f"{where}: tenants {known[digest]} and {tenant} have the same key")
        known[digest] = tenant


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except OSError:
            return False


def _positive(value: Any, what: str, integer: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidSpec(f"{what}: {value!r} must be a positive number")
    if integer and value != int(value):
        raise InvalidSpec(f"{what}: {value!r} must be a whole number")
    return int(value) if integer else float(value)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 7333
    #: sha256 digest -> tenant; empty means "no auth" (refused on non-loopback binds)
    key_digests: dict[str, str] = field(default_factory=dict)
    max_sandboxes_per_tenant: int = 32
    max_memory_per_tenant: int = 16 * 1024 * MiB
    #: bytes of stored snapshots one tenant may hold (a snapshot past it is refused: 429)
    max_snapshot_bytes_per_tenant: int = 10 * 1024 * MiB
    #: snapshots (and sandboxes paused to disk) one tenant may hold, whatever their size
    max_snapshots_per_tenant: int = 64
    #: a sandbox nobody touched for this long is destroyed
    idle_timeout: float = 600.0
    #: no sandbox lives longer than this, extensions included
    max_lifetime: float = 3600.0
    max_request_bytes: int = 32 * MiB
    #: bytes of request bodies one tenant's requests may hold at once, being received or handled (429 past it)
    max_request_bytes_per_tenant: int = 256 * MiB
    max_concurrent_execs: int = 8
    #: background commands running at once per sandbox (each keeps up to max_output per stream in the server)
    max_background_commands: int = 16
    #: threads for blocking sandbox work (commands, code cells, file transfers), shared by all tenants
    blocking_threads: int = 128
    #: of those, how many one tenant's work may hold at once; the rest of its work waits its turn,
    #: so one tenant's long commands never make another tenant's calls wait
    max_threads_per_tenant: int = 32
    #: bytes of file downloads one tenant may have in flight (read, not yet sent: a client that does
    #: not read holds them); a download past it is refused (429)
    max_download_bytes_per_tenant: int = 256 * MiB
    #: output one tenant's running commands (exec, streamed exec, code cells, background) may hold in
    #: the server at once, each counted at what it may print (2 x its sandbox's max_output); past it a
    #: command waits its turn (a background start: 429); one that may print more than all of it runs alone
    max_output_bytes_per_tenant: int = 1024 * MiB
    #: output of one tenant's ended background commands the server keeps for clients that attach
    #: (what each printed and its result); past it an ended command keeps none (its result: truncated)
    max_kept_output_per_tenant: int = 256 * MiB
    #: the largest WebSocket message the port proxy takes from a sandbox (a larger one closes the
    #: connection, 1009): each message is whole in memory before it is sent on, and a sandbox's
    #: server declared one of 4 GiB and streamed it (the proxy grew to 7.5 GB in 15 s)
    max_proxied_message_bytes: int = 64 * MiB
    #: WebSockets one tenant may have open through the port proxy at once (past it closed with
    #: 1013 as soon as it is accepted): each may hold two of the sandbox's messages the proxy has not
    #: taken yet (one being received, one queued); those it has taken count with the tenant's
    #: WebSocket messages (max_request_bytes_per_tenant)
    max_proxied_websockets_per_tenant: int = 8
    #: HTTP requests one tenant may have under way through the port proxy at once (past it 429):
    #: each holds a connection into the sandbox, two relay threads of its forward (host/portfwd.py)
    #: and its answer's stream until the caller has it all; 1,000 slow ones held 2,039 threads
    max_proxied_requests_per_tenant: int = 64
    #: seconds a request's line and headers may take to arrive (from the connection, or the request's
    #: first byte); past it 408 and the connection is closed, so idle connections cannot hold max_connections
    request_head_timeout: float = 30.0
    #: seconds a WebSocket's writes may make no progress (a client that stopped reading) before the
    #: connection is aborted: its handler, stuck in its send, held what it was sending for ever
    ws_send_timeout: float = 30.0
    #: connections from one address (an IPv6 one's /64) that have sent part of a request's line and
    #: headers and not all of it; the one past it is answered 429 and closed at once (one address's
    #: connections dribbling heads held max_connections until the head timeout: 503 for everyone)
    max_partial_heads_per_peer: int = 8
    #: requests and WebSockets one tenant may have under way at once (with API keys); past it 429, or
    #: a WebSocket closed before it is accepted, so one tenant cannot hold every connection
    max_requests_per_tenant: int = 1024
    #: open client connections; past it uvicorn answers 503 (each costs a descriptor, not a thread)
    max_connections: int = 16384
    pools: list[dict[str, Any]] = field(default_factory=list)
    #: where tenants' sandboxes may connect (``corral serve --allow``, ``--no-network``): a tenant's
    #: ``allow`` must name only destinations these cover, and ``network="open"`` is refused; None:
    #: any public destination a tenant names (private and local ranges are never theirs to open)
    allow: list[str] | None = None
    _allow_rules: list[AllowRule] = field(default_factory=list, init=False, repr=False)
    state_dir: str | None = None
    #: a Ray cluster whose nodes hold the sandboxes (``corral serve --cluster ADDRESS``); None: this host
    cluster: str | None = None
    #: tenants whose key may read /metrics: its numbers are the whole server's (every tenant's
    #: sandboxes, commands, OOM kills, egress refusals), not one tenant's.  With API keys and none
    #: listed, /metrics answers every tenant 403; without keys (loopback) anyone may read it
    metrics_tenants: list[str] = field(default_factory=list)
    #: users of this host (names or uids) a server without API keys answers besides its own user
    #: and root (server/host_guard.py); with keys a key is what lets a user in, and this is refused
    local_users: list[int | str] = field(default_factory=list)
    #: create, exec, destroy and /healthz served by lean handlers (.fast_routes); False sends them
    #: through FastAPI's routing like every other request (the same answers, slower)
    fast_routes: bool = True

    def validate(self) -> ServerConfig:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidSpec(f"port: {self.port!r} must be a whole number from 0 (a free one) to 65535")
        self.max_sandboxes_per_tenant = _positive(self.max_sandboxes_per_tenant, "max_sandboxes", integer=True)
        self.max_memory_per_tenant = parse_size(self.max_memory_per_tenant, "max_memory")
        self.max_snapshot_bytes_per_tenant = parse_size(self.max_snapshot_bytes_per_tenant, "max_snapshot_bytes")
        self.max_snapshots_per_tenant = _positive(self.max_snapshots_per_tenant, "max_snapshots_per_tenant",
                                                  integer=True)
        self.idle_timeout = _positive(self.idle_timeout, "idle_timeout")
        self.max_lifetime = _positive(self.max_lifetime, "max_lifetime")
        self.max_request_bytes = parse_size(self.max_request_bytes, "max_request")
        self.max_request_bytes_per_tenant = parse_size(self.max_request_bytes_per_tenant, "max_request_bytes_per_tenant")
        if self.max_request_bytes_per_tenant < self.max_request_bytes:
            raise InvalidSpec(f"max_request_bytes_per_tenant: {self.max_request_bytes_per_tenant} is below "
                              f"max_request_bytes ({self.max_request_bytes}): no request that large could be received")
        if not isinstance(self.metrics_tenants, list) or not all(
                isinstance(t, str) and _TENANT_RE.match(t) for t in self.metrics_tenants):
            raise InvalidSpec("metrics_tenants: a list of tenant names (letters, digits, '_', '.', '-')")
        self.max_concurrent_execs = _positive(self.max_concurrent_execs, "max_concurrent_execs", integer=True)
        self.max_background_commands = _positive(self.max_background_commands, "max_background_commands",
                                                 integer=True)
        self.blocking_threads = _positive(self.blocking_threads, "blocking_threads", integer=True)
        self.max_threads_per_tenant = _positive(self.max_threads_per_tenant, "max_threads_per_tenant", integer=True)
        if self.max_threads_per_tenant >= self.blocking_threads and self.key_digests:
            raise InvalidSpec(f"max_threads_per_tenant: {self.max_threads_per_tenant} must be below blocking_threads "
                              f"({self.blocking_threads}), or one tenant could hold every thread")
        self.max_download_bytes_per_tenant = parse_size(self.max_download_bytes_per_tenant, "max_download_bytes")
        self.max_output_bytes_per_tenant = parse_size(self.max_output_bytes_per_tenant, "max_output_bytes")
        self.max_kept_output_per_tenant = parse_size(self.max_kept_output_per_tenant, "max_kept_output")
        self.max_proxied_message_bytes = parse_size(self.max_proxied_message_bytes, "max_proxied_message_bytes")
        self.max_proxied_websockets_per_tenant = _positive(self.max_proxied_websockets_per_tenant,
                                                           "max_proxied_websockets_per_tenant", integer=True)
        self.max_proxied_requests_per_tenant = _positive(self.max_proxied_requests_per_tenant,
                                                         "max_proxied_requests_per_tenant", integer=True)
        self.request_head_timeout = _positive(self.request_head_timeout, "request_head_timeout")
        self.ws_send_timeout = _positive(self.ws_send_timeout, "ws_send_timeout")
        self.max_partial_heads_per_peer = _positive(self.max_partial_heads_per_peer, "max_partial_heads_per_peer",
                                                    integer=True)
        self.max_requests_per_tenant = _positive(self.max_requests_per_tenant, "max_requests_per_tenant", integer=True)
        self.max_connections = _positive(self.max_connections, "max_connections", integer=True)
        if self.allow is not None:
            if isinstance(self.allow, str) or not isinstance(self.allow, list):
                raise InvalidSpec(f"allow: expected a list of destinations, got {self.allow!r}")
            #: parsed once, here: every create of a tenant checks its allow against them
            self._allow_rules = [AllowRule.parse(text) for text in self.allow]
        if not isinstance(self.fast_routes, bool):
            raise InvalidSpec(f"fast_routes: {self.fast_routes!r} must be true or false")
        if self.cluster is not None and self.pools:
            raise InvalidSpec("pools: with --cluster the warm pools are the nodes' own "
                              "(corral cluster up --pool MIN:MAX:SPEC), not the server's")
        self.local_users = [local_uid(user) for user in self.local_users]
        if self.local_users and self.key_digests:
            raise InvalidSpec("local_users: with API keys a key is what lets a user in; list users only without keys")
        if not self.key_digests and not is_loopback(self.host):
            raise InvalidSpec(
                f"refusing to listen on {self.host} without API keys: anyone who can reach it could run code. "
                "Set CORRAL_API_KEYS=tenant=KEY (or --api-keys-file), or bind to 127.0.0.1"
            )
        return self

    def check_reach(self, spec: SandboxSpec) -> None:
        """Refuse a tenant's sandbox that would reach past the operator's ``allow``."""
        if self.allow is None:
            return
        offered = ", ".join(self.allow) or "none"
        if spec.network == "open":
            raise InvalidSpec(f"network 'open': this server's sandboxes may reach only what its operator listed "
                              f"(corral serve --allow: {offered}); use network='allow' with destinations within it")
        for text in spec.allow:
            asked = AllowRule.parse(text)
            if not any(rule.covers(asked) for rule in self._allow_rules):
                raise InvalidSpec(f"allow {text!r}: this server's sandboxes may reach only what its operator listed "
                                  f"(corral serve --allow: {offered})")

    def tenant_for(self, key: str) -> str | None:
        digest = hash_key(key)
        for known, tenant in self.key_digests.items():
            if hmac.compare_digest(known, digest):
                return tenant
        return None

    @property
    def auth_required(self) -> bool:
        return bool(self.key_digests)

    @classmethod
    def load(cls, config_file: str | None = None, keys_file: str | None = None, **overrides: Any) -> ServerConfig:
        """Defaults < config file (JSON) < environment (CORRAL_API_KEYS) < explicit overrides."""
        config = cls()
        if config_file:
            try:
                data = json.loads(Path(config_file).read_text())
            except (OSError, ValueError) as exc:
                raise InvalidSpec(f"config file {config_file}: {exc}") from None
            if not isinstance(data, dict):
                raise InvalidSpec(f"config file {config_file}: expected a JSON object")
            known = {f for f in cls.__dataclass_fields__ if f != "key_digests" and not f.startswith("_")} | {"api_keys_file"}
            unknown = sorted(set(data) - known)
            if unknown:
                raise InvalidSpec(f"config file: unknown field(s) {', '.join(unknown)}; "
                                  f"known: {', '.join(sorted(known))}")
            keys_file = keys_file or data.pop("api_keys_file", None)
            for name, value in data.items():
                setattr(config, name, value)
        if keys_file:
            try:
                text = Path(keys_file).read_text()
            except OSError as exc:
                raise InvalidSpec(f"API key file {keys_file}: {exc}") from None
            merge_keys(config.key_digests, parse_keys(text, f"API key file {keys_file}"), f"API key file {keys_file}")
        if os.environ.get("CORRAL_API_KEYS"):
            merge_keys(config.key_digests, parse_keys(os.environ["CORRAL_API_KEYS"], "CORRAL_API_KEYS"), "CORRAL_API_KEYS")
        for name, value in overrides.items():
            if value is not None:
                setattr(config, name, value)
        return config.validate()
