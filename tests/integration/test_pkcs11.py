"""The pkcs11 key provider against a real SoftHSM2 token: seal, load, rewrap, and clear refusals."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from security.hsm import Pkcs11KeyProvider
from security.keys import KeyProviderError, SoftwareKeyProvider, new_key_file, provider_from_spec
from security.manifest import SealError
from security.seal import rewrap, seal
from security.sealed import SealedFiles, verify
from tests.softhsm import SoftHsm, softhsm_token

# RFC 3394 §4.3
KEK = bytes(range(32))
DEK = bytes.fromhex("00112233445566778899AABBCCDDEEFF")
WRAPPED = bytes.fromhex("64E8C3F9CE0F5BA263E9777905818A2A93C8191E7D6E8AE7")


@pytest.fixture(scope="module")
def hsm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SoftHsm]:
    with softhsm_token(tmp_path_factory.mktemp("softhsm")) as h:
        h.generate_kek("kek")
        h.generate_kek("kek2")
        h.generate_kek("loose", EXTRACTABLE=True, SENSITIVE=False)
        h.generate_kek("nowrap", WRAP=False, UNWRAP=False, DECRYPT=True)
        h.import_kek("known", KEK)
        yield h


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "clear").mkdir()
    save_file({"w": torch.randn(64, 64), "b": torch.arange(5)}, tmp_path / "clear" / "model.safetensors")
    (tmp_path / "clear" / "config.json").write_text("{}")
    return tmp_path / "clear"


def test_seal_and_load_under_an_hsm_kek(hsm: SoftHsm, model: Path, tmp_path: Path) -> None:
    provider = provider_from_spec(hsm.spec("kek"))
    assert isinstance(provider, Pkcs11KeyProvider) and provider.key_id == "pkcs11:kek"
    m = seal(model, tmp_path / "sealed", provider, chunk_size=4096)
    assert (m.provider, m.key_id) == ("pkcs11", "pkcs11:kek")
    again = provider_from_spec(f"pkcs11:module={hsm.module};token={hsm.token};key=kek;pin-env=PIN", {"PIN": hsm.pin})
    got = dict(SealedFiles(tmp_path / "sealed", again).tensors("model.safetensors"))
    want = load_file(model / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys()
    verify(tmp_path / "sealed", again)
    with pytest.raises(SealError, match="sealed under key pkcs11:kek; the key provider holds pkcs11:kek2"):
        SealedFiles(tmp_path / "sealed", provider_from_spec(hsm.spec("kek2")))


def test_the_token_wraps_exactly_as_software_does(hsm: SoftHsm) -> None:
    provider = provider_from_spec(hsm.spec("known"))
    assert provider.wrap(DEK) == WRAPPED == SoftwareKeyProvider(KEK).wrap(DEK)
    assert provider.unwrap(WRAPPED) == DEK
    other = provider_from_spec(hsm.spec("kek"))
    with pytest.raises(KeyProviderError, match="does not unwrap under pkcs11:kek on token 'tianmen-test'"):
        other.unwrap(WRAPPED)


def test_rewrap_between_a_key_file_and_the_hsm(hsm: SoftHsm, model: Path, tmp_path: Path) -> None:
    file_kek = new_key_file(tmp_path / "kek")
    seal(model, tmp_path / "sealed", file_kek)
    hsm_kek = provider_from_spec(hsm.spec("kek"))
    rewrap(tmp_path / "sealed", file_kek, hsm_kek)
    assert dict(SealedFiles(tmp_path / "sealed", hsm_kek).tensors("model.safetensors"))
    with pytest.raises(SealError, match="sealed under key pkcs11:kek"):
        SealedFiles(tmp_path / "sealed", file_kek)
    back = new_key_file(tmp_path / "kek-back")
    rewrap(tmp_path / "sealed", hsm_kek, back)
    verify(tmp_path / "sealed", back)


def test_wrong_pin(hsm: SoftHsm) -> None:
    with pytest.raises(KeyProviderError, match=r"the PIN for token 'tianmen-test' .* is wrong") as e:
        provider_from_spec(hsm.spec("kek", pin="999999"))
    assert "999999" not in str(e.value) and hsm.pin not in str(e.value)
    provider_from_spec(hsm.spec("kek"))  # a wrong PIN neither locks the token nor leaves a login behind


@pytest.mark.parametrize(
    ("key", "token", "message"),
    [
        ("missing", None, "no AES key labelled 'missing' on token 'tianmen-test'"),
        ("kek", "other-token", "no token 'other-token'"),
        ("loose", None, "key 'loose' on token 'tianmen-test' must be sensitive and non-extractable"),
        ("nowrap", None, "key 'nowrap' on token 'tianmen-test' lacks CKA_WRAP/CKA_UNWRAP"),
    ],
)
def test_refusals(hsm: SoftHsm, key: str, token: str | None, message: str) -> None:
    with pytest.raises(KeyProviderError, match=message):
        provider_from_spec(hsm.spec(key, token=token))


def test_repr_hides_the_pin(hsm: SoftHsm) -> None:
    provider = provider_from_spec(hsm.spec("kek"))
    assert hsm.pin not in repr(provider) and "kek" in repr(provider)


def test_unwraps_in_a_forked_child(hsm: SoftHsm) -> None:
    provider = provider_from_spec(hsm.spec("kek"))
    blob = provider.wrap(DEK)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.write(write, provider.unwrap(blob))
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 64)
    os.close(read)
    os.waitpid(pid, 0)
    assert got == DEK
    assert provider.unwrap(blob) == DEK  # and the parent's library still works
