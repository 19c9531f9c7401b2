"""How a client reaches qosd: a plain or TLS channel, and the bearer token it shows.

``ClientTls`` makes the channel TLS (the CA that signed the daemon's certificate) or
mTLS (plus this client's certificate and key). ``TokenFile`` attaches
``authorization: Bearer <token>`` to every call, re-reading the file when it changes
(a rotated Secret), for daemons that set ``auth.control`` or ``auth.qos``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

CHANNEL_OPTIONS: list[tuple[str, Any]] = [("grpc.enable_retries", 1)]


@dataclass(frozen=True, slots=True)
class ClientTls:
    """TLS to the daemon. ``ca_file`` None: the system's trust store."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    # The name to check the daemon's certificate against, when it is not the host
    # the target names (an IP address, or a Service name the certificate lacks).
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("ClientTls: cert_file and key_file go together")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )

    def options(self) -> list[tuple[str, Any]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


class TokenFile:
    """A bearer token in a file, read again when the file changes."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._signature: tuple[int, int, int] | None = None
        self._header: tuple[str, str] = ("authorization", "")
        self.header()  # a missing or empty file fails here, not at the first call

    def header(self) -> tuple[str, str]:
        st = os.stat(self._path)
        signature = (st.st_ino, st.st_size, st.st_mtime_ns)
        if signature != self._signature:
            token = Path(self._path).read_text().strip()
            if not token:
                raise ValueError(f"{self._path}: holds no token")
            self._signature, self._header = signature, ("authorization", f"Bearer {token}")
        return self._header


def aio_channel(target: str, tls: ClientTls | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + tls.options()
    return grpc.aio.secure_channel(target, tls.credentials(), options=options)


def sync_channel(target: str, tls: ClientTls | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + tls.options()
    return grpc.secure_channel(target, tls.credentials(), options=options)
