from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import jwt
from jwt import exceptions as jwt_errors

from security.jwks import JWKSCache, PublicKey, VerificationKey
from security.principal import Principal
from security.token_cache import DEFAULT_MAX_ENTRIES, VerifiedTokens

DEFAULT_ALGORITHMS = ("EdDSA", "ES256", "RS256", "PS256")
ASYMMETRIC_ALGORITHMS = frozenset(
    {"EdDSA", "ES256", "ES384", "ES512", "ES256K", "RS256", "RS384", "RS512", "PS256", "PS384", "PS512"}
)
MIN_HS256_SECRET_BYTES = 32

Reason = Literal[
    "missing",
    "malformed",
    "expired",
    "not_yet_valid",
    "bad_signature",
    "bad_audience",
    "bad_issuer",
    "unknown_kid",
    "alg_not_allowed",
    "too_large",
    "missing_claim",
    "invalid_claim",
]
_MESSAGES: dict[Reason, str] = {
    "missing": "no bearer token",
    "malformed": "token is not a well-formed JWT",
    "expired": "token has expired",
    "not_yet_valid": "token is not valid yet",
    "bad_signature": "token signature does not verify",
    "bad_audience": "token audience is not accepted",
    "bad_issuer": "token issuer is not accepted",
    "unknown_kid": "token signing key is not known",
    "alg_not_allowed": "token algorithm is not allowed",
    "too_large": "token is too large",
    "missing_claim": "token lacks a required claim",
    "invalid_claim": "a token claim has the wrong type or size",
}


class AuthError(Exception):
    """A token was refused. `reason` is a short machine string; the message never contains the token."""

    def __init__(self, reason: Reason, message: str | None = None) -> None:
        super().__init__(message or _MESSAGES[reason])
        self.reason: Reason = reason


class TokenVerifier(Protocol):
    async def verify(self, token: str) -> Principal: ...


def _loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(slots=True, frozen=True)
class JWTConfig:
    algorithms: Sequence[str] = DEFAULT_ALGORITHMS  # asymmetric allow-list; HS256 is enabled by hs256_secret alone
    jwks_file: Path | None = None
    jwks_url: str | None = None
    hs256_secret: bytes | None = field(default=None, repr=False)
    issuer: str | None = None
    audience: str | None = None
    leeway_s: int = 30
    max_token_bytes: int = 8192
    tenant_claim: str = "tenant"
    scope_claim: str = "scope"
    models_claim: str = "models"
    tier_claim: str = "tier"
    default_tenant: str | None = None  # None: a token without a tenant claim is refused
    max_claim_bytes: int = 256  # sub, tenant, tier and each scope/model name (UTF-8)
    max_claim_names: int = 256  # names in the scope or models claim
    min_refresh_interval_s: float = 30.0
    jwks_max_age_s: float = 300.0
    verified_cache_entries: int = DEFAULT_MAX_ENTRIES  # 0 verifies every request's signature again

    def __post_init__(self) -> None:
        if isinstance(self.algorithms, str):
            raise ValueError("JWTConfig.algorithms must be a list of names, not a string")
        object.__setattr__(self, "algorithms", tuple(self.algorithms))
        if self.jwks_file is None and self.jwks_url is None and self.hs256_secret is None:
            raise ValueError("JWTConfig needs a key source: jwks_file, jwks_url or hs256_secret")
        if self.jwks_file is not None and self.jwks_url is not None:
            raise ValueError("JWTConfig takes jwks_file or jwks_url, not both")
        if not self.algorithms:
            raise ValueError("JWTConfig.algorithms is empty")
        if bad := [a for a in self.algorithms if a not in ASYMMETRIC_ALGORITHMS]:
            raise ValueError(
                f"JWTConfig.algorithms may only name asymmetric algorithms, got {bad}; "
                "HS256 is enabled by setting hs256_secret, and 'none' never is"
            )
        if self.hs256_secret is not None and len(self.hs256_secret) < MIN_HS256_SECRET_BYTES:
            raise ValueError(f"JWTConfig.hs256_secret must be at least {MIN_HS256_SECRET_BYTES} bytes")
        if self.jwks_url is not None:
            url = urlsplit(self.jwks_url)
            if not (url.scheme == "https" or (url.scheme == "http" and _loopback(url.hostname))):
                raise ValueError("JWTConfig.jwks_url must be https:// (plain http only on loopback)")
        if not 0 <= self.leeway_s <= 60:
            raise ValueError("JWTConfig.leeway_s must be between 0 and 60 seconds")
        if not 0 < self.max_token_bytes <= 65536:
            raise ValueError("JWTConfig.max_token_bytes must be between 1 and 65536")
        if not all((self.tenant_claim, self.scope_claim, self.models_claim, self.tier_claim)):
            raise ValueError("JWTConfig claim names must be non-empty")
        if not (1 <= self.max_claim_bytes <= 4096 and 1 <= self.max_claim_names <= 4096):
            raise ValueError("JWTConfig.max_claim_bytes and max_claim_names must be between 1 and 4096")
        if self.default_tenant == "":
            raise ValueError("JWTConfig.default_tenant must be None or non-empty")
        if not 0 <= self.verified_cache_entries <= 1_000_000:
            raise ValueError("JWTConfig.verified_cache_entries must be between 0 and 1000000")
        if not (1.0 <= self.min_refresh_interval_s <= self.jwks_max_age_s):
            raise ValueError("JWTConfig needs 1 <= min_refresh_interval_s <= jwks_max_age_s")


