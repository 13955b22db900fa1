"""The fleet endpoint's TLS material, checked on the controller before any host changes.

A key that does not match its certificate, or a certificate past its dates,
would let the proxy's config pass to a host and then fail its start (or
serve an expired certificate): refuse it in the validate play instead, by
name, never printing the key.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _public(key: Any) -> bytes:
    return key.public_bytes(*_SPKI)


def _certificates(pem: str) -> tuple[list[x509.Certificate], str]:
    try:
        return x509.load_pem_x509_certificates(pem.encode()), ""
    except ValueError as err:
        return [], f"cert is not a PEM certificate ({err})"


def _key(pem: str) -> tuple[Any, str]:
    try:
        return serialization.load_pem_private_key(pem.encode(), password=None), ""
    except (ValueError, TypeError) as err:
        # The library's message names the format, never the key's bytes.
        return None, f"key is not an unencrypted PEM private key ({type(err).__name__})"


def _dates(cert: x509.Certificate, now: dt.datetime) -> str:
    if now > cert.not_valid_after_utc:
        return f"the certificate expired on {cert.not_valid_after_utc:%Y-%m-%d}"
    if now < cert.not_valid_before_utc:
        return f"the certificate is not valid before {cert.not_valid_before_utc:%Y-%m-%d}"
    return ""


def vllm_tls_problems(tls: Any, now: dt.datetime | None = None) -> list[str]:
    """What is wrong with ``{cert, key}`` (PEM text); [] when it serves, or when TLS is off."""
    if not tls:
        return []
    if not isinstance(tls, dict):
        return ["give a mapping with cert and key (PEM text), or leave it empty for plain HTTP"]
    unknown = sorted(str(name) for name in tls if name not in ("cert", "key"))
    if unknown:
        # A misspelt key name would otherwise read as a missing key.
        return [f"unknown entries {', '.join(unknown)}: only cert and key are read"]
    if not tls.get("cert") or not tls.get("key"):
        return ["set both cert and key (PEM text), or leave it empty for plain HTTP"]
    certs, problem = _certificates(str(tls["cert"]))
    if problem:
        return [problem]
    key, problem = _key(str(tls["key"]))
    if problem:
        return [problem]
    problems = []
    if _public(key.public_key()) != _public(certs[0].public_key()):
        problems.append(
            "the key does not match the certificate (the first certificate of cert must be the "
            "endpoint's own, the key its private key)"
        )
    dates = _dates(certs[0], now or dt.datetime.now(dt.UTC))
    return problems + ([dates] if dates else [])


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"vllm_tls_problems": vllm_tls_problems}
