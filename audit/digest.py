"""SM3 digests and the canonical JSON encoding that the hash chain signs."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any


def _pick_sm3() -> Callable[[bytes], str]:
    if "sm3" in hashlib.algorithms_available:
        try:
            base = hashlib.new("sm3")
        except ValueError:  # listed but disabled (FIPS builds)
            pass
        else:

            def via_hashlib(data: bytes) -> str:
                h = base.copy()  # a copy skips OpenSSL's fetch of the algorithm by name: a third of a short hash
                h.update(data)
                return h.hexdigest()

            return via_hashlib
    try:
        from cryptography.hazmat.primitives import hashes

        def via_cryptography(data: bytes) -> str:
            h = hashes.Hash(hashes.SM3())
            h.update(data)
            return h.finalize().hex()

        via_cryptography(b"")
        return via_cryptography
    except Exception:  # cryptography built without SM3
        from gmssl import sm3  # type: ignore[import-untyped]

        return lambda data: str(sm3.sm3_hash(list(data)))


sm3_hex: Callable[[bytes], str] = _pick_sm3()


# one encoder for every call: json.dumps builds a new one per call when given options
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8, no NaN: the bytes the chain hashes (and the spool stores)."""
    return _CANONICAL.encode(obj).encode()


def sm3_text(text: str | bytes) -> str:
    return sm3_hex(text.encode() if isinstance(text, str) else text)