def _select_key(alg: str, kid: str | None, keys: Sequence[VerificationKey]) -> PublicKey:
    if kid is not None:
        named = [k for k in keys if k.kid == kid]
        if not named:
            raise AuthError("unknown_kid")
        fitting = [k for k in named if alg in k.algorithms]
        if not fitting:
            raise AuthError("alg_not_allowed", "token algorithm does not match its key's type")
        return fitting[0].key
    fitting = [k for k in keys if alg in k.algorithms]
    if len(fitting) != 1:
        raise AuthError("unknown_kid", "token has no kid and the key set has no single key for its algorithm")
    return fitting[0].key


class JWTVerifier:
    """Verify bearer JWTs against an algorithm allow-list and a JWKS (or HS256 secret) → `Principal`.

    Raises `AuthError` for a refused token, `security.jwks.JWKSError` when keys cannot be loaded.
    """

    def __init__(self, config: JWTConfig, jwks: JWKSCache | None = None) -> None:
        self.config = config
        source: Path | str | None = config.jwks_file or config.jwks_url
        if jwks is None and source is not None:
            jwks = JWKSCache(
                source, min_refresh_interval_s=config.min_refresh_interval_s, max_age_s=config.jwks_max_age_s
            )
        self._jwks = jwks
        self._verified = VerifiedTokens(config.verified_cache_entries)
        self._allowed = frozenset(config.algorithms) | ({"HS256"} if config.hs256_secret else set())
        required = ["exp", "sub"] + (["iss"] if config.issuer else []) + (["aud"] if config.audience else [])
        # NOTE: claim types are checked in _principal, not by PyJWT: its checks differ between versions
        # (older ones accept a numeric sub), and its errors say nothing of the claim; jti is unused
        self._options: dict[str, Any] = {
            "require": required,
            "enforce_minimum_key_length": True,
            "verify_sub": False,
            "verify_jti": False,
        }

    async def verify(self, token: str) -> Principal:
        alg, kid = self._verified.header(token) or self._read_header(token)
        if alg == "HS256":
            return self._verify_hs256(token, kid, await self._jwks.keys() if self._jwks else ())
        if self._jwks is None:
            raise AuthError("unknown_kid")
        return self._decode(token, alg, kid, _select_key(alg, kid, await self._jwks.keys(kid)))

    def verify_sync(self, token: str) -> Principal:
        alg, kid = self._verified.header(token) or self._read_header(token)
        if alg == "HS256":
            return self._verify_hs256(token, kid, self._jwks.keys_sync() if self._jwks else ())
        if self._jwks is None:
            raise AuthError("unknown_kid")
        return self._decode(token, alg, kid, _select_key(alg, kid, self._jwks.keys_sync(kid)))

    def _read_header(self, token: str) -> tuple[str, str | None]:
        if not token:
            raise AuthError("missing")
        # size cap before any parsing
        if len(token) > self.config.max_token_bytes:
            raise AuthError("too_large")
        if not token.isascii():
            raise AuthError("malformed")
        try:
            header = jwt.get_unverified_header(token)
        except jwt_errors.PyJWTError:
            raise AuthError("malformed") from None
        alg, kid = header.get("alg"), header.get("kid")
        if not isinstance(alg, str) or not (kid is None or isinstance(kid, str)):
            raise AuthError("malformed")
        if alg not in self._allowed:
            raise AuthError("alg_not_allowed")
        return alg, kid

    def _verify_hs256(self, token: str, kid: str | None, keys: Sequence[VerificationKey]) -> Principal:
        assert self.config.hs256_secret is not None
        # NOTE: the HMAC key is only ever hs256_secret, never JWKS material; a kid naming an
        # asymmetric key is refused outright as a confusion attempt.
        if kid is not None and any(k.kid == kid for k in keys):
            raise AuthError("alg_not_allowed", "HS256 token names an asymmetric key")
        return self._decode(token, "HS256", kid, self.config.hs256_secret)

    def _decode(self, token: str, alg: str, kid: str | None, key: PublicKey | bytes) -> Principal:
        cfg = self.config
        if (cached := self._verified.get(token, key, cfg.leeway_s)) is not None:
            return cached
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[alg],
                audience=cfg.audience,
                issuer=cfg.issuer,
                leeway=cfg.leeway_s,
                options=self._options,  # type: ignore[arg-type]
            )
        except jwt_errors.ExpiredSignatureError:
            raise AuthError("expired") from None
        except jwt_errors.ImmatureSignatureError:
            raise AuthError("not_yet_valid") from None
        except jwt_errors.InvalidAudienceError:
            raise AuthError("bad_audience") from None
        except jwt_errors.InvalidIssuerError:
            raise AuthError("bad_issuer") from None
        except jwt_errors.InvalidSignatureError:
            raise AuthError("bad_signature") from None
        except jwt_errors.MissingRequiredClaimError as e:
            raise AuthError("missing_claim", f"token lacks required claim {e.claim!r}") from None
        except jwt_errors.InvalidAlgorithmError:
            raise AuthError("alg_not_allowed") from None
        except jwt_errors.PyJWTError:
            raise AuthError("malformed") from None
        principal = self._principal(claims)
        self._verified.put(token, key, principal, claims, (alg, kid))
        return principal

    def _principal(self, claims: dict[str, Any]) -> Principal:
        cfg = self.config
        subject = self._string(claims, "sub")
        tenant = self._string(claims, cfg.tenant_claim) if cfg.tenant_claim in claims else cfg.default_tenant
        tier = self._string(claims, cfg.tier_claim) if cfg.tier_claim in claims else None
        if not tenant:
            raise AuthError("missing_claim", f"token lacks required claim {cfg.tenant_claim!r}")
        return Principal(
            subject=subject,
            tenant=tenant,
            scopes=self._names(claims, cfg.scope_claim) or frozenset(),
            models=self._names(claims, cfg.models_claim),
            tier=tier,
        )

    def _string(self, claims: dict[str, Any], claim: str) -> str:
        """A present claim that must be a non-empty string of at most max_claim_bytes."""
        value = claims[claim]
        if not isinstance(value, str):
            raise AuthError("invalid_claim", f"token claim {claim!r} must be a string, not {_json_type(value)}")
        if not value:
            raise AuthError("missing_claim", f"token lacks required claim {claim!r}")
        if len(value.encode("utf-8", "surrogatepass")) > self.config.max_claim_bytes:
            raise AuthError(
                "invalid_claim", f"token claim {claim!r} is longer than {self.config.max_claim_bytes} bytes"
            )
        return value

    def _names(self, claims: dict[str, Any], claim: str) -> frozenset[str] | None:
        """A claim holding names: a space-separated string or a list of strings; None when absent."""
        if claim not in claims:
            return None
        value = claims[claim]
        if isinstance(value, str):
            names = value.split()
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            names = value
        else:
            raise AuthError("invalid_claim", f"token claim {claim!r} must be a string or a list of strings")
        limit = self.config.max_claim_bytes
        if len(names) > self.config.max_claim_names or any(
            len(n.encode("utf-8", "surrogatepass")) > limit for n in names
        ):
            raise AuthError("invalid_claim", f"token claim {claim!r} has too many or too long names")
        return frozenset(names)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
