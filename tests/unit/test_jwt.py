from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from security.jwks import JWKSCache, JWKSError
from security.jwt import AuthError, JWTConfig, JWTVerifier
from security.principal import Principal

ISS, AUD = "https://idp.example", "tianmen"
HS_SECRET = b"s" * 32
PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


@dataclass
class Keys:
    ed: ed25519.Ed25519PrivateKey
    ec: ec.EllipticCurvePrivateKey
    rsa: rsa.RSAPrivateKey

    def by_kid(self, kid: str) -> PrivateKey:
        key: PrivateKey = getattr(self, kid)
        return key


def public_jwk(key: PrivateKey, kid: str) -> dict[str, Any]:
    pub = key.public_key()
    if isinstance(pub, rsa.RSAPublicKey):
        jwk = RSAAlgorithm.to_jwk(pub, as_dict=True)
    elif isinstance(pub, ec.EllipticCurvePublicKey):
        jwk = ECAlgorithm.to_jwk(pub, as_dict=True)
    else:
        jwk = OKPAlgorithm.to_jwk(pub, as_dict=True)
    return {**jwk, "kid": kid}


@pytest.fixture(scope="module")
def keys() -> Keys:
    return Keys(
        ed25519.Ed25519PrivateKey.generate(),
        ec.generate_private_key(ec.SECP256R1()),
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
    )


@pytest.fixture
def jwks_file(tmp_path: Path, keys: Keys) -> Path:
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [public_jwk(keys.by_kid(k), k) for k in ("ed", "ec", "rsa")]}))
    return path


@pytest.fixture
def verifier(jwks_file: Path) -> JWTVerifier:
    return JWTVerifier(JWTConfig(jwks_file=jwks_file, issuer=ISS, audience=AUD))


def claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    base = {"iss": ISS, "aud": AUD, "sub": "alice", "tenant": "acme", "scope": "chat", "iat": now, "exp": now + 300}
    return {k: v for k, v in (base | overrides).items() if v is not None}


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(seg: str) -> bytes:
    return base64.urlsafe_b64decode(seg + "=" * (-len(seg) % 4))


def sign(keys: Keys, kid: str | None = "ed", alg: str = "EdDSA", key_kid: str | None = None, **overrides: Any) -> str:
    headers = {"kid": kid} if kid is not None else {}
    return jwt.encode(claims(**overrides), keys.by_kid(key_kid or kid or "ed"), algorithm=alg, headers=headers)


def hs256(header: dict[str, Any], payload: dict[str, Any], secret: bytes) -> str:
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"
    mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64(mac)}"


def pem(keys: Keys) -> bytes:
    return keys.rsa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@pytest.mark.parametrize(("kid", "alg"), [("ed", "EdDSA"), ("ec", "ES256"), ("rsa", "RS256"), ("rsa", "PS256")])
async def test_valid_asymmetric_tokens_map_to_principal(verifier: JWTVerifier, keys: Keys, kid: str, alg: str) -> None:
    token = sign(keys, kid, alg, scope="chat admin", models=["llama-3-8b", "qwen2-7b"], tier="gold")
    assert await verifier.verify(token) == Principal(
        subject="alice",
        tenant="acme",
        scopes=frozenset({"chat", "admin"}),
        models=frozenset({"llama-3-8b", "qwen2-7b"}),
        tier="gold",
    )


async def test_scopes_from_list_and_absent_models_mean_every_model(verifier: JWTVerifier, keys: Keys) -> None:
    p = await verifier.verify(sign(keys, scope=["chat", "embed"]))
    assert p.scopes == frozenset({"chat", "embed"}) and p.has_scope("embed") and not p.has_scope("admin")
    assert p.models is None and p.may_use("anything") and p.tier is None


def test_verify_sync_and_models_gate(verifier: JWTVerifier, keys: Keys) -> None:
    p = verifier.verify_sync(sign(keys, "ec", "ES256", models="m1 m2"))
    assert p.may_use("m1") and not p.may_use("m3")


