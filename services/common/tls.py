"""TLS for every gRPC hop: server credentials, client channels and a development CA.

A process configures its identity once (``configure``, from its ``--tls-cert``, ``--tls-key`` and
``--tls-ca`` flags, as ``setup_tracing`` does for spans); every channel it opens to another Strata
service goes through ``channel``. With a CA configured, internal servers require a client
certificate signed by it (mutual TLS: a process without one cannot join) and clients verify the
server's; the public port of the tokenizer takes TLS without client certificates (users bring
API keys instead). Nothing configured: plaintext, the default on loopback.

``make_dev_certs`` (``strata cert``) writes a CA and one certificate for the services, valid for
the given host names, with both server and client use, for development and tests.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.config import ConfigError


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: str = ""  # this process's certificate chain (PEM)
    key: str = ""  # its private key (PEM)
    ca: str = ""  # the CA that signs every Strata service (PEM)

    @property
    def on(self) -> bool:
        return bool(self.cert or self.ca)

    def check(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("tls_cert and tls_key: give both or neither")
        if self.cert and not self.ca:
            raise ConfigError("tls_ca: required with tls_cert (to verify the other services)")
        for name, path in (("tls_cert", self.cert), ("tls_key", self.key), ("tls_ca", self.ca)):
            if path and not Path(path).is_file():
                raise ConfigError(f"{name}: {path} is not a file")


_files = TlsFiles()


def configure(files: TlsFiles) -> None:
    """This process's certificate and CA for every channel and server it makes."""
    global _files
    files.check()
    _files = files


def files() -> TlsFiles:
    """This process's configuration (empty: plaintext)."""
    return _files


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(client_auth: bool = True) -> grpc.ServerCredentials | None:
    """None without a certificate (plaintext); with one, TLS, and a client certificate signed by
    the CA required when ``client_auth``."""
    f = _files
    if not f.cert:
        return None
    key, cert = _read(f.key), _read(f.cert)
    assert key is not None and cert is not None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=_read(f.ca), require_client_auth=client_auth)


def etcd_credentials() -> grpc.ChannelCredentials:
    """For an ``https://`` etcd endpoint: verify etcd with this process's CA (or the system's when
    none is configured) and present this process's certificate when it has one (etcd run with
    ``--client-cert-auth`` requires it)."""
    f = _files
    return grpc.ssl_channel_credentials(_read(f.ca), _read(f.key), _read(f.cert))


def channel(
    address: str, options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[Any] | None = None
) -> grpc.aio.Channel:
    """An aio channel to another Strata service: TLS (presenting this process's certificate)
    when a CA is configured, else plaintext."""
    f = _files
    if not f.ca:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    creds = grpc.ssl_channel_credentials(_read(f.ca), _read(f.key), _read(f.cert))
    return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)


def make_dev_certs(out: Path, hosts: Sequence[str] = ("localhost", "127.0.0.1"), days: int = 365) -> TlsFiles:
    """A CA (``ca.pem``, ``ca.key``) and a certificate for the services (``service.pem``,
    ``service.key``) valid for ``hosts`` as server and client. For development and tests."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Strata dev"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder().subject_name(name("Strata dev CA")).issuer_name(name("Strata dev CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder().subject_name(name("strata")).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    write_key(out / "ca.key", ca_key)
    (out / "service.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_key(out / "service.key", key)
    return TlsFiles(str(out / "service.pem"), str(out / "service.key"), str(out / "ca.pem"))
