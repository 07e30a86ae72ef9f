"""Key-encryption keys (KEKs) that wrap a sealed model's data key: `env`, `file`, or `pkcs11` (an HSM).

Every provider wraps with AES key wrap (RFC 3394), so a blob wrapped in software under a KEK
unwraps on an HSM holding the same KEK and back. Nothing here logs or formats key bytes or PINs.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap, aes_key_wrap

from security.sm4 import sm3

KEK_SIZE = 32
WRAP = "AES-KW"
SPEC_HELP = "file:PATH, env:VARIABLE or pkcs11:module=PATH;token=LABEL;key=LABEL;pin-file=PATH (or pin-env=VARIABLE)"


class KeyProviderError(Exception):
    """A key provider cannot be built, or cannot wrap or unwrap a data key."""


class KeyProvider(Protocol):
    """Wraps and unwraps a model's data key under a KEK it never reveals."""

    kind: str  # env | file | pkcs11: recorded in the manifest, for operators
    key_id: str  # names the KEK; a model opens only under the key id it was sealed with

    def wrap(self, dek: bytes) -> bytes: ...
    def unwrap(self, blob: bytes) -> bytes: ...


def kek_id(kek: bytes) -> str:
    """A fingerprint of a software KEK: the same key gets the same id from a file or a variable."""
    return "kek:" + sm3(b"tianmen kek id\x00" + kek).hexdigest()[:16]


class SoftwareKeyProvider:
    """A 256-bit KEK held in memory; AES-256 key wrap through `cryptography`."""

    kind = "software"

    def __init__(self, kek: bytes) -> None:
        if len(kek) != KEK_SIZE:
            raise KeyProviderError(f"a KEK must be {KEK_SIZE} bytes (AES-256); got {len(kek)}")
        self._kek = kek
        self.key_id = kek_id(kek)

    def wrap(self, dek: bytes) -> bytes:
        return aes_key_wrap(self._kek, dek)

    def unwrap(self, blob: bytes) -> bytes:
        try:
            return aes_key_unwrap(self._kek, blob)
        except (InvalidUnwrap, ValueError):
            raise KeyProviderError(f"the data key does not unwrap under {self.key_id}: wrong key, or edited") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key_id={self.key_id!r})"


class EnvKeyProvider(SoftwareKeyProvider):
    """A base64 KEK in an environment variable; the caller passes the environment (only settings read it)."""

    kind = "env"

    def __init__(self, variable: str, environ: Mapping[str, str]) -> None:
        value = environ.get(variable)
        if not value:
            raise KeyProviderError(f"environment variable {variable} is not set (it should hold a base64 KEK)")
        super().__init__(decode_kek(value, f"environment variable {variable}"))


class FileKeyProvider(SoftwareKeyProvider):
    """A base64 KEK in a file that only its owner may read (mode 0600 or 0400)."""

    kind = "file"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        super().__init__(decode_kek(read_secret_file(self.path, "key file").decode("ascii", "replace"), str(path)))


def decode_kek(text: str, where: str) -> bytes:
    try:
        kek = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        kek = b""
    if len(kek) != KEK_SIZE:
        raise KeyProviderError(
            f"{where} must hold a base64 {KEK_SIZE}-byte key (make one with `openssl rand -base64 32`)"
        )
    return kek


def read_secret_file(path: Path, what: str) -> bytes:
    """Reads a key or PIN file, refusing one that group or others may access (checked on the open file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise KeyProviderError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise KeyProviderError(f"cannot open {what} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyProviderError(f"{what} {path} is not a regular file")
        if st.st_mode & 0o077:
            mode = stat.S_IMODE(st.st_mode)
            raise KeyProviderError(
                f"{what} {path} is accessible to group or others (mode {mode:04o}): chmod 600 {path}"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def new_key_file(path: str | Path) -> FileKeyProvider:
    """Creates a fresh random KEK file with mode 0600; refuses to overwrite one."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyProviderError(f"key file {path} already exists; not overwriting a key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(base64.b64encode(os.urandom(KEK_SIZE)) + b"\n")
    return FileKeyProvider(path)


def provider_from_spec(spec: str, environ: Mapping[str, str] | None = None) -> KeyProvider:
    """`file:PATH`, `env:VAR` or `pkcs11:module=...;token=...;key=...;pin-file=...|pin-env=...`."""
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise KeyProviderError(f"bad key provider {spec.split(':')[0]!r}: use {SPEC_HELP}")
    if kind == "file":
        return FileKeyProvider(rest)
    if kind == "env":
        if environ is None:
            raise KeyProviderError("an env: key provider needs the environment passed in")
        return EnvKeyProvider(rest, environ)
    if kind == "pkcs11":
        from security.hsm import Pkcs11KeyProvider  # python-pkcs11 loads only when an HSM is configured

        return Pkcs11KeyProvider.from_spec(rest, environ or {})
    raise KeyProviderError(f"unknown key provider {kind!r}: use {SPEC_HELP}")


def spec_variables(spec: str) -> list[str]:
    """The environment variables a provider spec reads (`env:NAME`, a PKCS#11 `pin-env=NAME`), by the same split
    provider_from_spec and the PKCS#11 parser make; none for the other kinds."""
    kind, _, rest = spec.partition(":")
    if kind == "env":
        return [rest] if rest else []
    if kind == "pkcs11":
        return [v for name, _, v in (f.partition("=") for f in rest.split(";")) if name == "pin-env" and v]
    return []
