"""The per-sandbox certificate authority used to see inside HTTPS to secret-bound hosts.

Each sandbox gets its own CA (EC P-256, made with ``cryptography``) that lives
for the sandbox's lifetime.  Its certificate is trusted inside the sandbox; its
key stays in a root-only directory of the owner and never enters the sandbox.
A leaf certificate is minted per host on first use and cached: the most recent
:data:`LEAF_CONTEXTS` of them (a ``*.domain`` binding under wildcard DNS names hosts
without end, and each context holds ~0.4 MiB), their files deleted as soon as loaded.

A sandbox may live for weeks (a lifetime of up to 30 days, or none), and it trusts the CA
certificate it was given at its start: so the CA is valid for far longer than any sandbox
lives (it is trusted nowhere but in its sandbox, and dies with it), and a leaf is minted
afresh a day before it ends.  Both were valid for two days from when they were made: after
that, every HTTPS request of the sandbox to a host its secrets are bound to failed.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: the CA's validity: longer than any sandbox lives
CA_VALIDITY = datetime.timedelta(days=3650)
#: a leaf's validity, and how long before its end a fresh one replaces it
LEAF_VALIDITY = datetime.timedelta(days=2)
LEAF_RENEWAL = datetime.timedelta(days=1)
#: leaf TLS contexts kept per sandbox (least recently used dropped first)
LEAF_CONTEXTS = 64


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class SandboxCA:
    def __init__(self, directory: Path, sandbox_id: str, clock: Callable[[], datetime.datetime] = _utc_now) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, exist_ok=True)
        self._clock = clock
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = clock()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"Corral sandbox CA {sandbox_id}")])
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + CA_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.cert_pem = self.certificate.public_bytes(serialization.Encoding.PEM)
        #: host -> (its context, when to mint the next one)
        self._contexts: OrderedDict[str, tuple[ssl.SSLContext, datetime.datetime]] = OrderedDict()
        self._made = 0
        self._lock = threading.Lock()

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for ``host`` signed by this CA."""
        with self._lock:
            now = self._clock()
            cached = self._contexts.get(host)
            if cached is None or now >= cached[1]:
                cached = self._contexts[host] = (self._make_context(host, now), now + LEAF_VALIDITY - LEAF_RENEWAL)
            self._contexts.move_to_end(host)
            while len(self._contexts) > LEAF_CONTEXTS:
                self._contexts.popitem(last=False)
            return cached[0]

    def _make_context(self, host: str, now: datetime.datetime) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + LEAF_VALIDITY)
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        # ssl can only load a chain from files: they go in the owner's root-only directory, for
        # as long as it takes to load them
        self._made += 1
        stem = self.directory / f"leaf-{self._made}"
        cert_file, key_file = stem.with_suffix(".crt"), stem.with_suffix(".key")
        try:
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_pem_key(key))
            cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(cert_file, key_file)
        finally:
            cert_file.unlink(missing_ok=True)
            key_file.unlink(missing_ok=True)
        ctx.set_alpn_protocols(["http/1.1"])  # header rewriting speaks HTTP/1.1 only
        return ctx


def upstream_context(cafile: str | None) -> ssl.SSLContext:
    """How the proxy checks the real server when it intercepts: system trust unless told otherwise."""
    ctx = ssl.create_default_context(cafile=cafile)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx
