"""Which libgcrypt security.gcrypt loads, and that the bundled 1.11 (`make gcrypt`) agrees with OpenSSL."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from security import gcrypt
from security.gcrypt import BUNDLED, ENV_VAR, Gcrypt


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gcrypt.load() searches again (its result is cached per process) with no TIANMEN_LIBGCRYPT."""
    monkeypatch.setattr(gcrypt, "_loaded", {})
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture
def bundled() -> Path:
    if not BUNDLED.exists():
        why = f"no bundled libgcrypt at {BUNDLED}: `make gcrypt` (gcc, make, bzip2, network) did not run or failed"
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI is set, so this must not be skipped: {why}")  # CI would hide a 4x slowdown
        pytest.skip(why)
    return BUNDLED


def _version(lib: Gcrypt) -> tuple[int, ...]:
    return tuple(int(part) for part in lib.version.split("-")[0].split(".")[:2])


def _reference(key: bytes, nonce: bytes, aad: bytes, data: bytes) -> tuple[bytes, bytes]:
    enc = Cipher(algorithms.SM4(key), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(aad)
    return enc.update(data) + enc.finalize(), enc.tag


@pytest.mark.usefixtures("fresh")
def test_load_picks_the_bundled_library_and_logs_it_once(bundled: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="security.gcrypt")
    lib = Gcrypt.load()
    assert lib is not None
    assert lib.path == str(bundled)
    assert _version(lib) >= (1, 11)
    assert Gcrypt.load() is lib
    assert [r.getMessage() for r in caplog.records] == [f"SM4-GCM: libgcrypt {lib.version} from {bundled} (bundled)"]


@pytest.mark.parametrize("size", [1, 15, 16, 17, 4095, 1_048_577, 3 * 1024 * 1024 + 5])
def test_bundled_matches_cryptography_and_rejects_a_flipped_byte(bundled: Path, size: int) -> None:
    lib = Gcrypt.from_path(bundled)
    assert lib is not None
    key, nonce, aad, data = os.urandom(16), os.urandom(12), os.urandom(20), os.urandom(size)
    want_ct, want_tag = _reference(key, nonce, aad, data)
    buf = bytearray(data)
    assert lib.encrypt(key, nonce, aad, memoryview(buf)) == want_tag
    assert buf == want_ct
    lib.decrypt(key, nonce, aad, memoryview(buf), want_tag)
    assert buf == data
    bad = bytearray(want_ct)
    bad[size // 2] ^= 0x01
    with pytest.raises(InvalidTag):
        lib.decrypt(key, nonce, aad, memoryview(bad), want_tag)


@pytest.mark.usefixtures("fresh")
def test_env_var_naming_a_missing_file_warns_and_falls_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "nope" / "libgcrypt.so.20"
    monkeypatch.setenv(ENV_VAR, str(missing))
    lib = Gcrypt.load()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{ENV_VAR}={missing} is not usable (no such file): ignoring it, searching on"]
    assert lib is not None  # the next in line: the bundled copy if built, else the system's
    assert lib.path == (str(BUNDLED) if BUNDLED.exists() else gcrypt.system_library())


@pytest.mark.usefixtures("fresh")
def test_env_var_naming_something_else_warns_and_falls_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = tmp_path / "libgcrypt.so.20"
    fake.write_bytes(b"not an ELF file")
    monkeypatch.setenv(ENV_VAR, str(fake))
    assert Gcrypt.load() is not None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"{ENV_VAR}={fake} is not usable (")


@pytest.mark.usefixtures("fresh")
def test_env_var_wins_over_the_bundled_library(monkeypatch: pytest.MonkeyPatch) -> None:
    system = gcrypt.system_library()
    assert system is not None, "libgcrypt20 is part of the base image"
    monkeypatch.setenv(ENV_VAR, system)
    lib = Gcrypt.load()
    assert lib is not None
    assert lib.path == system
    assert _version(lib) >= (1, 9)
