"""The verified-token cache: a repeated token skips the signature check, and nothing else changes."""

from __future__ import annotations

import json
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from security.jwt import AuthError, JWTConfig, JWTVerifier
from security.principal import Principal
from security.token_cache import VerifiedTokens
from tests.unit.test_jwt import AUD, ISS, claims, public_jwk


@pytest.fixture
def key() -> ed25519.Ed25519PrivateKey:
    return ed25519.Ed25519PrivateKey.generate()


def write_jwks(path: Path, *keys: tuple[ed25519.Ed25519PrivateKey, str]) -> Path:
    path.write_text(json.dumps({"keys": [public_jwk(k, kid) for k, kid in keys]}))
    return path


def token(key: ed25519.Ed25519PrivateKey, kid: str = "ed", **overrides: object) -> str:
    return jwt.encode(claims(**overrides), key, algorithm="EdDSA", headers={"kid": kid})


def counting_decode(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = jwt.decode

    def decode(tok: str, *args: object, **kwargs: object) -> object:
        calls.append(tok)
        return real(tok, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(jwt, "decode", decode)
    return calls


async def test_a_repeated_token_is_verified_once(tmp_path: Path, key, monkeypatch) -> None:
    v = JWTVerifier(JWTConfig(jwks_file=write_jwks(tmp_path / "j.json", (key, "ed")), issuer=ISS, audience=AUD))
    calls = counting_decode(monkeypatch)
    tok = token(key)
    first = await v.verify(tok)
    assert [await v.verify(tok) for _ in range(5)] == [first] * 5 and v.verify_sync(tok) == first
    assert calls == [tok]


async def test_a_repeated_token_header_is_parsed_once(tmp_path: Path, key, monkeypatch) -> None:
    v = JWTVerifier(JWTConfig(jwks_file=write_jwks(tmp_path / "j.json", (key, "ed")), issuer=ISS, audience=AUD))
    parsed: list[str] = []
    real = jwt.get_unverified_header
    monkeypatch.setattr(jwt, "get_unverified_header", lambda tok: parsed.append(tok) or real(tok))
    tok, other = token(key), token(key, sub="bob")
    first = await v.verify(tok)
    assert [await v.verify(tok) for _ in range(3)] == [first] * 3 and v.verify_sync(tok) == first
    assert (await v.verify(other)).subject == "bob"
    assert parsed == [tok, other]


async def test_a_tampered_copy_of_a_cached_token_is_still_refused(tmp_path: Path, key) -> None:
    v = JWTVerifier(JWTConfig(jwks_file=write_jwks(tmp_path / "j.json", (key, "ed")), issuer=ISS, audience=AUD))
    tok = token(key)
    await v.verify(tok)
    head, body, sig = tok.split(".")  # a character in the middle: every bit of it is in the signature's bytes
    forged_body = jwt.utils.base64url_encode(json.dumps(claims(sub="mallory")).encode()).decode()
    for forged in (
        f"{head}.{forged_body}.{sig}",
        f"{head}.{body}.{sig[:10]}{'A' if sig[10] != 'A' else 'B'}{sig[11:]}",
    ):
        with pytest.raises(AuthError) as e:
            await v.verify(forged)
        assert e.value.reason == "bad_signature"


async def test_a_rotated_out_key_ends_its_cached_tokens(tmp_path: Path, key) -> None:
    other = ed25519.Ed25519PrivateKey.generate()
    jwks = write_jwks(tmp_path / "j.json", (key, "ed"))
    v = JWTVerifier(JWTConfig(jwks_file=jwks, issuer=ISS, audience=AUD))
    tok = token(key)
    await v.verify(tok)
    # the key set changes: the cached entry's key is not the current one, so the token is checked again and fails
    write_jwks(jwks, (other, "ed"))
    v2 = JWTVerifier(JWTConfig(jwks_file=jwks, issuer=ISS, audience=AUD))
    v2._verified = v._verified  # same cache, new key set: as after a JWKS refresh
    with pytest.raises(AuthError) as e:
        await v2.verify(tok)
    assert e.value.reason == "bad_signature" and len(v._verified) == 0  # and the stale entry is gone


def test_entries_expire_with_the_token_and_honour_nbf() -> None:
    now = [1000.0]
    cache = VerifiedTokens(clock=lambda: now[0])
    p, k = Principal("alice", "acme", frozenset(), None, None), object()
    cache.put("t", k, p, {"exp": 1100, "nbf": 990}, ("EdDSA", None))
    assert cache.get("t", k, leeway_s=0) == p
    assert cache.get("t", object(), leeway_s=0) is None  # another key object: never a hit
    cache.put("t", k, p, {"exp": 1100, "nbf": 990}, ("EdDSA", None))
    now[0] = 1100.0
    assert cache.get("t", k, leeway_s=0) is None  # exp <= now: expired, and dropped
    cache.put("t", k, p, {"exp": 1100}, ("EdDSA", None))
    assert cache.get("t", k, leeway_s=30) == p  # within the leeway, as PyJWT accepts it
    cache.put("late", k, p, {"exp": 2000, "nbf": 1200}, ("EdDSA", None))
    assert cache.get("late", k, leeway_s=30) is None


def test_the_cache_is_bounded_and_can_be_off() -> None:
    cache = VerifiedTokens(max_entries=3, clock=lambda: 0.0)
    p, k = Principal("alice", "acme", frozenset(), None, None), object()
    for i in range(10):
        cache.put(f"t{i}", k, p, {"exp": 10}, ("EdDSA", None))
    assert len(cache) == 3 and cache.get("t9", k, 0) == p and cache.get("t0", k, 0) is None
    for bad in ({"exp": "10"}, {"exp": True}, {}, {"exp": 10, "nbf": "x"}):
        cache.put("odd", k, p, bad, ("EdDSA", None))
        assert cache.get("odd", k, 0) is None
    off = VerifiedTokens(max_entries=0)
    off.put("t", k, p, {"exp": 10**12}, ("EdDSA", None))
    assert off.get("t", k, 0) is None and len(off) == 0


def test_config_bounds_the_cache_size() -> None:
    for bad in (-1, 1_000_001):
        with pytest.raises(ValueError, match="verified_cache_entries"):
            JWTConfig(hs256_secret=b"x" * 32, verified_cache_entries=bad)
