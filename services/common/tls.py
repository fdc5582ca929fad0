"""TLS on the gRPC hops: one process-wide setting, from `--tls-cert/--tls-key/--tls-ca` or
$SLORA_TLS_CERT / $SLORA_TLS_KEY / $SLORA_TLS_CA.

- A process with a certificate and key serves TLS only (`start_server`, the control plane): a
  plaintext client cannot connect.
- A process with a CA verifies every server it calls against it (`open_channel`,
  `open_sync_channel`: watch streams, gateway -> worker, admin client) and presents its own
  certificate when it has one. Without any setting, channels and servers are plaintext.
- `write_throwaway_certs` makes a CA and one certificate for the local stack (127.0.0.1 and
  localhost, server and client use) with `cryptography`.

Servers do not require client certificates (the gateway's clients are applications holding
API keys); identities between processes come from credentials (docs/security.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

CERT_ENV, KEY_ENV, CA_ENV = "SLORA_TLS_CERT", "SLORA_TLS_KEY", "SLORA_TLS_CA"


@dataclass(frozen=True)
class TlsConfig:
    cert: Path | None = None  # PEM certificate chain this process presents
    key: Path | None = None   # its private key
    ca: Path | None = None    # PEM CA that servers this process calls must chain to

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> TlsConfig | None:
        """The setting in `env`, None when it has none; ValueError for a cert without a key."""
        cert, key, ca = (env.get(n, "") for n in (CERT_ENV, KEY_ENV, CA_ENV))
        if not (cert or key or ca):
            return None
        if bool(cert) != bool(key):
            raise ValueError(f"{CERT_ENV} and {KEY_ENV} go together")
        return cls(Path(cert) if cert else None, Path(key) if key else None,
                   Path(ca) if ca else None)

    @property
    def serves_tls(self) -> bool:
        return self.cert is not None and self.key is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.cert is not None and self.key is not None
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None)


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """`--tls-cert/--tls-key/--tls-ca`, defaulting to the environment."""
    for flag, env, what in (("--tls-cert", CERT_ENV, "PEM certificate to serve TLS with"),
                            ("--tls-key", KEY_ENV, "its private key"),
                            ("--tls-ca", CA_ENV, "PEM CA to verify the servers this process "
                                                 "calls (their certificates must chain to it)")):
        parser.add_argument(flag, default=os.environ.get(env, ""), help=f"{what}; env {env}")


def apply_tls_arguments(args: argparse.Namespace) -> None:
    """Make the flags the process-wide setting (the environment is where servers, channels
    and child processes look)."""
    for value, env in ((args.tls_cert, CERT_ENV), (args.tls_key, KEY_ENV), (args.tls_ca, CA_ENV)):
        if value:
            os.environ[env] = str(value)
    TlsConfig.from_env()  # fail now on a half setting


def add_port(server: grpc.aio.Server, listen: str, tls: TlsConfig | None) -> int:
    """Bind `listen` with TLS when `tls` has a certificate, in plaintext otherwise."""
    if tls is not None and tls.serves_tls:
        return server.add_secure_port(listen, tls.server_credentials())
    return server.add_insecure_port(listen)


def open_channel(target: str, options: Sequence[tuple[str, Any]] = (),
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
                 tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """An aio channel to `target`: TLS when the process (or `tls`) has a CA or certificate."""
    tls = tls or TlsConfig.from_env()
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=options,
                                   interceptors=interceptors)


def open_sync_channel(target: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A blocking channel to `target`, TLS like `open_channel`."""
    tls = tls or TlsConfig.from_env()
    if tls is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, tls.channel_credentials())


def saved_client_tls(saved: Mapping[str, str], target: str, address_key: str
                     ) -> TlsConfig | None:
    """TLS for a CLI client: the environment's setting, else the CA `slora up` saved in its
    connection file (`SLORA_TLS_CA`), used only for the address saved with it."""
    configured = TlsConfig.from_env()
    if configured is not None:
        return configured
    ca = saved.get(CA_ENV, "")
    return TlsConfig(ca=Path(ca)) if ca and target == saved.get(address_key) else None


def write_throwaway_certs(folder: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                          days: int = 30) -> TlsConfig:
    """A fresh CA and one certificate for `hosts` (server and client use), PEM files in
    `folder` (key files 0600). For a local stack: nothing outside trusts this CA."""
    from cryptography.hazmat.primitives import serialization

    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _certificate("slora throwaway CA", None, None, (), days)
    key, cert = _certificate("slora stack", ca_key, ca_cert, hosts, days)
    paths = TlsConfig(folder / "stack.pem", folder / "stack.key", folder / "ca.pem")
    assert paths.cert and paths.key and paths.ca
    paths.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(paths.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return paths


def _certificate(name: str, issuer_key: Any, issuer: Any, hosts: Sequence[str],
                 days: int) -> tuple[Any, Any]:
    """(key, certificate): a CA when `issuer` is None, else a leaf for `hosts` signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer.subject if issuer is not None else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None),
                              critical=True))
    if issuer is not None:
        names = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h)
                 for h in hosts]
        builder = (builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]),
                                  critical=False))
    return key, builder.sign(issuer_key if issuer is not None else key, hashes.SHA256())


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