async def test_leeway_accepts_slightly_expired_and_slightly_early(verifier: JWTVerifier, keys: Keys) -> None:
    now = int(time.time())
    assert (await verifier.verify(sign(keys, exp=now - 10))).subject == "alice"
    assert (await verifier.verify(sign(keys, nbf=now + 10))).subject == "alice"


def tamper_signature(token: str) -> str:
    head, body, sig = token.split(".")
    raw = bytearray(unb64(sig))
    raw[0] ^= 0x01
    return f"{head}.{body}.{b64(bytes(raw))}"


def tamper_payload(token: str) -> str:
    head, body, sig = token.split(".")
    payload = json.loads(unb64(body)) | {"tenant": "evil"}
    return f"{head}.{b64(json.dumps(payload).encode())}.{sig}"


def alg_none(keys: Keys) -> str:
    header = b64(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    return f"{header}.{b64(json.dumps(claims()).encode())}."


def alg_confusion(keys: Keys) -> str:
    return hs256({"alg": "HS256", "kid": "rsa", "typ": "JWT"}, claims(), pem(keys))


def rs256_header_on_ec_key(keys: Keys) -> str:
    return sign(keys, kid="ec", alg="RS256", key_kid="rsa")


REFUSALS: list[tuple[str, Callable[[Keys], str], str]] = [
    ("expired", lambda k: sign(k, exp=int(time.time()) - 120), "expired"),
    ("nbf in future", lambda k: sign(k, nbf=int(time.time()) + 120), "not_yet_valid"),
    ("iat in future", lambda k: sign(k, iat=int(time.time()) + 120), "not_yet_valid"),
    ("wrong aud", lambda k: sign(k, aud="someone-else"), "bad_audience"),
    ("wrong iss", lambda k: sign(k, iss="https://evil.example"), "bad_issuer"),
    ("missing aud", lambda k: sign(k, aud=None), "missing_claim"),
    ("alg none", alg_none, "alg_not_allowed"),
    ("HS256 with RSA PEM as secret", alg_confusion, "alg_not_allowed"),
    ("alg outside allow-list", lambda k: sign(k, "rsa", "RS384"), "alg_not_allowed"),
    ("RS256 header naming the EC key", rs256_header_on_ec_key, "alg_not_allowed"),
    ("unknown kid", lambda k: sign(k, kid="nope", key_kid="ed"), "unknown_kid"),
    ("tampered signature", lambda k: tamper_signature(sign(k)), "bad_signature"),
    ("tampered payload", lambda k: tamper_payload(sign(k, "rsa", "RS256")), "bad_signature"),
    ("signed by a stranger", lambda k: sign(Keys(ed25519.Ed25519PrivateKey.generate(), k.ec, k.rsa)), "bad_signature"),
    ("oversized", lambda k: sign(k, pad="x" * 9000), "too_large"),
    ("missing exp", lambda k: sign(k, exp=None), "missing_claim"),
    ("missing sub", lambda k: sign(k, sub=None), "missing_claim"),
    ("missing tenant", lambda k: sign(k, tenant=None), "missing_claim"),
    ("scope not names", lambda k: sign(k, scope={"a": 1}), "invalid_claim"),
    ("empty", lambda k: "", "missing"),
    ("garbage", lambda k: "not-a-jwt", "malformed"),
    ("three garbage segments", lambda k: "a.b.c", "malformed"),
    ("non-ascii", lambda k: "é.é.é", "malformed"),
    ("header without alg", lambda k: f"{b64(b'{}')}.{b64(b'{}')}.", "malformed"),
    ("signed payload not json", lambda k: jwt.PyJWS().encode(b"nope", k.ed, "EdDSA", {"kid": "ed"}), "malformed"),
]


@pytest.mark.parametrize(("make", "reason"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
async def test_refusals(verifier: JWTVerifier, keys: Keys, make: Callable[[Keys], str], reason: str) -> None:
    token = make(keys)
    with pytest.raises(AuthError) as err:
        await verifier.verify(token)
    assert err.value.reason == reason
    if token:
        assert token not in str(err.value)


def sign_payload(keys: Keys, payload: dict[str, Any]) -> str:
    """Signed as raw JSON, so that PyJWT's encoder cannot refuse (or fix) a claim of the wrong type."""
    return jwt.PyJWS().encode(json.dumps(payload).encode(), keys.ed, "EdDSA", {"kid": "ed"})


WRONG_TYPES: list[tuple[str, Any]] = [
    ("number", 42),
    ("float", 1.5),
    ("list", ["alice"]),
    ("object", {"id": "alice"}),
    ("bool", True),
    ("null", None),
    ("huge", "x" * 2000),
]


@pytest.mark.parametrize("claim", ["sub", "tenant", "tier"])
@pytest.mark.parametrize(("kind", "value"), WRONG_TYPES, ids=[w[0] for w in WRONG_TYPES])
async def test_string_claims_of_the_wrong_type_are_refused(
    verifier: JWTVerifier, keys: Keys, claim: str, kind: str, value: Any
) -> None:
    with pytest.raises(AuthError) as err:
        await verifier.verify(sign_payload(keys, claims() | {claim: value}))
    assert err.value.reason in ("invalid_claim", "missing_claim")  # sub: null reads as absent (PyJWT's check)
    assert repr(claim) in str(err.value)


@pytest.mark.parametrize("claim", ["scope", "models"])
@pytest.mark.parametrize(
    ("kind", "value"),
    [
        *WRONG_TYPES[:2],
        ("object", {"a": 1}),
        ("bool", False),
        ("null", None),
        ("list of numbers", [1, 2]),
        ("huge name", ["x" * 2000]),
        ("too many names", [f"m{i}" for i in range(300)]),
    ],
)
async def test_name_claims_of_the_wrong_type_are_refused(
    verifier: JWTVerifier, keys: Keys, claim: str, kind: str, value: Any
) -> None:
    with pytest.raises(AuthError) as err:
        await verifier.verify(sign_payload(keys, claims() | {claim: value}))
    assert err.value.reason == "invalid_claim"
    assert repr(claim) in str(err.value)


async def test_claim_types_are_checked_without_pyjwt_help(verifier: JWTVerifier, keys: Keys) -> None:
    # PyJWT's own sub check is off: the message is ours, naming the claim and the type
    with pytest.raises(AuthError, match="'sub' must be a string, not a number") as err:
        await verifier.verify(sign_payload(keys, claims(sub=7)))
    assert err.value.reason == "invalid_claim"
    ok = await verifier.verify(sign_payload(keys, claims(models=["m"], tier="gold")))
    assert ok.models == frozenset({"m"}) and ok.tier == "gold"


async def test_default_tenant_fills_a_missing_tenant_claim(jwks_file: Path, keys: Keys) -> None:
    v = JWTVerifier(JWTConfig(jwks_file=jwks_file, issuer=ISS, audience=AUD, default_tenant="shared"))
    assert (await v.verify(sign(keys, tenant=None))).tenant == "shared"
    assert (await v.verify(sign(keys, tenant="acme"))).tenant == "acme"


async def test_custom_claim_names(jwks_file: Path, keys: Keys) -> None:
    cfg = JWTConfig(jwks_file=jwks_file, tenant_claim="org", scope_claim="scp", models_claim="mdl", tier_claim="plan")
    token = sign(keys, iss=None, aud=None, tenant=None, org="o1", scp=["a"], mdl=["m"], plan="free")
    assert await JWTVerifier(cfg).verify(token) == Principal("alice", "o1", frozenset({"a"}), frozenset({"m"}), "free")


async def test_token_without_kid_needs_exactly_one_key_of_its_type(tmp_path: Path, jwks_file: Path, keys: Keys) -> None:
    v = JWTVerifier(JWTConfig(jwks_file=jwks_file, issuer=ISS, audience=AUD))
    assert (await v.verify(sign(keys, kid=None, key_kid="ed"))).subject == "alice"
    two = tmp_path / "two-ed.json"
    other = ed25519.Ed25519PrivateKey.generate()
    two.write_text(json.dumps({"keys": [public_jwk(keys.ed, "ed"), public_jwk(other, "ed2")]}))
    with pytest.raises(AuthError) as err:
        await JWTVerifier(JWTConfig(jwks_file=two, issuer=ISS, audience=AUD)).verify(sign(keys, kid=None, key_kid="ed"))
    assert err.value.reason == "unknown_kid"


async def test_hs256_only_when_configured(jwks_file: Path, keys: Keys, verifier: JWTVerifier) -> None:
    token = hs256({"alg": "HS256", "typ": "JWT"}, claims(), HS_SECRET)
    with pytest.raises(AuthError) as err:
        await verifier.verify(token)
    assert err.value.reason == "alg_not_allowed"

    hs = JWTVerifier(JWTConfig(jwks_file=jwks_file, hs256_secret=HS_SECRET, issuer=ISS, audience=AUD))
    assert (await hs.verify(token)).tenant == "acme"
    only_hs = JWTVerifier(JWTConfig(hs256_secret=HS_SECRET, issuer=ISS, audience=AUD))
    assert only_hs.verify_sync(token).subject == "alice"

    cases = [
        (hs256({"alg": "HS256"}, claims(), b"t" * 32), "bad_signature"),
        (hs256({"alg": "HS256"}, claims(), pem(keys)), "bad_signature"),
        (hs256({"alg": "HS256", "kid": "rsa"}, claims(), HS_SECRET), "alg_not_allowed"),
        (hs256({"alg": "HS256", "kid": "rsa"}, claims(), pem(keys)), "alg_not_allowed"),
    ]
    for bad, reason in cases:
        with pytest.raises(AuthError) as err:
            await hs.verify(bad)
        assert err.value.reason == reason
    with pytest.raises(AuthError) as err:
        await only_hs.verify(sign(keys))
    assert err.value.reason == "unknown_kid"


def test_jwks_skips_weak_symmetric_and_encryption_keys(tmp_path: Path, keys: Keys) -> None:
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    path = tmp_path / "mixed.json"
    jwks = [
        public_jwk(weak, "weak"),
        {"kty": "oct", "k": b64(HS_SECRET), "kid": "oct"},
        {**public_jwk(keys.ec, "enc"), "use": "enc"},
        {**public_jwk(keys.rsa, "ps-only"), "alg": "PS256"},
    ]
    path.write_text(json.dumps({"keys": jwks}))
    cache = JWKSCache(path)
    loaded = cache.keys_sync()
    assert [(k.kid, k.algorithms) for k in loaded] == [("ps-only", frozenset({"PS256"}))]
    v = JWTVerifier(JWTConfig(jwks_file=path), jwks=cache)
    assert v.verify_sync(sign(keys, "ps-only", "PS256", key_kid="rsa", iss=None, aud=None)).subject == "alice"
    for kid, alg, key_kid in [("ps-only", "RS256", "rsa"), ("weak", "RS256", "rsa"), ("oct", "EdDSA", "ed")]:
        with pytest.raises(AuthError) as err:
            v.verify_sync(sign(keys, kid, alg, key_kid=key_kid, iss=None, aud=None))
        assert err.value.reason == ("alg_not_allowed" if kid == "ps-only" else "unknown_kid")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "key source"),
        ({"jwks_file": Path("j"), "jwks_url": "https://idp/jwks"}, "not both"),
        ({"jwks_file": Path("j"), "algorithms": ["RS256", "HS256"]}, "asymmetric"),
        ({"jwks_file": Path("j"), "algorithms": ["none"]}, "asymmetric"),
        ({"jwks_file": Path("j"), "algorithms": "RS256"}, "list"),
        ({"hs256_secret": b"short"}, "at least 32"),
        ({"jwks_url": "http://idp.example/jwks"}, "https"),
        ({"jwks_file": Path("j"), "leeway_s": 61}, "leeway"),
        ({"jwks_file": Path("j"), "max_token_bytes": 0}, "max_token_bytes"),
        ({"jwks_file": Path("j"), "max_claim_bytes": 0}, "max_claim_bytes"),
    ],
)
def test_config_rejects_unsafe_settings(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        JWTConfig(**kwargs)


def test_config_never_shows_the_secret() -> None:
    assert "ssss" not in repr(JWTConfig(hs256_secret=HS_SECRET))


# JWKS over HTTP


class JWKSServer(ThreadingHTTPServer):
    body: bytes = b""
    status: int = 200
    hits: int = 0


class Handler(BaseHTTPRequestHandler):
    server: JWKSServer

    def do_GET(self) -> None:
        self.server.hits += 1
        self.send_response(self.server.status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(self.server.body)))
        self.end_headers()
        self.wfile.write(self.server.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def idp() -> Iterator[JWKSServer]:
    server = JWKSServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def serve(idp: JWKSServer, *jwks: dict[str, Any]) -> None:
    idp.body = json.dumps({"keys": list(jwks)}).encode()


def url(idp: JWKSServer) -> str:
    return f"http://127.0.0.1:{idp.server_address[1]}/jwks.json"


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def test_jwks_url_rotation_refreshes_once_per_interval(idp: JWKSServer, keys: Keys) -> None:
    serve(idp, public_jwk(keys.ed, "ed"))
    clock = FakeClock()
    cache = JWKSCache(url(idp), min_refresh_interval_s=30, max_age_s=300, clock=clock)
    v = JWTVerifier(JWTConfig(jwks_url=url(idp), issuer=ISS, audience=AUD), jwks=cache)

    assert (await v.verify(sign(keys, "ed"))).subject == "alice"
    assert (await v.verify(sign(keys, "ed"))).subject == "alice"
    assert idp.hits == 1

    serve(idp, public_jwk(keys.ed, "ed"), public_jwk(keys.ec, "ec"))
    clock.t += 31
    assert (await v.verify(sign(keys, "ec", "ES256"))).subject == "alice"
    assert idp.hits == 2

    # spraying unknown kids inside the interval costs the IdP nothing
    for i in range(5):
        clock.t += 1
        with pytest.raises(AuthError) as err:
            await v.verify(sign(keys, f"random-{i}", key_kid="ed"))
        assert err.value.reason == "unknown_kid"
    assert idp.hits == 2

    # once the interval has passed, an unknown kid may refresh again, once
    serve(idp, public_jwk(keys.ec, "ec"), public_jwk(keys.rsa, "rsa"))
    clock.t += 30
    assert (await v.verify(sign(keys, "rsa", "PS256"))).subject == "alice"
    assert idp.hits == 3

    # a key the IdP dropped is refused once the set is refetched, at no extra fetch
    with pytest.raises(AuthError) as err:
        await v.verify(sign(keys, "ed"))
    assert err.value.reason == "unknown_kid"
    assert idp.hits == 3

    # a stale set is refetched even for a known kid
    serve(idp, public_jwk(keys.ec, "ec"))
    clock.t += 300
    with pytest.raises(AuthError) as err:
        await v.verify(sign(keys, "rsa", "RS256"))
    assert err.value.reason == "unknown_kid"
    assert idp.hits == 4


async def test_jwks_url_outage_keeps_cached_keys_and_does_not_hammer(idp: JWKSServer, keys: Keys) -> None:
    clock = FakeClock()
    cache = JWKSCache(url(idp), min_refresh_interval_s=30, max_age_s=60, clock=clock)
    v = JWTVerifier(JWTConfig(jwks_url=url(idp), issuer=ISS, audience=AUD), jwks=cache)
    idp.status, idp.body = 503, b"{}"
    for _ in range(3):
        with pytest.raises(JWKSError):
            await v.verify(sign(keys))
    assert idp.hits == 1

    idp.status = 200
    serve(idp, public_jwk(keys.ed, "ed"))
    clock.t += 30
    assert (await v.verify(sign(keys))).subject == "alice"
    assert idp.hits == 2

    idp.status = 500
    clock.t += 60
    assert (await v.verify(sign(keys))).subject == "alice"
    assert idp.hits == 3


def test_jwks_url_sync_path_built_from_config(idp: JWKSServer, keys: Keys) -> None:
    serve(idp, public_jwk(keys.rsa, "rsa"))
    v = JWTVerifier(JWTConfig(jwks_url=url(idp), issuer=ISS, audience=AUD))
    assert v.verify_sync(sign(keys, "rsa", "RS256")).tenant == "acme"
    with pytest.raises(AuthError):
        v.verify_sync(sign(keys, "unknown", key_kid="rsa", alg="RS256"))
    assert idp.hits == 1
