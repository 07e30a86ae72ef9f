from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest

from security.keys import (
    EnvKeyProvider,
    FileKeyProvider,
    KeyProviderError,
    SoftwareKeyProvider,
    new_key_file,
    provider_from_spec,
)

# RFC 3394 §4.3: wrap 128 bits of key data with a 256-bit KEK
KEK = bytes(range(32))
DEK = bytes.fromhex("00112233445566778899AABBCCDDEEFF")
WRAPPED = bytes.fromhex("64E8C3F9CE0F5BA263E9777905818A2A93C8191E7D6E8AE7")


def key_file(path: Path, kek: bytes = KEK, mode: int = 0o600) -> Path:
    path.write_bytes(base64.b64encode(kek) + b"\n")
    path.chmod(mode)
    return path


def test_software_wrap_is_rfc3394() -> None:
    p = SoftwareKeyProvider(KEK)
    assert p.wrap(DEK) == WRAPPED
    assert p.unwrap(WRAPPED) == DEK


def test_unwrap_under_another_key_fails() -> None:
    blob = SoftwareKeyProvider(KEK).wrap(DEK)
    other = SoftwareKeyProvider(os.urandom(32))
    with pytest.raises(KeyProviderError, match=f"does not unwrap under {other.key_id}"):
        other.unwrap(blob)
    with pytest.raises(KeyProviderError):
        SoftwareKeyProvider(KEK).unwrap(blob[:-1] + bytes([blob[-1] ^ 1]))


def test_file_provider(tmp_path: Path) -> None:
    p = FileKeyProvider(key_file(tmp_path / "kek"))
    assert p.kind == "file"
    assert p.unwrap(p.wrap(DEK)) == DEK
    assert p.wrap(DEK) == WRAPPED
    FileKeyProvider(key_file(tmp_path / "ro", mode=0o400))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o601])
def test_file_provider_refuses_a_key_others_can_reach(tmp_path: Path, mode: int) -> None:
    path = key_file(tmp_path / "kek", mode=mode)
    with pytest.raises(KeyProviderError, match=f"mode {mode:04o}.*chmod 600 {path}"):
        FileKeyProvider(path)


def test_file_provider_errors(tmp_path: Path) -> None:
    with pytest.raises(KeyProviderError, match="does not exist"):
        FileKeyProvider(tmp_path / "absent")
    with pytest.raises(KeyProviderError, match="base64 32-byte key"):
        FileKeyProvider(key_file(tmp_path / "short", kek=os.urandom(16)))
    bad = tmp_path / "text"
    bad.write_text("not base64 at all!\n")
    bad.chmod(0o600)
    with pytest.raises(KeyProviderError, match="openssl rand -base64 32"):
        FileKeyProvider(bad)
    with pytest.raises(KeyProviderError, match="not a regular file"):
        FileKeyProvider(tmp_path)


def test_file_provider_checks_the_file_a_link_points_to(tmp_path: Path) -> None:
    link = tmp_path / "link"  # Kubernetes mounts secrets as links
    link.symlink_to(key_file(tmp_path / "kek"))
    assert FileKeyProvider(link).wrap(DEK) == WRAPPED
    (tmp_path / "kek").chmod(0o644)
    with pytest.raises(KeyProviderError, match="mode 0644"):
        FileKeyProvider(link)


def test_env_provider_reads_only_the_mapping_it_is_given() -> None:
    env = {"TIANMEN_KEK": base64.b64encode(KEK).decode()}
    p = EnvKeyProvider("TIANMEN_KEK", env)
    assert (p.kind, p.wrap(DEK)) == ("env", WRAPPED)
    with pytest.raises(KeyProviderError, match="TIANMEN_OTHER is not set"):
        EnvKeyProvider("TIANMEN_OTHER", env)
    with pytest.raises(KeyProviderError, match="base64 32-byte key"):
        EnvKeyProvider("X", {"X": base64.b64encode(os.urandom(31)).decode()})


