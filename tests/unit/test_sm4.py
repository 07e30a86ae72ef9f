from __future__ import annotations

import hashlib
import os

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from security.gcrypt import Gcrypt
from security.sm4 import Sm4Gcm, _CryptographySm3, available_backends, sm3, sm4_gcm

BACKENDS = available_backends()

# RFC 8998, appendix A.1: SM4-GCM
KEY = bytes.fromhex("0123456789ABCDEFFEDCBA9876543210")
IV = bytes.fromhex("00001234567800000000ABCD")
AAD = bytes.fromhex("FEEDFACEDEADBEEFFEEDFACEDEADBEEFABADDAD2")
PLAIN = bytes.fromhex("".join(c * 16 for c in "ABCDEFEA"))
CIPHER = bytes.fromhex(
    "17F399F08C67D5EE19D0DC9969C4BB7D5FD46FD3756489069157B282BB200735"
    "D82710CA5C22F0CCFA7CBF93D496AC15A56834CBCF98C397B4024A2691233B8D"
)
TAG = bytes.fromhex("83DE3541E4C2B58177E065A9BF7B62EC")


def test_both_backends_are_present_here() -> None:
    # libgcrypt20 is part of the base image; without it every load runs ~5x slower
    assert BACKENDS == ["gcrypt", "openssl"]
    assert isinstance(sm4_gcm(), Gcrypt)


@pytest.mark.parametrize("name", BACKENDS)
def test_rfc8998_vector(name: str) -> None:
    cipher = sm4_gcm(name)
    buf = bytearray(PLAIN)
    assert cipher.encrypt(KEY, IV, AAD, memoryview(buf)) == TAG
    assert bytes(buf) == CIPHER
    cipher.decrypt(KEY, IV, AAD, memoryview(buf), TAG)
    assert bytes(buf) == PLAIN


def _reference(key: bytes, nonce: bytes, aad: bytes, data: bytes) -> tuple[bytes, bytes]:
    enc = Cipher(algorithms.SM4(key), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(aad)
    return enc.update(data) + enc.finalize(), enc.tag


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 4096, 100_003])
def test_backends_match_cryptography_and_interoperate(size: int) -> None:
    key, nonce, aad, data = os.urandom(16), os.urandom(12), os.urandom(33), os.urandom(size)
    want_ct, want_tag = _reference(key, nonce, aad, data)
    sealed: dict[str, tuple[bytes, bytes]] = {}
    for name in BACKENDS:
        buf = bytearray(data)
        tag = sm4_gcm(name).encrypt(key, nonce, aad, memoryview(buf))
        assert (bytes(buf), tag) == (want_ct, want_tag), name
        sealed[name] = (bytes(buf), tag)
    for enc in BACKENDS:
        for dec in BACKENDS:
            ct, tag = sealed[enc]
            buf = bytearray(ct)
            sm4_gcm(dec).decrypt(key, nonce, aad, memoryview(buf), tag)
            assert bytes(buf) == data, (enc, dec)


def _sealed(cipher: Sm4Gcm) -> tuple[bytes, bytes, bytes, bytes, bytes]:
    key, nonce, aad = os.urandom(16), os.urandom(12), b"file 0"
    buf = bytearray(os.urandom(1000))
    tag = cipher.encrypt(key, nonce, aad, memoryview(buf))
    return key, nonce, aad, bytes(buf), tag


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("damage", ["ciphertext", "tag", "short tag", "aad", "nonce", "key"])
def test_any_change_fails_the_tag(name: str, damage: str) -> None:
    cipher = sm4_gcm(name)
    key, nonce, aad, ct, tag = _sealed(cipher)
    buf = bytearray(ct)
    if damage == "ciphertext":
        buf[500] ^= 1
    elif damage == "tag":
        tag = bytes([tag[0] ^ 0x80]) + tag[1:]
    elif damage == "short tag":
        tag = tag[:12]
    elif damage == "aad":
        aad = b"file 1"
    elif damage == "nonce":
        nonce = nonce[:-1] + bytes([nonce[-1] ^ 1])
    else:
        key = os.urandom(16)
    with pytest.raises(InvalidTag):
        cipher.decrypt(key, nonce, aad, memoryview(buf), tag)


def test_decrypts_a_slice_in_place_without_touching_its_neighbours() -> None:
    key, nonce = os.urandom(16), os.urandom(12)
    for name in BACKENDS:
        buf = bytearray(b"\xaa" * 10 + os.urandom(100) + b"\xbb" * 10)
        plain = bytes(buf[10:110])
        view = memoryview(buf)[10:110]
        tag = sm4_gcm(name).encrypt(key, nonce, b"", view)
        assert bytes(buf[10:110]) != plain
        sm4_gcm(name).decrypt(key, nonce, b"", view, tag)
        assert buf == b"\xaa" * 10 + plain + b"\xbb" * 10


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown SM4 backend"):
        sm4_gcm("gmssl")


def test_sm3_vector_and_fallback_agree() -> None:
    abc = "66c7f0f462eeedd9d1f2d46bdc10e4e24167c4875cf2f7a2297da02b8f4ba8e0"  # GB/T 32905 example 1
    assert sm3(b"abc").hexdigest() == abc
    fallback = _CryptographySm3()
    fallback.update(b"a")
    fallback.update(memoryview(b"bc"))
    assert fallback.hexdigest() == abc
    data = os.urandom(70_000)
    assert sm3(data).hexdigest() == hashlib.new("sm3", data).hexdigest() != abc
