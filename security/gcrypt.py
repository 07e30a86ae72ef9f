"""SM4-GCM from the system libgcrypt (>= 1.9) through ctypes, in place.

ctypes releases the GIL for the call, so chunks decrypt in parallel on a thread pool.
Debian's libgcrypt 1.10 runs SM4 on AES-NI/AVX2 (~5x OpenSSL's generic C code).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from cryptography.exceptions import InvalidTag

SM4_NAME = b"SM4"
MODE_GCM = 9
MIN_VERSION = b"1.9.0"  # SM4 arrived in 1.9
TAG_SIZE = 16
GPG_ERR_CHECKSUM = 10
GCRYCTL_DISABLE_SECMEM = 37
GCRYCTL_INITIALIZATION_FINISHED = 38
GCRYCTL_INITIALIZATION_FINISHED_P = 39
LIBRARY_NAMES = ("libgcrypt.so.20", "gcrypt")

_lock = threading.Lock()
_loaded: dict[str, Gcrypt | None] = {}


class GcryptError(RuntimeError):
    """libgcrypt refused an operation for a reason other than a failed tag."""


class Gcrypt:
    """SM4-GCM on a loaded libgcrypt; `Gcrypt.load()` returns None when the library or SM4 is missing."""

    name = "gcrypt"

    def __init__(self, lib: ctypes.CDLL, algo: int, version: str) -> None:
        self._lib = lib
        self._algo = algo
        self.version = version

    @classmethod
    def load(cls) -> Gcrypt | None:
        with _lock:
            if "lib" not in _loaded:
                _loaded["lib"] = _open()
            return _loaded["lib"]

    def encrypt(self, key: bytes, nonce: bytes, aad: bytes, buf: memoryview) -> bytes:
        """Encrypts `buf` in place; returns the 16-byte tag."""
        handle = self._open(key, nonce, aad)
        try:
            self._check(self._lib.gcry_cipher_encrypt(handle, *_pointer(buf), None, 0), "encrypt")
            tag = ctypes.create_string_buffer(TAG_SIZE)
            self._check(self._lib.gcry_cipher_gettag(handle, tag, TAG_SIZE), "gettag")
            return tag.raw
        finally:
            self._lib.gcry_cipher_close(handle)

    def decrypt(self, key: bytes, nonce: bytes, aad: bytes, buf: memoryview, tag: bytes) -> None:
        """Decrypts `buf` in place; raises InvalidTag (and the caller must discard `buf`) on a bad tag."""
        handle = self._open(key, nonce, aad)
        try:
            self._check(self._lib.gcry_cipher_decrypt(handle, *_pointer(buf), None, 0), "decrypt")
            err = self._lib.gcry_cipher_checktag(handle, tag, len(tag)) if len(tag) == TAG_SIZE else GPG_ERR_CHECKSUM
            if err & 0xFFFF == GPG_ERR_CHECKSUM:
                raise InvalidTag
            self._check(err, "checktag")
        finally:
            self._lib.gcry_cipher_close(handle)

    def _open(self, key: bytes, nonce: bytes, aad: bytes) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        self._check(self._lib.gcry_cipher_open(ctypes.byref(handle), self._algo, MODE_GCM, 0), "open")
        try:
            self._check(self._lib.gcry_cipher_setkey(handle, key, len(key)), "setkey")
            self._check(self._lib.gcry_cipher_setiv(handle, nonce, len(nonce)), "setiv")
            self._check(self._lib.gcry_cipher_authenticate(handle, aad, len(aad)), "authenticate")
        except GcryptError:
            self._lib.gcry_cipher_close(handle)
            raise
        return handle

    def _check(self, err: int, what: str) -> None:
        if err:
            raise GcryptError(f"libgcrypt {what}: {self._lib.gcry_strerror(err).decode(errors='replace')}")


def _pointer(buf: memoryview) -> tuple[ctypes.Array[ctypes.c_char] | None, int]:
    if not len(buf):
        return None, 0
    return (ctypes.c_char * len(buf)).from_buffer(buf), len(buf)


def _open() -> Gcrypt | None:
    lib = None
    for name in LIBRARY_NAMES:
        path = name if name.startswith("lib") else ctypes.util.find_library(name)
        if path is None:
            continue
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError:
            continue
    if lib is None:
        return None
    lib.gcry_check_version.restype = ctypes.c_char_p
    lib.gcry_check_version.argtypes = [ctypes.c_char_p]
    lib.gcry_control.restype = ctypes.c_uint
    lib.gcry_strerror.restype = ctypes.c_char_p
    lib.gcry_strerror.argtypes = [ctypes.c_uint]
    lib.gcry_cipher_map_name.restype = ctypes.c_int
    lib.gcry_cipher_map_name.argtypes = [ctypes.c_char_p]
    lib.gcry_cipher_open.restype = ctypes.c_uint
    lib.gcry_cipher_open.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int, ctypes.c_uint]
    lib.gcry_cipher_close.restype = None
    lib.gcry_cipher_close.argtypes = [ctypes.c_void_p]
    for fn in ("gcry_cipher_setkey", "gcry_cipher_setiv", "gcry_cipher_authenticate"):
        getattr(lib, fn).restype = ctypes.c_uint
        getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    for fn in ("gcry_cipher_gettag", "gcry_cipher_checktag"):
        getattr(lib, fn).restype = ctypes.c_uint
        getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    for fn in ("gcry_cipher_encrypt", "gcry_cipher_decrypt"):
        getattr(lib, fn).restype = ctypes.c_uint
        getattr(lib, fn).argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_size_t,
        ]
    version = lib.gcry_check_version(MIN_VERSION)  # NOTE: must be the first call into libgcrypt
    if version is None:
        return None
    # Another library in the process (GnuTLS, say) may have initialised it already; if not, we do, without
    # secure memory: it only matters for keys swapped to disk, and its warnings would go to stderr.
    if not lib.gcry_control(ctypes.c_int(GCRYCTL_INITIALIZATION_FINISHED_P)):
        lib.gcry_control(ctypes.c_int(GCRYCTL_DISABLE_SECMEM), ctypes.c_int(0))
        lib.gcry_control(ctypes.c_int(GCRYCTL_INITIALIZATION_FINISHED), ctypes.c_int(0))
    algo = lib.gcry_cipher_map_name(SM4_NAME)
    if not algo:
        return None
    return Gcrypt(lib, algo, version.decode())
