"""A sandbox's network side: what the tier mounts, sets and starts for the spec's network mode.

``none``: nothing (the tier's ``--unshare-net`` leaves a private loopback).
``allow``: an :class:`~.proxy.EgressProxy` on a Unix socket that the tier binds
into the sandbox, a relay on the sandbox's loopback (started by the agent), the
proxy variables every common client honours, secret placeholders, and, when
secrets are bound, a per-sandbox CA trusted inside.
``open``: a network namespace with a veth pair and NAT (:mod:`corral.host.netns`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..netrules import AllowRule, parse_range
from ..secrets import Redactor, Secret, materialize
from ..spec import SandboxSpec
from .audit import AuditEvent, AuditLog

# The proxy, the policy and the open-mode plumbing are imported when a sandbox needs them:
# every sandbox imports this module, most have network="none", and start-up time counts.
if TYPE_CHECKING:
    from .allow_net import AllowNetwork
    from .open_net import OpenNetwork
    from .policy import Resolver
    from .proxy import EgressProxy

PROXY_PORT = 3128
SOCKET_IN_SANDBOX = "/.corral/egress.sock"
CA_IN_SANDBOX = "/.corral/egress-ca.crt"
BUNDLE_IN_SANDBOX = "/etc/ssl/certs/ca-certificates.crt"
HOST_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
NODE_SHIM = Path(__file__).with_name("node-proxy.js")
NODE_SHIM_IN_SANDBOX = "/.corral/node-proxy.js"


@dataclass(frozen=True)
class EgressSettings:
    """Library-wide egress configuration (the operator's, not the sandbox's)."""

    #: how the proxy resolves names (default: the host's resolver)
    resolver: Resolver | None = None
    #: CA file the proxy trusts when it intercepts TLS to a secret-bound host (default: system trust)
    upstream_cafile: str | None = None
    #: ranges re-enabled for every sandbox, on top of each spec's own
    unsafe_allow_ranges: tuple[str, ...] = ()
    #: NAME=VALUE file secrets are read from before the caller's environment
    secrets_file: str | None = None


_settings = EgressSettings()
_secret_values: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "corral_secret_values", default=None)


def configure(**changes: object) -> EgressSettings:
    """Change library-wide egress settings; returns the previous ones (to restore them)."""
    global _settings
    previous = _settings
    for cidr in changes.get("unsafe_allow_ranges", ()) or ():  # type: ignore[attr-defined]
        parse_range(cidr)
    _settings = dataclasses.replace(_settings, **changes)  # type: ignore[arg-type]
    return previous


def settings() -> EgressSettings:
    return _settings


@contextlib.contextmanager
def secret_values(values: Mapping[str, str]) -> Iterator[None]:
    """Give secret values to sandboxes created in this block (instead of the environment)."""
    token = _secret_values.set(dict(values))
    try:
        yield
    finally:
        _secret_values.reset(token)


class SandboxNetwork:
    """Everything network-related one sandbox owns; :meth:`close` releases all of it."""

    def __init__(self, spec: SandboxSpec, sandbox_id: str, run_dir: Path, uid: int, *,
                 host_namespace: bool = True, socket_gid: int | None = None, guest_tap: bool = False) -> None:
        """``guest_tap``: for ``open``, a tap bridged to the veth for a VM (:class:`.open_net.OpenNetwork`).
        ``host_namespace=False``: for ``allow``, no host-made namespace (a tier with a network
        stack of its own, gVisor's, has nowhere to put one); direct attempts then fail inside that
        stack, unaudited.  ``uid``: the host uid owning the proxy's socket (the relay's); ``socket_gid``:
        a group that may also connect to it."""
        self.mode = spec.network
        self._host_namespace = host_namespace
        self._guest_tap = guest_tap
        self._socket_gid = socket_gid
        self.sandbox_id = sandbox_id
        self.audit_log = AuditLog()
        #: environment added to every command
        self.env: dict[str, str] = {}
        #: (host path, path inside the sandbox) to bind-mount
        self.binds: list[tuple[Path, str]] = []
        #: files to place in the sandbox's root (path inside the sandbox -> content)
        self.files: dict[str, bytes] = {}
        #: extra arguments for the agent (the relay)
        self.agent_args: list[str] = []
        self.secrets: list[Secret] = []
        self.redactor = Redactor(())
        self._proxy: EgressProxy | None = None
        self._open: OpenNetwork | None = None
        self._allow_net: AllowNetwork | None = None
        #: for ``open`` and ``allow``: the named network namespace the sandbox must be started in
        self.netns: str | None = None
        self._dir = run_dir / "egress"
        try:
            if self.mode == "allow":
                self._setup_allow(spec, uid)
            elif self.mode == "open":
                self._setup_open(spec)
        except BaseException:
            self.close()
            raise

    def _setup_open(self, spec: SandboxSpec) -> None:
        ranges = [parse_range(c) for c in (*_settings.unsafe_allow_ranges, *spec.unsafe_allow_ranges)]
        from .open_net import OpenNetwork

        self._open = OpenNetwork(self.sandbox_id, ranges, self.audit_log, guest_tap=self._guest_tap)
        self.netns = self._open.names.netns
        servers = "".join(f"nameserver {s}\n" for s in self._open.nameservers)
        self.files["/etc/resolv.conf"] = servers.encode()

    def _setup_allow(self, spec: SandboxSpec, uid: int) -> None:
        config = _settings
        self.secrets = materialize(spec.secrets, _secret_values.get(), config.secrets_file)
        self.redactor = Redactor(self.secrets)
        ranges = [parse_range(c) for c in (*config.unsafe_allow_ranges, *spec.unsafe_allow_ranges)]
        from .policy import Policy
        from .proxy import EgressProxy

        policy = Policy([AllowRule.parse(a) for a in spec.allow], ranges, config.resolver)
        self._dir.mkdir(mode=0o711)
        ca = None
        if self.secrets:
            from .tls import SandboxCA, upstream_context  # cryptography: imported only when needed

            ca = SandboxCA(self._dir / "ca", self.sandbox_id)
        socket_path = self._dir / "proxy.sock"
        self._proxy = EgressProxy(
            self.sandbox_id, socket_path, policy, self.audit_log, self.secrets, ca,
            upstream_context(config.upstream_cafile) if self.secrets else None, socket_uid=uid,
            socket_gid=self._socket_gid,
        )
        self.binds.append((socket_path, SOCKET_IN_SANDBOX))
        if self._host_namespace:
            # a namespace the host owns, where direct attempts fail at once and are audited
            from .allow_net import AllowNetwork

            self._allow_net = AllowNetwork(self.sandbox_id, self.audit_log)
            self.netns = self._allow_net.names.netns
        self.agent_args = ["--relay", str(PROXY_PORT), SOCKET_IN_SANDBOX]
        http = f"http://127.0.0.1:{PROXY_PORT}"
        socks = f"socks5h://127.0.0.1:{PROXY_PORT}"
        for name, value in (("http_proxy", http), ("https_proxy", http), ("all_proxy", socks),
                            ("no_proxy", "localhost,127.0.0.1,::1")):
            self.env[name] = self.env[name.upper()] = value
        # Node's fetch ignores the variables before 22.21/24: a preload routes it through the proxy
        self.files[NODE_SHIM_IN_SANDBOX] = NODE_SHIM.read_bytes()
        self.env["NODE_OPTIONS"] = f"--require {NODE_SHIM_IN_SANDBOX}"
        for secret in self.secrets:
            self.env[secret.name] = secret.placeholder
        if ca is not None:
            system = HOST_BUNDLE.read_bytes() if HOST_BUNDLE.is_file() else b""
            self.files[BUNDLE_IN_SANDBOX] = system.rstrip(b"\n") + b"\n" + ca.cert_pem
            self.files[CA_IN_SANDBOX] = ca.cert_pem
            for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO"):
                self.env[name] = BUNDLE_IN_SANDBOX
            self.env["NODE_EXTRA_CA_CERTS"] = CA_IN_SANDBOX

    @property
    def open_net(self) -> OpenNetwork | None:
        """``open``: the namespace's addresses (and a VM's tap)."""
        return self._open

    @property
    def proxy_socket(self) -> Path | None:
        """The proxy's Unix socket (``allow``): for a tier that carries connections to it
        itself instead of binding it in (the microVM tier's egress bridge)."""
        return self._proxy.socket_path if self._proxy is not None else None

    def audit(self) -> list[AuditEvent]:
        """Every refusal and withheld secret so far, oldest first.

        Packets the kernel refused (``open`` mode, and direct attempts in
        ``allow`` mode) are one event each, ``protocol`` ``tcp``/``udp``/``icmp``...
        Beyond the log rate limit (20/s, burst 50) they are still refused but
        summed up: one ``refused-unlogged`` event per rule at the end, its
        ``protocol`` ``nft:<packets>``."""
        kernel = self._open or self._allow_net
        unlogged = kernel.unlogged() if kernel is not None else []  # drains the log: read first
        events = self.audit_log.events()
        for comment, packets in unlogged:
            rule, _, where = comment.partition(" ")
            events.append(AuditEvent(time.time(), self.sandbox_id, "refused-unlogged", where or rule, None, rule,
                                     f"nft:{packets}"))
        return events

    def refused_count(self) -> int:
        """How many destinations were refused so far (packets the kernel logged included; those over
        its log's rate limit are summed in :meth:`audit` only)."""
        return self.audit_log.refused

    def redact(self, data: bytes) -> bytes:
        return self.redactor.redact(data) if self.redactor else data

    def redact_text(self, text: str) -> str:
        return self.redactor.redact_text(text)

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None
        if self._allow_net is not None:
            self._allow_net.close()
            self._allow_net = None
        if self._open is not None:
            self._open.close()
            self._open = None
        elif self.mode == "open":  # creation failed half-way: delete by name (AllowNetwork cleans up itself)
            from . import open_net

            open_net.reap(open_net.OpenNames.for_sandbox(self.sandbox_id))
        shutil.rmtree(self._dir, ignore_errors=True)


def reap(sandbox_id: str, record: Mapping[str, object]) -> None:
    """Release what a dead owner's sandbox left outside its run directory."""
    # unknown (crash before the record): look by name.  ``allow`` has a namespace of the
    # same name; open_net.reap deletes it, and whatever else of that name exists
    if record.get("network", "open") in ("open", "allow"):
        from . import open_net

        open_net.reap(open_net.OpenNames.for_sandbox(sandbox_id))
