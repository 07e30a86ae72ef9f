"""SM2 signatures (SM3 digest, default user id) for chain checkpoints, via gmssl."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from gmssl import sm2  # type: ignore[import-untyped]

from audit.digest import sm3_hex

_N = int(sm2.default_ecc_table["n"], 16)
_G = sm2.default_ecc_table["g"]


class Sm2Signer:
    """Signs checkpoint messages. Keys are hex: private `d` (64 chars), public `x||y` (128 chars)."""

    def __init__(self, private_key_hex: str) -> None:
        d = int(private_key_hex.strip(), 16)
        assert 1 <= d < _N - 1, "SM2 private key out of range"
        self.public_key = public_key_of(private_key_hex)
        self.key_id = key_id(self.public_key)
        self._sm2 = _crypt(f"{d:064x}", self.public_key)

    @classmethod
    def from_file(cls, path: Path) -> Sm2Signer:
        return cls(Path(path).read_text().strip())

    def sign(self, message: bytes) -> str:
        while True:
            # NOTE: gmssl's default nonce comes from `random.choice`; a predictable k leaks the key.
            k = f"{secrets.randbelow(_N - 1) + 1:064x}"
            sig = self._sm2.sign_with_sm3(message, k)
            if sig:
                return str(sig)


class Sm2Verifier:
    def __init__(self, public_key_hex: str) -> None:
        pub = public_key_hex.strip().lower()
        pub = pub[2:] if len(pub) == 130 and pub.startswith("04") else pub
        assert len(pub) == 128, "SM2 public key: 128 hex chars (x||y)"
        self.public_key = pub
        self.key_id = key_id(pub)
        self._sm2 = _crypt("", pub)

    @classmethod
    def from_file(cls, path: Path) -> Sm2Verifier:
        return cls(Path(path).read_text())

    def verify(self, message: bytes, signature: str) -> bool:
        try:
            r, s = int(signature[:64], 16), int(signature[64:], 16)
        except (TypeError, ValueError):
            return False
        if len(signature) != 128 or not (0 < r < _N and 0 < s < _N):
            return False
        return bool(self._sm2.verify_with_sm3(signature, message))


def _crypt(private_key: str, public_key: str) -> sm2.CryptSM2:
    c = sm2.CryptSM2(private_key=private_key, public_key="")
    # NOTE: CryptSM2 strips a "04" prefix with lstrip("04"), which also eats a leading 0 or 4 of x.
    c.public_key = public_key
    return c


def public_key_of(private_key_hex: str) -> str:
    d = int(private_key_hex.strip(), 16)
    return str(sm2.CryptSM2(private_key="", public_key="")._kg(d, _G))


def key_id(public_key_hex: str) -> str:
    return sm3_hex(bytes.fromhex(public_key_hex))[:16]


def generate_keypair(private_path: Path, public_path: Path) -> str:
    """Writes a new SM2 key pair (private file mode 0600); returns the public key hex. Dev use."""
    d = f"{secrets.randbelow(_N - 2) + 1:064x}"
    private_path, public_path = Path(private_path), Path(public_path)
    private_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(d + "\n")
    public = public_key_of(d)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    public_path.write_text(public + "\n")
    return public
