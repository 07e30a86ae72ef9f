from __future__ import annotations

import ipaddress
import json
import multiprocessing
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from security.devpki import DevPKI, ensure_dev_pki, mint_token
from security.jwt import AuthError, JWTConfig, JWTVerifier
from security.principal import Principal


def files(pki: DevPKI) -> list[Path]:
    return [
        pki.ca_cert,
        pki.ca_key,
        pki.server_cert,
        pki.server_key,
        pki.client_cert,
        pki.client_key,
        pki.jwt_key,
        pki.jwks,
    ]


def test_created_once_with_private_keys_0600_then_reused(tmp_path: Path) -> None:
    pki = ensure_dev_pki(tmp_path)
    before = {p: p.read_bytes() for p in files(pki)}
    for key in (pki.ca_key, pki.server_key, pki.client_key, pki.jwt_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(pki.dir.stat().st_mode) == 0o700

    again = ensure_dev_pki(tmp_path)
    assert again == pki
    assert {p: p.read_bytes() for p in files(again)} == before


def test_missing_leaf_is_reissued_alone(tmp_path: Path) -> None:
    pki = ensure_dev_pki(tmp_path)
    ca, server = pki.ca_cert.read_bytes(), pki.server_cert.read_bytes()
    pki.client_key.unlink()
    ensure_dev_pki(tmp_path)
    assert pki.ca_cert.read_bytes() == ca and pki.server_cert.read_bytes() == server
    assert stat.S_IMODE(pki.client_key.stat().st_mode) == 0o600


def test_certificates_chain_to_the_ca_with_the_right_names(tmp_path: Path) -> None:
    pki = ensure_dev_pki(tmp_path)
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    client = x509.load_pem_x509_certificate(pki.client_cert.read_bytes())
    for leaf in (server, client):
        leaf.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert set(sans.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    eku = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]


async def test_minted_token_verifies_against_the_generated_jwks(tmp_path: Path) -> None:
    pki = ensure_dev_pki(tmp_path)
    assert [k["kid"] for k in json.loads(pki.jwks.read_text())["keys"]] == [pki.kid]
    verifier = JWTVerifier(JWTConfig(jwks_file=pki.jwks, issuer="tianmen-dev", audience="tianmen"))
    token = mint_token(pki.jwt_key, pki.kid, "bob", "acme", scopes=("chat", "admin"), models=["tiny"], tier="gold")
    assert await verifier.verify(token) == Principal(
        "bob", "acme", frozenset({"chat", "admin"}), frozenset({"tiny"}), "gold"
    )
    assert verifier.verify_sync(mint_token(pki.jwt_key, pki.kid, "eve", "t2")).models is None

    expired = mint_token(pki.jwt_key, pki.kid, "bob", "acme", ttl_s=-120)
    with pytest.raises(AuthError) as err:
        await verifier.verify(expired)
    assert err.value.reason == "expired"

    other = ensure_dev_pki(tmp_path / "elsewhere")
    with pytest.raises(AuthError) as err:
        await verifier.verify(mint_token(other.jwt_key, pki.kid, "bob", "acme"))
    assert err.value.reason == "bad_signature"


def _first_run(home: Path, start: Any, out: Any) -> None:
    start.wait()
    pki = ensure_dev_pki(home)
    out.put((pki.kid, pki.ca_cert.read_bytes(), pki.jwt_key.read_bytes()))


def test_processes_starting_at_once_on_a_fresh_home_end_with_one_pki() -> None:
    """A server and its clients often start together on a new home: each must end with the same CA and JWT key
    (two writers each made their own JWT key, and the server refused the client's tokens with 401)."""
    ctx = multiprocessing.get_context("fork")
    for _ in range(4):
        with tempfile.TemporaryDirectory() as tmp:
            home, start, out = Path(tmp), ctx.Barrier(4), ctx.Queue()
            procs = [ctx.Process(target=_first_run, args=(home, start, out)) for _ in range(4)]
            for p in procs:
                p.start()
            seen = [out.get(timeout=60) for _ in procs]
            for p in procs:
                p.join(30)
                assert p.exitcode == 0
            assert len(set(seen)) == 1
            kid, ca, jwt_key = seen[0]
            assert json.loads((home / "pki" / "jwks.json").read_text())["keys"][0]["kid"] == kid
            assert (home / "pki" / "ca.pem").read_bytes() == ca and (
                home / "pki" / "jwt-signing-key.pem"
            ).read_bytes() == jwt_key


def test_a_complete_pki_in_a_directory_that_takes_no_lock_file_is_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = ensure_dev_pki(tmp_path)
    (pki.dir / ".lock").unlink()
    real_open = os.open

    def read_only(path: str | os.PathLike[str], flags: int, *args: Any) -> int:
        if flags & os.O_CREAT:
            raise PermissionError(13, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    assert ensure_dev_pki(tmp_path) == pki
