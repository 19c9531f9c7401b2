"""Certificates for tests: a private CA, and server and client certificates it signs,
written as PEM files, as cert-manager would write them into a mounted Secret."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pem:
    """A certificate and its key, as files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Authority:
    """A CA that signs certificates for tests; ``cert`` is what clients trust."""

    cert: Path
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    def issue(
        self,
        directory: Path,
        name: str,
        *,
        server: bool,
        uri: str | None = None,
        not_after: datetime.datetime | None = None,
    ) -> Pem:
        """A certificate for ``name`` (a server's valid for 127.0.0.1 and localhost; a
        client's with ``uri`` as its URI subject alternative name, as SPIFFE issues),
        valid for a day unless ``not_after`` says otherwise."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            _builder(name, key, not_after)
            .issuer_name(self.certificate.subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            names: list[x509.GeneralName] = [
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            ]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        elif uri is not None:
            identity = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)])
            builder = builder.add_extension(identity, critical=False)
        return _write(directory, name, builder.sign(self.key, hashes.SHA256()), key)


def _builder(
    name: str, key: ec.EllipticCurvePrivateKey, not_after: datetime.datetime | None = None
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after or now + datetime.timedelta(days=1))
    )


def _write(
    directory: Path, name: str, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> Pem:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Pem(cert_path, key_path)


def authority(directory: Path, name: str = "qosd-test-ca") -> Authority:
    """A self-signed CA, its certificate written to ``directory``."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(name, key).issuer_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    )
    certificate = builder.add_extension(
        x509.BasicConstraints(ca=True, path_length=0), critical=True
    ).sign(key, hashes.SHA256())
    pem = _write(directory, name, certificate, key)
    return Authority(pem.cert, key, certificate)
