"""A site's TLS material for the fleet endpoint, made offline: a CA, a
server certificate it signed for the loopback address, and a key that is not
that certificate's (for the refusal tests). Real X.509 (cryptography), so
HAProxy and Python's ssl module treat it as they would a site's.
"""

from __future__ import annotations

import datetime as dt
import ssl
from dataclasses import dataclass
from ipaddress import ip_address

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def _pem_cert(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    days: int,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    issuer_name, signer = issuer or (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=days))
    )
    if issuer is None:
        ca = x509.BasicConstraints(ca=True, path_length=0)
        builder = builder.add_extension(ca, critical=True)
    else:
        names = [x509.DNSName("localhost"), x509.IPAddress(ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signer, hashes.SHA256())


@dataclass(frozen=True)
class SiteTLS:
    """PEM text: the CA clients trust, the endpoint's certificate and key, a stranger key."""

    ca: str
    cert: str
    key: str
    other_key: str

    def client_context(self) -> ssl.SSLContext:
        """What a client of the site does: trust the site's CA, check the name."""
        return ssl.create_default_context(cadata=self.ca)


def site_tls(days: int = 30) -> SiteTLS:
    ca_key, server_key = _key(), _key()
    ca = _cert("vllm-fleet test CA", ca_key, None, days)
    server = _cert("localhost", server_key, ("vllm-fleet test CA", ca_key), days)
    return SiteTLS(_pem_cert(ca), _pem_cert(server), _pem_key(server_key), _pem_key(_key()))
