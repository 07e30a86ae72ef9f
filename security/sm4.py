"""SM4-GCM on a buffer, in place, from the fastest library present: libgcrypt, else OpenSSL via `cryptography`.

Both release the GIL while they work, so callers run chunks on a thread pool. Both raise
`cryptography.exceptions.InvalidTag` on a failed tag, after which the buffer holds garbage.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Protocol

from cryptography.exceptions import InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from security.gcrypt import Gcrypt

KEY_SIZE = 16
NONCE_SIZE = 12
TAG_SIZE = 16
BACKENDS = ("gcrypt", "openssl")

__all__ = ["BACKENDS", "InvalidTag", "Sm4Gcm", "available_backends", "sm3", "sm4_gcm"]


class Sm4Gcm(Protocol):
    name: str

    def encrypt(self, key: bytes, nonce: bytes, aad: bytes, buf: memoryview) -> bytes: ...
    def decrypt(self, key: bytes, nonce: bytes, aad: bytes, buf: memoryview, tag: bytes) -> None: ...


class OpenSSLSm4Gcm:
    """`cryptography`'s SM4 + GCM (OpenSSL's generic C code, ~5x slower than libgcrypt's AVX2 path)."""

    name = "openssl"

    def encrypt(self, key: bytes, nonce: bytes, aad: bytes, buf: memoryview) -> bytes:
        enc = Cipher(algorithms.SM4(key), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(aad)
        # NOTE: out of place and copied back: cryptography 51 refuses update_into(buf, buf) ("data and buf must
        # not overlap"), which 46-50 took; the copy costs little beside this backend's own speed
        buf[:] = enc.update(buf)
        enc.finalize()
        return enc.tag

    def decrypt(self, key: bytes, nonce: bytes, aad: bytes, buf: memoryview, tag: bytes) -> None:
        if len(tag) != TAG_SIZE:  # GCM accepts short tags; we never write them
            raise InvalidTag
        dec = Cipher(algorithms.SM4(key), modes.GCM(nonce, tag)).decryptor()
        dec.authenticate_additional_data(aad)
        buf[:] = dec.update(buf)  # out of place, as encrypt's
        dec.finalize()


@functools.cache
def _openssl() -> OpenSSLSm4Gcm | None:
    try:
        OpenSSLSm4Gcm().encrypt(bytes(KEY_SIZE), bytes(NONCE_SIZE), b"", memoryview(bytearray(16)))
    except UnsupportedAlgorithm:
        return None
    return OpenSSLSm4Gcm()


def available_backends() -> list[str]:
    found = {"gcrypt": Gcrypt.load() is not None, "openssl": _openssl() is not None}
    return [name for name in BACKENDS if found[name]]


def sm4_gcm(backend: str | None = None) -> Sm4Gcm:
    """The named backend ("gcrypt" or "openssl"), or the fastest one present when None."""
    if backend not in (None, *BACKENDS):
        raise ValueError(f"unknown SM4 backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend in (None, "gcrypt"):
        lib = Gcrypt.load()
        if lib is not None:
            return lib
        if backend == "gcrypt":
            raise RuntimeError("libgcrypt >= 1.9 with SM4 is not installed (Debian: libgcrypt20)")
    ossl = _openssl()
    if ossl is None:
        raise RuntimeError("neither libgcrypt nor this OpenSSL build offers SM4")
    return ossl


class _Sm3(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


class _CryptographySm3:
    def __init__(self) -> None:
        self._h = hashes.Hash(hashes.SM3())

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.finalize().hex()


def sm3(data: bytes | bytearray | memoryview = b"") -> _Sm3:
    """An SM3 hasher; hashlib's (which releases the GIL) when Python's OpenSSL has SM3."""
    try:
        h: _Sm3 = hashlib.new("sm3")
    except ValueError:
        h = _CryptographySm3()
    if data:
        h.update(data)
    return h
