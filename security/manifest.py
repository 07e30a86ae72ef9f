"""`tianmen-seal.json` and the per-chunk nonce, associated data and file header of a sealed model.

The manifest is MACed (HMAC-SM3) under a key derived from the data key, so an edit to any field
fails before anything in it is trusted. Each `*.safetensors.sm4` file is a 32-byte header, then per
chunk the SM4-GCM ciphertext and its 16-byte tag. A chunk's nonce is (file id, index); its associated
data binds format version, file id, index, a last-chunk flag and the file name.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import struct
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, hmac
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from security.keys import WRAP
from security.sm4 import KEY_SIZE, TAG_SIZE

MANIFEST = "tianmen-seal.json"
SUFFIX = ".sm4"
FORMAT = "tianmen-seal"
VERSION = 1
CIPHER = "SM4-GCM"
FILE_ID_SIZE = 8
MIN_CHUNK = 1 << 10
MAX_CHUNK = 1 << 30
HEADER = struct.Struct(">8sHHI8sQ")  # magic, version, reserved, chunk size, file id, plaintext size
MAGIC = b"TMNSM4\r\n"
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_HEX16 = re.compile(r"[0-9a-f]{16}\Z")


class SealError(Exception):
    """A sealed model cannot be used: wrong key, damaged, edited, incomplete, or not sealed at all."""


@dataclass(frozen=True, slots=True)
class SealedFile:
    name: str  # the plain name the engine asks for: "model.safetensors"
    file_id: bytes
    size: int
    chunks: int
    sm3: str

    @property
    def sealed_name(self) -> str:
        return self.name + SUFFIX


@dataclass(frozen=True, slots=True)
class ClearFile:
    name: str
    size: int
    sm3: str


@dataclass(slots=True)
class Manifest:
    chunk_size: int
    provider: str
    key_id: str
    wrapped_key: bytes
    files: dict[str, SealedFile]
    clear: dict[str, ClearFile]
    mac: bytes = b""

    def body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "cipher": CIPHER,
            "chunk_size": self.chunk_size,
            "key": {"provider": self.provider, "id": self.key_id, "wrap": WRAP, "wrapped": _b64(self.wrapped_key)},
            "files": {
                f.name: {"id": f.file_id.hex(), "size": f.size, "chunks": f.chunks, "sm3": f.sm3}
                for f in self.files.values()
            },
            "clear": {f.name: {"size": f.size, "sm3": f.sm3} for f in self.clear.values()},
        }

    def sign(self, mac_key: bytes) -> None:
        self.mac = _hmac(mac_key, self.body()).finalize()

    def check(self, mac_key: bytes) -> None:
        try:
            _hmac(mac_key, self.body()).verify(self.mac)
        except InvalidSignature:
            raise SealError(f"{MANIFEST} fails its integrity check: it was edited") from None

    def dumps(self) -> bytes:
        return (json.dumps({**self.body(), "mac": self.mac.hex()}, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def loads(cls, data: bytes) -> Manifest:
        """Parses strictly: a field missing, extra or of the wrong type is an error, before any MAC check."""
        try:
            raw = json.loads(data)
            if raw.get("format") != FORMAT:
                raise SealError(f"{MANIFEST} is not a Tianmen seal manifest")
            if raw.get("version") != VERSION:
                raise SealError(f"{MANIFEST} has format version {raw.get('version')!r}; this Tianmen reads {VERSION}")
            key = raw["key"]
            m = cls(
                chunk_size=_int(raw["chunk_size"], MIN_CHUNK, MAX_CHUNK),
                provider=_str(key["provider"]),
                key_id=_str(key["id"]),
                wrapped_key=base64.b64decode(_str(key["wrapped"]), validate=True),
                files={_weight_name(n): _sealed(n, f) for n, f in raw["files"].items()},
                clear={
                    _clear_name(n): ClearFile(n, _int(f["size"]), _digest(f["sm3"])) for n, f in raw["clear"].items()
                },
                mac=bytes.fromhex(_hex(raw["mac"], _HEX64)),
            )
            if {**m.body(), "mac": m.mac.hex()} != raw:
                raise ValueError("unexpected or missing fields")
        except SealError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError, binascii.Error, RecursionError) as e:
            raise SealError(f"{MANIFEST} is malformed: {type(e).__name__} {e}") from None
        if not m.files:
            raise SealError(f"{MANIFEST} lists no sealed weight files")
        if len({f.file_id for f in m.files.values()}) != len(m.files):
            raise SealError(f"{MANIFEST} gives two files the same id")
        for f in m.files.values():
            if f.chunks != num_chunks(f.size, m.chunk_size):
                raise SealError(f"{MANIFEST} is inconsistent: {f.name} cannot have {f.chunks} chunks of its size")
        return m


def derive_keys(dek: bytes) -> tuple[bytes, bytes]:
    """The data key → (SM4 chunk key, manifest MAC key), so the one key never serves two algorithms."""
    okm = HKDFExpand(hashes.SM3(), KEY_SIZE + 32, b"tianmen-seal v1 keys").derive(dek)
    return okm[:KEY_SIZE], okm[KEY_SIZE:]


def num_chunks(size: int, chunk_size: int) -> int:
    return max(1, -(-size // chunk_size))  # an empty file still has one (empty, tagged, last) chunk


def sealed_size(f: SealedFile) -> int:
    return HEADER.size + f.size + f.chunks * TAG_SIZE


def header(f: SealedFile, chunk_size: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, chunk_size, f.file_id, f.size)


def nonce(f: SealedFile, index: int) -> bytes:
    return f.file_id + struct.pack(">I", index)


def aad(f: SealedFile, index: int) -> bytes:
    last = index == f.chunks - 1
    return FORMAT.encode() + struct.pack(">HIB", VERSION, index, last) + f.file_id + f.name.encode()


def _hmac(key: bytes, body: dict[str, Any]) -> hmac.HMAC:
    h = hmac.HMAC(key, hashes.SM3())
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())
    return h


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _sealed(name: str, f: dict[str, Any]) -> SealedFile:
    file_id = bytes.fromhex(_hex(f["id"], _HEX16))
    return SealedFile(name, file_id, _int(f["size"]), _int(f["chunks"], 1, 2**32), _digest(f["sm3"]))


def _int(value: object, low: int = 0, high: int = 2**63) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{value!r} is not an integer in [{low}, {high}]")
    return value


def _str(value: object) -> str:
    if type(value) is not str:
        raise TypeError(f"{value!r} is not a string")
    return value


def _hex(value: object, pattern: re.Pattern[str]) -> str:
    if not pattern.match(_str(value)):
        raise ValueError(f"{value!r} is not lowercase hex of the right length")
    return str(value)


def _digest(value: object) -> str:
    return _hex(value, _HEX64)


def _plain_name(name: str) -> str:
    if not name or name != name.strip() or "/" in name or "\\" in name or "\x00" in name or name.startswith("."):
        raise ValueError(f"{name!r} is not a plain file name")
    if name == MANIFEST or name.endswith(SUFFIX):
        raise ValueError(f"{name!r} cannot be a model file name")
    return name


def _clear_name(name: str) -> str:
    if _plain_name(name).endswith(".safetensors"):
        raise ValueError(f"{name!r} is a weight file listed as clear")
    return name


def _weight_name(name: str) -> str:
    if not _plain_name(name).endswith(".safetensors"):
        raise ValueError(f"{name!r} is not a *.safetensors name")
    return name
