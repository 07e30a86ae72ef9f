"""SM4-GCM from libgcrypt (>= 1.9) through ctypes, in place.

ctypes releases the GIL for the call, so chunks decrypt in parallel on a thread pool.
Debian bookworm's libgcrypt 1.10 runs SM4 on AES-NI/AVX2 (~5x OpenSSL's generic C code); 1.11, which
`make gcrypt` builds into <venv>/opt/gcrypt (deploy/libgcrypt/build.sh), adds GFNI/AVX-512 (~2.8x again).

The first usable library wins, each loaded by absolute path (by soname only when no system copy is found in the
usual directories):
  1. $TIANMEN_LIBGCRYPT, a path to a libgcrypt.so. If it is unusable (missing, fails to load, older than 1.9,
     no SM4) a WARNING names it and the search goes on: the library only sets the speed, never the result.
  2. <sys.prefix>/opt/gcrypt/lib/libgcrypt.so.20, the bundled 1.11.
  3. The system's libgcrypt.so.20.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import sysconfig
import threading
from pathlib import Path

from cryptography.exceptions import InvalidTag

SM4_NAME = b"SM4"
MODE_GCM = 9
MIN_VERSION = b"1.9.0"  # SM4 arrived in 1.9
TAG_SIZE = 16
GPG_ERR_CHECKSUM = 10
GCRYCTL_DISABLE_SECMEM = 37
GCRYCTL_INITIALIZATION_FINISHED = 38
GCRYCTL_INITIALIZATION_FINISHED_P = 39
SONAME = "libgcrypt.so.20"
ENV_VAR = "TIANMEN_LIBGCRYPT"
BUNDLED = Path(sys.prefix) / "opt" / "gcrypt" / "lib" / SONAME

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, Gcrypt | None] = {}
_unusable: dict[str, str] = {}  # path -> why it was not loaded, for the warnings
_preloaded = False


class GcryptError(RuntimeError):
    """libgcrypt refused an operation for a reason other than a failed tag."""


class _Unusable(Exception):
    """This file is no libgcrypt >= 1.9 with SM4 that this process can load."""


class Gcrypt:
    """SM4-GCM on a loaded libgcrypt; `Gcrypt.load()` returns None when the library or SM4 is missing."""

    name = "gcrypt"

    def __init__(self, lib: ctypes.CDLL, algo: int, version: str, path: str) -> None:
        self._lib = lib
        self._algo = algo
        self.version = version
        self.path = path

    @classmethod
    def load(cls) -> Gcrypt | None:
        """The first usable library of the search order (module docstring), once per process."""
        with _lock:
            if "" not in _loaded:  # "" is no path: the key of the search's result
                _loaded[""] = _search()
            return _loaded[""]

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> Gcrypt | None:
        """The library at `path` (absolute), or None when it is missing or unusable; benchmarks compare them."""
        with _lock:
            return _open_cached(os.path.abspath(path))

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


def system_library() -> str | None:
    """Absolute path of the system's libgcrypt.so.20. Not by soname: once the bundled copy is loaded (same
    soname) dlopen("libgcrypt.so.20") would return that one again."""
    multiarch = sysconfig.get_config_var("MULTIARCH")
    dirs = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"] if multiarch else []
    dirs += ["/usr/lib64", "/lib64", "/usr/lib", "/lib", "/usr/local/lib"]
    return next((f"{d}/{SONAME}" for d in dirs if os.path.isfile(f"{d}/{SONAME}")), None)


def _search() -> Gcrypt | None:
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        lib = _open_cached(os.path.abspath(explicit))
        if lib is not None:
            return _chosen(lib, ENV_VAR)
        why = _unusable.get(os.path.abspath(explicit), "?")
        log.warning("%s=%s is not usable (%s): ignoring it, searching on", ENV_VAR, explicit, why)
    if BUNDLED.exists():  # its absence is normal (no compiler or no network at setup), not worth a warning
        lib = _open_cached(str(BUNDLED))
        if lib is not None:
            return _chosen(lib, "bundled")
        why = _unusable.get(str(BUNDLED), "?")
        log.warning("bundled %s is not usable (%s): using the system's, slower", BUNDLED, why)
    # last resort, as before this search existed: the dynamic loader's own lookup, for unusual layouts
    lib = _open_cached(system_library() or SONAME)
    return _chosen(lib, "system") if lib is not None else None


def _chosen(lib: Gcrypt, source: str) -> Gcrypt:
    log.info("SM4-GCM: libgcrypt %s from %s (%s)", lib.version, lib.path, source)
    return lib


def _preload_bundled_gpg_error() -> None:
    """The bundled libgcrypt 1.11 needs libgpg-error >= 1.49 (the system's is 1.46 on bookworm). The first
    libgpg-error.so.0 a process loads serves every later library asking for that soname, RUNPATH or not, so
    the bundled one goes first; the system's libgcrypt works with it as well (same ABI, newer)."""
    global _preloaded
    if _preloaded:
        return
    _preloaded = True
    path = BUNDLED.parent / "libgpg-error.so.0"
    if path.exists():
        try:
            ctypes.CDLL(str(path))
        except OSError as e:
            log.debug("cannot preload %s: %s", path, e)


def _open_cached(path: str) -> Gcrypt | None:
    _preload_bundled_gpg_error()
    if path not in _loaded:
        try:
            _loaded[path] = _open(path)
        except _Unusable as e:
            _loaded[path], _unusable[path] = None, str(e)
    return _loaded[path]


def _open(path: str) -> Gcrypt:
    if "/" in path and not os.path.isfile(path):
        raise _Unusable("no such file")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:  # e.g. it needs a newer libgpg-error than the one already loaded in this process
        raise _Unusable(str(e)) from e
    try:
        _declare(lib)
    except AttributeError as e:  # some other library named by TIANMEN_LIBGCRYPT
        raise _Unusable(f"not libgcrypt: {e}") from e
    version = lib.gcry_check_version(MIN_VERSION)  # NOTE: must be the first call into libgcrypt
    if version is None:
        raise _Unusable(f"older than {MIN_VERSION.decode()}")
    # Another library in the process (GnuTLS, say) may have initialised it already; if not, we do, without
    # secure memory: it only matters for keys swapped to disk, and its warnings would go to stderr.
    if not lib.gcry_control(ctypes.c_int(GCRYCTL_INITIALIZATION_FINISHED_P)):
        lib.gcry_control(ctypes.c_int(GCRYCTL_DISABLE_SECMEM), ctypes.c_int(0))
        lib.gcry_control(ctypes.c_int(GCRYCTL_INITIALIZATION_FINISHED), ctypes.c_int(0))
    algo = lib.gcry_cipher_map_name(SM4_NAME)
    if not algo:
        raise _Unusable("no SM4")
    return Gcrypt(lib, algo, version.decode(), path)


def _declare(lib: ctypes.CDLL) -> None:
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