def test_one_key_has_one_id_wherever_it_lives(tmp_path: Path) -> None:
    from_file = FileKeyProvider(key_file(tmp_path / "kek"))
    from_env = EnvKeyProvider("K", {"K": base64.b64encode(KEK).decode()})
    assert from_file.key_id == from_env.key_id == SoftwareKeyProvider(KEK).key_id
    assert from_file.key_id.startswith("kek:")
    assert SoftwareKeyProvider(os.urandom(32)).key_id != from_file.key_id


def test_repr_shows_no_key_material(tmp_path: Path) -> None:
    p = FileKeyProvider(key_file(tmp_path / "kek"))
    text = repr(p) + str(p)
    assert p.key_id in text
    assert base64.b64encode(KEK).decode() not in text
    assert KEK.hex() not in text


def test_new_key_file(tmp_path: Path) -> None:
    p = new_key_file(tmp_path / "kek")
    assert stat.S_IMODE((tmp_path / "kek").stat().st_mode) == 0o600
    assert p.unwrap(p.wrap(DEK)) == DEK
    assert new_key_file(tmp_path / "kek2").key_id != p.key_id
    with pytest.raises(KeyProviderError, match="already exists"):
        new_key_file(tmp_path / "kek")
    assert FileKeyProvider(tmp_path / "kek").key_id == p.key_id


def test_provider_from_spec(tmp_path: Path) -> None:
    path = key_file(tmp_path / "kek")
    assert isinstance(provider_from_spec(f"file:{path}"), FileKeyProvider)
    env = {"K": base64.b64encode(KEK).decode()}
    p = provider_from_spec("env:K", environ=env)
    assert isinstance(p, EnvKeyProvider)
    assert p.key_id == SoftwareKeyProvider(KEK).key_id


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("vault:secret/kek", "unknown key provider 'vault'"),
        ("file", "bad key provider"),
        ("env:", "bad key provider"),
        ("env:K", "needs the environment"),
        ("pkcs11:token=L;key=k;pin-env=P", "needs module"),
        ("pkcs11:module=/x.so;token=L;key=k", "exactly one of pin-file, pin-env"),
        ("pkcs11:module=/x.so;token=L;key=k;pin-env=P;pin-file=/p", "exactly one of pin-file, pin-env"),
        ("pkcs11:module=/x.so;token=L;label=k;pin-env=P", "bad pkcs11 key provider field 'label'"),
        ("pkcs11:module=/x.so;token=L;token=M;key=k;pin-env=P", "bad pkcs11 key provider field 'token'"),
        ("pkcs11:module=/x.so;token=L;key=k;pin-env=P", "PIN for token 'L' is empty"),
        ("pkcs11:module=/nonexistent.so;token=L;key=k;pin-env=Q", "cannot load PKCS#11 module /nonexistent.so"),
    ],
)
def test_bad_specs(spec: str, message: str) -> None:
    environ = None if spec == "env:K" else {"Q": "1234"}
    with pytest.raises(KeyProviderError, match=message):
        provider_from_spec(spec, environ=environ)


def test_pkcs11_pin_file_must_be_private(tmp_path: Path) -> None:
    pin = tmp_path / "pin"
    pin.write_text("123456\n")
    pin.chmod(0o644)
    with pytest.raises(KeyProviderError, match=r"PIN file .* chmod 600"):
        provider_from_spec(f"pkcs11:module=/x.so;token=L;key=k;pin-file={pin}")


def test_spec_variables_are_what_the_spec_reads() -> None:
    from security.keys import spec_variables

    assert spec_variables("env:TIANMEN_KEK") == ["TIANMEN_KEK"]
    assert spec_variables("pkcs11:module=/m.so;token=t;key=k;pin-env=HSM_PIN") == ["HSM_PIN"]
    assert spec_variables("pkcs11:module=/m.so;token=t;key=k;pin-file=/run/pin") == []
    assert spec_variables("file:/etc/kek") == []
