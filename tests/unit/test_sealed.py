from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from security.keys import FileKeyProvider, KeyProvider, KeyProviderError, new_key_file
from security.manifest import HEADER, MANIFEST, SealError
from security.seal import rewrap, seal
from security.sealed import SealedFiles, verify
from security.sm4 import TAG_SIZE, available_backends

CHUNK = 1024
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
CLEAR = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "tokenizer.json": b'{"model": {"vocab": {"a": 0}}}',
    "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
    "generation_config.json": b'{"eos_token_id": 2}',
}


def make_model(path: Path) -> Path:
    path.mkdir()
    g = torch.Generator().manual_seed(0)
    for i, name in enumerate(SHARDS):
        # equal-sized shards, so a chunk from one fits exactly in the other
        save_file({f"layers.{i}.w": torch.randn(40, 50, generator=g), f"layers.{i}.b": torch.arange(7)}, path / name)
    index = {"weight_map": {f"layers.{i}.{k}": n for i, n in enumerate(SHARDS) for k in "wb"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    for name, data in CLEAR.items():
        (path / name).write_bytes(data)
    return path


@pytest.fixture
def kek(tmp_path: Path) -> FileKeyProvider:
    return new_key_file(tmp_path / "kek")


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_model(tmp_path / "clear")


@pytest.fixture
def sealed(tmp_path: Path, src: Path, kek: FileKeyProvider) -> Path:
    seal(src, tmp_path / "sealed", kek, chunk_size=CHUNK)
    return tmp_path / "sealed"


def load_all(path: Path, provider: KeyProvider, **kw: object) -> dict[str, torch.Tensor]:
    files = SealedFiles(path, provider, **kw)  # type: ignore[arg-type]
    return {k: t for name in SHARDS for k, t in files.tensors(name)}


def reference(src: Path) -> dict[str, torch.Tensor]:
    return {k: t for name in SHARDS for k, t in load_file(src / name).items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("seal_with", available_backends())
@pytest.mark.parametrize("load_with", available_backends())
def test_round_trip_across_backends(
    tmp_path: Path, src: Path, kek: FileKeyProvider, seal_with: str, load_with: str
) -> None:
    seal(src, tmp_path / "s", kek, chunk_size=CHUNK, backend=seal_with, threads=3)
    files = SealedFiles(tmp_path / "s", kek, backend=load_with, threads=2)
    assert files.names() == sorted([*SHARDS, *CLEAR, "model.safetensors.index.json"])
    assert_same({k: t for n in SHARDS for k, t in files.tensors(n)}, reference(src))
    for name in [*CLEAR, "model.safetensors.index.json"]:
        assert files.read(name) == (src / name).read_bytes()
    assert files.read(SHARDS[1]) == (src / SHARDS[1]).read_bytes()


def test_sealed_directory_holds_no_plaintext_weights(sealed: Path, src: Path) -> None:
    assert sorted(os.listdir(sealed)) == sorted(
        [MANIFEST, *CLEAR, "model.safetensors.index.json", *(n + ".sm4" for n in SHARDS)]
    )
    for name in SHARDS:
        plain, cipher = (src / name).read_bytes(), (sealed / (name + ".sm4")).read_bytes()
        assert len(cipher) == HEADER.size + len(plain) + TAG_SIZE * -(-len(plain) // CHUNK)
        assert b"data_offsets" not in cipher and plain[-64:] not in cipher
    assert json.loads((sealed / MANIFEST).read_bytes())["chunk_size"] == CHUNK


def test_each_seal_uses_a_fresh_data_key_and_file_ids(tmp_path: Path, src: Path, kek: FileKeyProvider) -> None:
    a, b = seal(src, tmp_path / "a", kek), seal(src, tmp_path / "b", kek)
    assert a.wrapped_key != b.wrapped_key
    ids = [f.file_id for m in (a, b) for f in m.files.values()]
    assert len(set(ids)) == 4
    assert (tmp_path / "a" / (SHARDS[0] + ".sm4")).read_bytes() != (tmp_path / "b" / (SHARDS[0] + ".sm4")).read_bytes()
    assert a.files[SHARDS[0]].sm3 == b.files[SHARDS[0]].sm3


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK])
def test_chunk_boundaries(tmp_path: Path, kek: FileKeyProvider, size: int) -> None:
    (tmp_path / "src").mkdir()
    data = os.urandom(size)
    (tmp_path / "src" / "raw.safetensors").write_bytes(data)
    m = seal(tmp_path / "src", tmp_path / "dst", kek, chunk_size=CHUNK)
    assert m.files["raw.safetensors"].chunks == max(1, -(-size // CHUNK))
    assert SealedFiles(tmp_path / "dst", kek).read("raw.safetensors") == data
    verify(tmp_path / "dst", kek)


def chunk_at(index: int) -> int:
    return HEADER.size + index * (CHUNK + TAG_SIZE)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def swap_chunks(path: Path, i: int, j: int) -> None:
    data = bytearray(path.read_bytes())
    a, b = data[chunk_at(i) : chunk_at(i + 1)], data[chunk_at(j) : chunk_at(j + 1)]
    data[chunk_at(i) : chunk_at(i + 1)], data[chunk_at(j) : chunk_at(j + 1)] = b, a
    path.write_bytes(bytes(data))


def splice(into: Path, source: Path, index: int) -> None:
    data = bytearray(into.read_bytes())
    data[chunk_at(index) : chunk_at(index + 1)] = source.read_bytes()[chunk_at(index) : chunk_at(index + 1)]
    into.write_bytes(bytes(data))


def swap_files(a: Path, b: Path) -> None:
    a.rename(a.with_name("t"))
    b.rename(a)
    a.with_name("t").rename(b)


def transplant(source: Path, into: Path) -> None:
    into.write_bytes(into.read_bytes()[: HEADER.size] + source.read_bytes()[HEADER.size :])


def resize(path: Path, delta: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:delta] if delta < 0 else data + bytes(delta))


W0, W1 = SHARDS[0] + ".sm4", SHARDS[1] + ".sm4"
TAMPER = {
    "flipped ciphertext byte": (
        lambda d: flip(d / W0, chunk_at(2) + 100),
        rf"{W0}: chunk 2 \(0-based, of 9\) fails its integrity",
    ),
    "flipped tag byte": (
        lambda d: flip(d / W1, chunk_at(1) - 1),
        rf"{W1}: chunk 0 \(0-based, of 9\) fails its integrity",
    ),
    "flipped last byte": (
        lambda d: flip(d / W0, (d / W0).stat().st_size - 1),
        rf"{W0}: chunk 8 \(0-based, of 9\) fails",
    ),
    "reordered chunks": (lambda d: swap_chunks(d / W0, 1, 3), rf"{W0}: chunk 1 \(0-based, of 9\) fails its integrity"),
    "chunk spliced from another file": (lambda d: splice(d / W0, d / W1, 4), rf"{W0}: chunk 4 \(0-based, of 9\) fails"),
    "truncated by a byte": (lambda d: resize(d / W1, -1), rf"{W1} is truncated"),
    "last chunk dropped": (lambda d: resize(d / W1, -(CHUNK // 2)), rf"{W1} is truncated"),
    "bytes appended": (lambda d: resize(d / W0, 16), rf"{W0} is longer than sealed"),
    "file swapped in under a copied header": (lambda d: transplant(d / W1, d / W0), rf"{W0}: chunk 0 \(0-based"),
    "header edited": (lambda d: flip(d / W0, 6), rf"{W0}: its header does not match"),
    "weight file missing": (lambda d: (d / W1).unlink(), rf"{W1} is missing"),
    "files swapped": (lambda d: swap_files(d / W0, d / W1), rf"{W0}: its header does not match"),
    "tokenizer swapped": (
        lambda d: (d / "tokenizer.json").write_bytes(b'{"model": {"vocab": {"b": 0}}}'),
        "tokenizer.json does not match its SM3 digest",
    ),
    "config missing": (
        lambda d: (d / "config.json").unlink(),
        "config.json is listed in tianmen-seal.json but missing",
    ),
    "manifest missing": (lambda d: (d / MANIFEST).unlink(), "is not a sealed model directory"),
    "weight file replaced by a FIFO": (
        lambda d: (d / W1).unlink() or os.mkfifo(d / W1),
        rf"{W1} is not a regular file",
    ),
    "config replaced by a directory": (
        lambda d: (d / "config.json").unlink() or (d / "config.json").mkdir(),
        "config.json is not a regular",
    ),
    "tokenizer grown": (lambda d: (d / "tokenizer.json").write_bytes(bytes(1 << 20)), "tokenizer.json does not match"),
    "manifest replaced by a directory": (
        lambda d: (d / MANIFEST).unlink() or (d / MANIFEST).mkdir(),
        f"{MANIFEST} is not a regular",
    ),
}


@pytest.mark.parametrize("case", TAMPER)
def test_tampering_is_refused_naming_file_and_chunk(sealed: Path, kek: FileKeyProvider, case: str) -> None:
    damage, message = TAMPER[case]
    damage(sealed)
    with pytest.raises(SealError, match=message):
        load_all(sealed, kek)
    with pytest.raises(SealError, match=message):
        verify(sealed, kek)


def test_a_bad_chunk_stops_loading_before_any_tensor(sealed: Path, kek: FileKeyProvider) -> None:
    flip(sealed / W0, chunk_at(7) + 5)
    files = SealedFiles(sealed, kek, threads=4)
    tensors = files.tensors(SHARDS[0])
    with pytest.raises(SealError, match=f"{W0}: chunk 7"):
        next(tensors)
    with pytest.raises(SealError, match=f"{W0}: chunk 7"):
        files.read(SHARDS[0])
    assert dict(files.tensors(SHARDS[1]))  # the other file is intact


def edit_manifest(path: Path, edit: object) -> None:
    raw = json.loads((path / MANIFEST).read_bytes())
    edit(raw)  # type: ignore[operator]
    (path / MANIFEST).write_text(json.dumps(raw))


def _set(keys: tuple[str, ...], value: object) -> object:
    def edit(raw: dict[str, object]) -> None:
        node = raw
        for k in keys[:-1]:
            node = node[k]  # type: ignore[assignment]
        node[keys[-1]] = value

    return edit


ZERO = "0" * 64
MANIFEST_EDITS = {
    "file digest": (_set(("files", SHARDS[0], "sm3"), ZERO), "fails its integrity check: it was edited"),
    "clear digest": (_set(("clear", "tokenizer.json", "sm3"), ZERO), "fails its integrity check"),
    "file id": (_set(("files", SHARDS[0], "id"), "00" * 8), "fails its integrity check"),
    "chunk size": (_set(("chunk_size",), 2048), "inconsistent: model-00001-of-00002.safetensors cannot have 9 chunks"),
    "provider kind": (_set(("key", "provider"), "env"), "fails its integrity check"),
    "mac": (_set(("mac",), ZERO), "fails its integrity check"),
    "clear file dropped": (lambda raw: raw["clear"].pop("tokenizer.json"), "fails its integrity check"),
    "weight file dropped": (lambda raw: raw["files"].pop(SHARDS[1]), "fails its integrity check"),
    "key id": (_set(("key", "id"), "kek:0000000000000000"), "sealed under key kek:0000000000000000"),
    "wrapped key": (_set(("key", "wrapped"), "A" * 32), "does not unwrap under"),
    "unknown field": (_set(("note",), "hi"), "malformed: ValueError unexpected or missing fields"),
    "bool for int": (_set(("files", SHARDS[0], "chunks"), True), "malformed"),
    "negative size": (_set(("files", SHARDS[0], "size"), -1), "malformed"),
    "path in a name": (lambda raw: raw["clear"].update({"../kek": raw["clear"]["config.json"]}), "malformed"),
    "version": (_set(("version",), 2), "format version 2; this Tianmen reads 1"),
    "not a manifest": (lambda raw: raw.clear(), "not a Tianmen seal manifest"),
}


@pytest.mark.parametrize("case", MANIFEST_EDITS)
def test_an_edited_manifest_is_refused(sealed: Path, kek: FileKeyProvider, case: str) -> None:
    edit, message = MANIFEST_EDITS[case]
    edit_manifest(sealed, edit)
    with pytest.raises(SealError, match=message):
        SealedFiles(sealed, kek)


@pytest.mark.parametrize("data", [b"", b"\xff\xfe", b"[]", b'{"format": "tianmen-seal", "version": 1}', b"[" * 100_000])
def test_a_garbled_manifest_is_refused(sealed: Path, kek: FileKeyProvider, data: bytes) -> None:
    (sealed / MANIFEST).write_bytes(data)
    with pytest.raises(SealError, match=r"tianmen-seal\.json is (malformed|not a Tianmen seal manifest)"):
        SealedFiles(sealed, kek)


def test_wrong_key(sealed: Path, tmp_path: Path) -> None:
    other = new_key_file(tmp_path / "other")
    with pytest.raises(SealError, match=f"sealed under key kek:.*; the key provider holds {other.key_id}"):
        SealedFiles(sealed, other)
    with pytest.raises(SealError, match="sealed under key"):
        verify(sealed, other)


def test_rewrap_moves_the_model_to_a_new_kek(sealed: Path, src: Path, kek: FileKeyProvider, tmp_path: Path) -> None:
    weights = {n: (sealed / (n + ".sm4")).read_bytes() for n in SHARDS}
    new = new_key_file(tmp_path / "new")
    m = rewrap(sealed, kek, new)
    assert (m.key_id, m.provider) == (new.key_id, "file")
    assert {n: (sealed / (n + ".sm4")).read_bytes() for n in SHARDS} == weights  # not re-encrypted
    assert_same(load_all(sealed, new), reference(src))
    verify(sealed, new)
    with pytest.raises(SealError, match="sealed under key"):
        SealedFiles(sealed, kek)
    assert [p.name for p in sealed.iterdir() if p.name.startswith(".")] == []


def test_rewrap_needs_the_old_key(sealed: Path, kek: FileKeyProvider, tmp_path: Path) -> None:
    before = (sealed / MANIFEST).read_bytes()
    stranger, new = new_key_file(tmp_path / "stranger"), new_key_file(tmp_path / "new")
    with pytest.raises(SealError, match="sealed under key"):
        rewrap(sealed, stranger, new)
    assert (sealed / MANIFEST).read_bytes() == before
    SealedFiles(sealed, kek)


class BrokenProvider:
    kind = "broken"
    key_id = "broken:1"

    def wrap(self, dek: bytes) -> bytes:
        return dek

    def unwrap(self, blob: bytes) -> bytes:
        raise KeyProviderError("the HSM is unplugged")


def test_seal_fails_early_with_a_provider_that_cannot_unwrap(tmp_path: Path, src: Path) -> None:
    with pytest.raises(SealError, match="cannot wrap the data key: the HSM is unplugged"):
        seal(src, tmp_path / "dst", BrokenProvider())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clear"]


def test_verify_checks_plaintext_digests_that_loading_leaves_to_it(sealed: Path, kek: FileKeyProvider) -> None:
    from security.manifest import Manifest, derive_keys

    m = Manifest.loads((sealed / MANIFEST).read_bytes())
    f = m.files[SHARDS[1]]
    m.files[SHARDS[1]] = type(f)(f.name, f.file_id, f.size, f.chunks, ZERO)
    m.sign(derive_keys(kek.unwrap(m.wrapped_key))[1])  # a key holder's own mistake: every tag still checks
    (sealed / MANIFEST).write_bytes(m.dumps())
    assert dict(SealedFiles(sealed, kek).tensors(SHARDS[1]))
    with pytest.raises(SealError, match=f"{SHARDS[1]}: the decrypted weights do not match their SM3 digest"):
        dict(SealedFiles(sealed, kek, check_digests=True).tensors(SHARDS[1]))
    with pytest.raises(SealError, match=f"{W1}: the plaintext does not match its SM3 digest"):
        verify(sealed, kek)


def test_verify_returns_the_manifest(sealed: Path, kek: FileKeyProvider) -> None:
    m = verify(sealed, kek, threads=1)
    assert set(m.files) == set(SHARDS) and m.key_id == kek.key_id
    assert SealedFiles(sealed, kek).digest == SealedFiles(sealed, kek).digest != ZERO


def test_unlisted_files_are_ignored_loudly(
    sealed: Path, kek: FileKeyProvider, caplog: pytest.LogCaptureFixture
) -> None:
    (sealed / "chat_template.jinja").write_text("{{ evil }}")
    with caplog.at_level(logging.WARNING, logger="security.sealed"):
        files = SealedFiles(sealed, kek)
    assert "chat_template.jinja" in caplog.text
    assert "chat_template.jinja" not in files.names()
    with pytest.raises(FileNotFoundError):
        files.read("chat_template.jinja")
    with pytest.raises(FileNotFoundError):
        files.read(W0)


def test_progress_bars(tmp_path: Path, src: Path, kek: FileKeyProvider, capfd: pytest.CaptureFixture[str]) -> None:
    seal(src, tmp_path / "s", kek, chunk_size=CHUNK, progress=True)
    assert "sealing" in capfd.readouterr().err
    verify(tmp_path / "s", kek, progress=True)
    load_all(tmp_path / "s", kek, progress=True)
    err = capfd.readouterr().err
    assert err.count(SHARDS[0]) >= 2
    seal(src, tmp_path / "quiet", kek)
    assert capfd.readouterr().err == ""


def test_seal_into_an_empty_directory(tmp_path: Path, src: Path, kek: FileKeyProvider) -> None:
    (tmp_path / "dst").mkdir()
    seal(src, tmp_path / "dst", kek)
    assert_same(load_all(tmp_path / "dst", kek), reference(src))


@pytest.mark.parametrize(
    ("prepare", "message"),
    [
        (lambda s, d: (s / "pytorch_model.bin").write_bytes(b"x"), "holds pytorch_model.bin: seal encrypts only"),
        (lambda s, d: (s / "original").mkdir(), "holds original/"),
        (lambda s, d: [p.unlink() for p in s.glob("*.safetensors")], "has no \\*.safetensors weights"),
        (lambda s, d: d.mkdir() or (d / "x").write_text(""), "already exists and is not an empty directory"),
        (lambda s, d: (s / MANIFEST).write_text("{}"), "is already sealed"),
    ],
)
def test_seal_refuses(tmp_path: Path, src: Path, kek: FileKeyProvider, prepare: object, message: str) -> None:
    dst = tmp_path / "dst"
    prepare(src, dst)  # type: ignore[operator]
    with pytest.raises(SealError, match=message):
        seal(src, dst, kek)


def test_a_failed_seal_leaves_nothing_behind(tmp_path: Path, src: Path, kek: FileKeyProvider) -> None:
    (src / " config.json").write_text("{}")  # a name the manifest rejects: fails after every file is written
    with pytest.raises(SealError, match="is malformed"):
        seal(src, tmp_path / "dst", kek, chunk_size=CHUNK)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clear", "kek"]


def test_chunk_size_bounds(tmp_path: Path, src: Path, kek: FileKeyProvider) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        seal(src, tmp_path / "dst", kek, chunk_size=512)


def test_an_oversized_manifest_is_not_read_whole(sealed: Path, kek: FileKeyProvider) -> None:
    os.truncate(sealed / MANIFEST, 1 << 40)  # sparse: a terabyte of zeros
    with pytest.raises(SealError, match=r"tianmen-seal\.json is over 64 MiB"):
        SealedFiles(sealed, kek)
