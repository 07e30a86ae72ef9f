from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import httpx
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from jwt import PyJWK
from jwt.exceptions import PyJWTError

log = logging.getLogger(__name__)

PublicKey: TypeAlias = rsa.RSAPublicKey | ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | ed448.Ed448PublicKey

MAX_JWKS_BYTES = 1 << 20
MIN_RSA_BITS = 2048
RSA_ALGORITHMS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"})
EC_ALGORITHMS = {"secp256r1": "ES256", "secp384r1": "ES384", "secp521r1": "ES512", "secp256k1": "ES256K"}
_PRIVATE = (rsa.RSAPrivateKey, ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)


class JWKSError(Exception):
    """The key set could not be loaded: a server-side failure (503), not a bad token."""


@dataclass(slots=True, frozen=True)
class VerificationKey:
    kid: str | None
    algorithms: frozenset[str]  # header `alg` values this key may verify, fixed by its key type
    key: PublicKey


def _algorithms_for(key: PublicKey) -> frozenset[str]:
    if isinstance(key, rsa.RSAPublicKey):
        return RSA_ALGORITHMS if key.key_size >= MIN_RSA_BITS else frozenset()
    if isinstance(key, ec.EllipticCurvePublicKey):
        alg = EC_ALGORITHMS.get(key.curve.name)
        return frozenset({alg}) if alg else frozenset()
    return frozenset({"EdDSA"})


def _to_key(jwk: object) -> VerificationKey | None:
    if not isinstance(jwk, dict):
        return None
    kid = jwk.get("kid")
    kid = kid if isinstance(kid, str) else None
    if jwk.get("kty") == "oct" or jwk.get("use", "sig") != "sig":
        log.warning("JWKS: ignoring key kid=%r (symmetric or not for signatures)", kid)
        return None
    try:
        key: Any = PyJWK(jwk).key
    except (PyJWTError, ValueError, TypeError, KeyError):
        log.warning("JWKS: ignoring unusable key kid=%r", kid)
        return None
    if isinstance(key, _PRIVATE):
        log.warning("JWKS: key kid=%r carries private material; only its public half is used", kid)
        key = key.public_key()
    if not isinstance(key, PublicKey):
        return None
    algorithms = _algorithms_for(key)
    if isinstance(declared := jwk.get("alg"), str):
        algorithms &= {declared}
    if not algorithms:
        log.warning("JWKS: ignoring key kid=%r (weak, unsupported, or alg does not fit its type)", kid)
        return None
    return VerificationKey(kid, algorithms, key)


def parse_jwks(raw: bytes) -> tuple[VerificationKey, ...]:
    """Parse a JWKS document into public verification keys; unusable keys are skipped."""
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise JWKSError("JWKS is not valid JSON") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise JWKSError('JWKS must be an object with a "keys" list')
    keys = tuple(k for k in map(_to_key, doc["keys"]) if k is not None)
    if not keys:
        raise JWKSError("JWKS has no usable signing keys")
    return keys


class JWKSCache:
    """Public keys from a JWKS file or URL, cached; refetched when stale or on an unknown kid.

    Fetches (including failed ones) happen at most once per `min_refresh_interval_s`, so a
    client spraying random kids cannot make us hammer the IdP. A failed refresh keeps the
    previous keys. Use either the async or the sync API from one instance, not both at once.
    """

    def __init__(
        self,
        source: Path | str,
        *,
        min_refresh_interval_s: float = 30.0,
        max_age_s: float = 300.0,
        timeout_s: float = 5.0,
        verify: ssl.SSLContext | bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert min_refresh_interval_s > 0 and max_age_s >= min_refresh_interval_s and timeout_s > 0
        self.source = source
        self.min_refresh_interval_s = min_refresh_interval_s
        self.max_age_s = max_age_s
        self._timeout = timeout_s
        self._verify = verify
        self._clock = clock
        self._keys: tuple[VerificationKey, ...] = ()
        self._loaded_at: float | None = None
        self._attempted_at = -math.inf
        self._alock = asyncio.Lock()
        self._tlock = threading.Lock()

    async def keys(self, kid: str | None = None) -> tuple[VerificationKey, ...]:
        """Current keys; first load, stale cache, or a `kid` not in the set trigger a (rate-limited) fetch."""
        if self._needs_fetch(kid):
            async with self._alock:
                if self._needs_fetch(kid):
                    self._attempted_at = self._clock()
                    try:
                        self._store(parse_jwks(await self._fetch_async()))
                    except JWKSError as e:
                        self._failed(e)
        return self._current()

    def keys_sync(self, kid: str | None = None) -> tuple[VerificationKey, ...]:
        if self._needs_fetch(kid):
            with self._tlock:
                if self._needs_fetch(kid):
                    self._attempted_at = self._clock()
                    try:
                        self._store(parse_jwks(self._fetch_sync()))
                    except JWKSError as e:
                        self._failed(e)
        return self._current()

    def _needs_fetch(self, kid: str | None) -> bool:
        now = self._clock()
        if now - self._attempted_at < self.min_refresh_interval_s:
            return False
        if self._loaded_at is None or now - self._loaded_at >= self.max_age_s:
            return True
        return kid is not None and all(k.kid != kid for k in self._keys)

    def _store(self, keys: tuple[VerificationKey, ...]) -> None:
        self._keys, self._loaded_at = keys, self._clock()

    def _failed(self, e: JWKSError) -> None:
        if self._loaded_at is None:
            raise e
        log.warning("JWKS refresh from %s failed, keeping %d cached keys: %s", self.source, len(self._keys), e)

    def _current(self) -> tuple[VerificationKey, ...]:
        if self._loaded_at is None:
            raise JWKSError(f"JWKS from {self.source} not loaded; next attempt in <= {self.min_refresh_interval_s}s")
        return self._keys

    def _read_file(self, path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as e:
            raise JWKSError(f"cannot read JWKS file {path}: {e.strerror}") from e

    def _check(self, resp: httpx.Response) -> bytes:
        if resp.status_code != 200:
            raise JWKSError(f"JWKS fetch from {self.source} returned HTTP {resp.status_code}")
        if len(resp.content) > MAX_JWKS_BYTES:
            raise JWKSError(f"JWKS from {self.source} exceeds {MAX_JWKS_BYTES} bytes")
        return resp.content

    async def _fetch_async(self) -> bytes:
        if isinstance(self.source, Path):
            return self._read_file(self.source)
        try:
            async with httpx.AsyncClient(timeout=self._timeout, verify=self._verify) as client:
                return self._check(await client.get(self.source, headers={"accept": "application/json"}))
        except httpx.HTTPError as e:
            raise JWKSError(f"JWKS fetch from {self.source} failed: {type(e).__name__}") from e

    def _fetch_sync(self) -> bytes:
        if isinstance(self.source, Path):
            return self._read_file(self.source)
        try:
            with httpx.Client(timeout=self._timeout, verify=self._verify) as client:
                return self._check(client.get(self.source, headers={"accept": "application/json"}))
        except httpx.HTTPError as e:
            raise JWKSError(f"JWKS fetch from {self.source} failed: {type(e).__name__}") from e
