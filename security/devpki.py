from __future__ import annotations

import base64
import contextlib
import datetime as dt
import fcntl
import hashlib
import ipaddress
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
LEAF_DAYS = 397
RENEW_BEFORE = dt.timedelta(days=7)
SERVER_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(slots=True, frozen=True)
class DevPKI:
    """Paths of the embedded development PKI (never for production)."""

    dir: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    jwt_key: Path
    jwks: Path
    kid: str


def ensure_dev_pki(home: Path) -> DevPKI:
    """Create the dev PKI under `home/pki` on first run; reuse what is there and still valid afterwards."""
    d = home / "pki"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _locked(d / ".lock"):
        return _ensure(d)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock between processes. WHY: `tianmen serve` and a client (`tianmen token`, a test) starting
    at once on a fresh home each found no JWT key, each wrote its own, and the server's tokens failed with 401."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:  # a read-only directory: nothing can be written there, so there is no race to lose
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _ensure(d: Path) -> DevPKI:
    ca_cert, ca_key = d / "ca.pem", d / "ca-key.pem"
    server_cert, server_key = d / "server.pem", d / "server-key.pem"
    client_cert, client_key = d / "client.pem", d / "client-key.pem"
    jwt_key, jwks = d / "jwt-signing-key.pem", d / "jwks.json"

    new_ca = not (_valid(ca_cert) and ca_key.exists())
    if new_ca:
        key = ec.generate_private_key(ec.SECP256R1())
        name = _name("Tianmen Dev CA")
        cert = (
            _builder(name, name, key.public_key(), CA_DAYS)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_usage(cert_sign=True), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        _write_key(ca_key, key)
        _write(ca_cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    ca = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    signer = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
    assert isinstance(signer, ec.EllipticCurvePrivateKey)

    # server cert: SANs for every loopback name a dev client may dial
    if new_ca or not (_valid(server_cert) and server_key.exists()):
        sans: list[x509.GeneralName] = [x509.DNSName("localhost")]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SERVER_NAMES[1:]]
        _issue(ca, signer, server_cert, server_key, "localhost", ExtendedKeyUsageOID.SERVER_AUTH, sans)
    if new_ca or not (_valid(client_cert) and client_key.exists()):
        _issue(ca, signer, client_cert, client_key, "tianmen-dev-client", ExtendedKeyUsageOID.CLIENT_AUTH, [])

    if not jwt_key.exists():
        _write_key(jwt_key, ed25519.Ed25519PrivateKey.generate())
        jwks.unlink(missing_ok=True)
    signing = serialization.load_pem_private_key(jwt_key.read_bytes(), password=None)
    assert isinstance(signing, ed25519.Ed25519PrivateKey)
    jwk = _ed25519_jwk(signing.public_key())
    if not jwks.exists():
        _write(jwks, json.dumps({"keys": [jwk]}, indent=2).encode() + b"\n", 0o644)
    return DevPKI(d, ca_cert, ca_key, server_cert, server_key, client_cert, client_key, jwt_key, jwks, jwk["kid"])


def mint_token(
    signing_key_path: Path,
    kid: str,
    sub: str,
    tenant: str,
    scopes: Iterable[str] = (),
    models: Iterable[str] | None = None,
    tier: str | None = None,
    ttl_s: int = 3600,
    issuer: str = "tianmen-dev",
    audience: str = "tianmen",
) -> str:
    """Sign a dev token with the key at `signing_key_path` (Ed25519 → EdDSA, P-256 → ES256, RSA → RS256)."""
    key = serialization.load_pem_private_key(signing_key_path.read_bytes(), password=None)
    if isinstance(key, ed25519.Ed25519PrivateKey):
        alg = "EdDSA"
    elif isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        alg = "ES256"
    elif isinstance(key, rsa.RSAPrivateKey):
        alg = "RS256"
    else:
        raise ValueError(f"unsupported signing key type {type(key).__name__}")
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": issuer,
        "aud": audience,
        "sub": sub,
        "tenant": tenant,
        "scope": " ".join(scopes),
        "iat": now,
        "nbf": now,
        "exp": now + ttl_s,
        "jti": uuid.uuid4().hex,
    }
    if models is not None:
        claims["models"] = sorted(models)
    if tier is not None:
        claims["tier"] = tier
    return jwt.encode(claims, key, algorithm=alg, headers={"kid": kid})


def _ed25519_jwk(pub: ed25519.Ed25519PublicKey) -> dict[str, str]:
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    jwk = {"crv": "Ed25519", "kty": "OKP", "x": _b64(raw)}
    # kid = RFC 7638 thumbprint, stable across runs for the same key
    thumb = hashlib.sha256(json.dumps(jwk, separators=(",", ":"), sort_keys=True).encode()).digest()
    return {**jwk, "kid": _b64(thumb), "alg": "EdDSA", "use": "sig"}


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tianmen Dev"), x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    )


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _builder(
    subject: x509.Name, issuer: x509.Name, pub: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(pub)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
    )


def _issue(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    cert_path: Path,
    key_path: Path,
    cn: str,
    eku: x509.ObjectIdentifier,
    sans: list[x509.GeneralName],
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(_name(cn), ca.subject, key.public_key(), LEAF_DAYS)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    _write_key(key_path, key)
    _write(cert_path, builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), 0o644)


def _valid(cert_path: Path) -> bool:
    if not cert_path.exists():
        return False
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    return cert.not_valid_after_utc - RENEW_BEFORE > dt.datetime.now(dt.timezone.utc)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write(path, pem, 0o600)


def _write(path: Path, data: bytes, mode: int) -> None:
    # NOTE: created with its final mode and renamed into place, so a key is never world-readable, even briefly
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
        os.fchmod(f.fileno(), mode)
        f.write(data)
    os.replace(tmp, path)
