"""The daemon's own TLS: server certificates for the gRPC and HTTP listeners, re-read
from disk when they rotate.

cert-manager (or any Secret rotation) writes new files into a mounted volume; the
kubelet swaps a symlink, so the path stays and what it points at changes. Both
listeners look at the files' signatures (device, inode, size, modification time, all
through the symlink) when a client connects, at most once a second, and load the new
pair when it changed. A pair that does not load (half written, a key that does not
match) is logged and the previous one kept: a rotation never takes the listener down.
Connections already open keep the certificate they began with.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from qosd.config import FileSignature, ServerTlsConfig, file_signature

log = logging.getLogger(__name__)

# How often a handshake may look at the files; rotations are hours apart.
CHECK_INTERVAL_S = 1.0

Signature = tuple[FileSignature, ...]


@dataclass(frozen=True, slots=True)
class CertificatePair:
    """One load of the files: what both listeners serve until the next change."""

    cert: bytes
    key: bytes
    client_ca: bytes | None
    # For the HTTP listener. Loading it is also the proof that the key matches.
    http_context: ssl.SSLContext
    expires_at: float  # the served certificate's notAfter, Unix seconds


class ServerCertificates:
    """The files of ``server.tls``, watched; hands each listener its credentials."""

    def __init__(
        self,
        config: ServerTlsConfig,
        on_reload: Callable[[bool], None] | None = None,
        on_expiry: Callable[[float], None] | None = None,
    ) -> None:
        assert config.cert_file is not None and config.key_file is not None
        self._paths = [config.cert_file, config.key_file]
        if config.client_ca_file is not None:
            self._paths.append(config.client_ca_file)
        self._lock = threading.Lock()  # gRPC calls the fetcher on its own threads
        self._on_reload = on_reload
        # Told the served certificate's expiry at start and at each rotation, so an
        # alert can warn before it lapses (qosd_tls_certificate_expiry_timestamp_seconds).
        self._on_expiry = on_expiry
        self._pair = self._load()  # at start, a bad file is an error: raise
        if on_expiry is not None:
            on_expiry(self._pair.expires_at)
        self._signature = self._read_signature()
        self._failed: Signature | None = None  # a rotation that did not load, once
        self._checked_at = time.monotonic()
        self._generation = 0

    @property
    def requires_client_certificates(self) -> bool:
        return len(self._paths) == 3

    @property
    def generation(self) -> int:
        """How many rotations have been loaded since start."""
        return self._generation

    def _read_signature(self) -> Signature:
        return tuple(file_signature(path) for path in self._paths)

    def _load(self) -> CertificatePair:
        before = self._read_signature()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self._paths[0], self._paths[1])
        if len(self._paths) > 2:
            context.load_verify_locations(cafile=self._paths[2])  # proves the CA file
        contents = []
        for path in self._paths:
            with open(path, "rb") as handle:
                contents.append(handle.read())
        if self._read_signature() != before:
            raise ValueError("the files changed while they were read")  # next look: again
        client_ca = contents[2] if len(contents) > 2 else None
        expires_at = certificate_expiry(contents[0])
        return CertificatePair(contents[0], contents[1], client_ca, context, expires_at)

    def refresh(self, *, force: bool = False) -> bool:
        """Loads the files again if they changed since the last look; True when a new
        pair is now served. Cheap when called often: it looks once a second at most."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._checked_at < CHECK_INTERVAL_S:
                return False
            self._checked_at = now
            try:
                signature = self._read_signature()
            except OSError as exc:
                log.warning("TLS files unreadable, keeping the current certificate: %s", exc)
                return False
            if signature in (self._signature, self._failed):
                return False  # unchanged, or the same bad files: logged and counted once
            try:
                pair = self._load()
                signature = self._read_signature()
            except (OSError, ssl.SSLError, ValueError) as exc:
                self._failed = signature
                log.warning("TLS files changed but do not load, keeping the current ones: %s", exc)
                if self._on_reload is not None:
                    self._on_reload(False)
                return False
            self._signature, self._pair = signature, pair
            self._generation += 1
        log.info("TLS certificate reloaded from %s", self._paths[0])
        if self._on_reload is not None:
            self._on_reload(True)
        if self._on_expiry is not None:
            self._on_expiry(pair.expires_at)
        return True

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials that ask for the current pair at every new connection."""
        served: list[CertificatePair] = [self._pair]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            self.refresh()
            if self._pair is served[0]:
                return None  # unchanged: gRPC keeps what it has
            served[0] = self._pair
            return _grpc_configuration(self._pair)

        return grpc.dynamic_ssl_server_credentials(
            _grpc_configuration(self._pair),
            fetch,
            require_client_authentication=self.requires_client_certificates,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """A context for the HTTP listener that switches to a new pair at handshake.

        Prometheus and kubelet probes send no client certificate, so the HTTP
        listener asks for none even when gRPC requires one: it serves health and
        metrics, never a control call."""

        def pick(connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
            self.refresh()
            connection.context = self._pair.http_context

        # Every handshake begins on the listener's first context, whose callback (called
        # with or without SNI) moves it onto the newest pair's.
        first = self._pair.http_context
        first.sni_callback = pick
        return first


def _grpc_configuration(pair: CertificatePair) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(pair.key, pair.cert)], root_certificates=pair.client_ca
    )


def certificate_expiry(pem: bytes) -> float:
    """The notAfter of the first certificate in ``pem``, Unix seconds (the standard
    library has no public reader of it). Raises ValueError on anything else."""
    from cryptography import x509  # noqa: PLC0415 - only daemons that serve TLS pay for it

    return x509.load_pem_x509_certificate(pem).not_valid_after_utc.timestamp()
