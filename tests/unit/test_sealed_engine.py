"""The engine reads a sealed tiny Llama through SealedFiles exactly as it reads the clear directory."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import ConfigError, ModelLoadError
from engine.llm import LLM
from engine.loader import DirectoryFiles, load_model, read_json
from engine.params import SamplingParams
from security.keys import FileKeyProvider, new_key_file
from security.manifest import SealError
from security.seal import seal
from security.sealed import SealedFiles
from tests.tiny_model import build_tiny_chat_model

PROMPTS = ["What is the capital of France?", "Tianmen is"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, FileKeyProvider]:
    root = tmp_path_factory.mktemp("sealed-engine")
    clear = build_tiny_chat_model(root / "clear")
    kek = new_key_file(root / "kek")
    seal(clear, root / "sealed", kek, chunk_size=4096)
    return clear, root / "sealed", kek


def test_loads_identical_weights(model: tuple[Path, Path, FileKeyProvider]) -> None:
    clear, sealed, kek = model
    files = SealedFiles(sealed, kek)
    hf_config = read_json(files, "config.json")
    assert hf_config == read_json(DirectoryFiles(clear), "config.json")
    cpu = torch.device("cpu")
    want = load_model(DirectoryFiles(clear), hf_config, cpu, torch.float32).state_dict()
    got = load_model(files, hf_config, cpu, torch.float32).state_dict()
    assert got.keys() == want.keys() and len(want) > 5
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_generates_identical_tokens(model: tuple[Path, Path, FileKeyProvider]) -> None:
    clear, sealed, kek = model
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = LLM(EngineConfig(model=clear, device="cpu")).generate(PROMPTS, params)
    got = LLM(EngineConfig(model=sealed, device="cpu"), files=SealedFiles(sealed, kek)).generate(PROMPTS, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert all(len(c.token_ids) == 12 for c in got)


def test_damaged_weights_stop_the_engine(model: tuple[Path, Path, FileKeyProvider], tmp_path: Path) -> None:
    clear, _, kek = model
    sealed = tmp_path / "sealed"
    seal(clear, sealed, kek, chunk_size=4096)
    weights = sealed / "model.safetensors.sm4"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x40
    weights.write_bytes(bytes(data))
    files = SealedFiles(sealed, kek)
    with pytest.raises(
        ModelLoadError, match=r"model.safetensors.sm4: chunk \d+ \(0-based, of \d+\) fails its integrity"
    ):
        LLM(EngineConfig(model=sealed, device="cpu"), files=files)
    tok = json.loads((clear / "tokenizer.json").read_bytes())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens trade ids: same size, same keys, different text out
    (sealed / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SealError, match=r"tokenizer\.json does not match its SM3 digest"):
        SealedFiles(sealed, kek)


def test_tensor_parallel_workers_it_would_spawn_cannot_take_a_sealed_model(
    model: tuple[Path, Path, FileKeyProvider],
) -> None:
    _, sealed, kek = model
    config = EngineConfig(model=sealed, dtype="float32", device="cpu", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="torchrun"):
        EngineCore(config, SealedFiles(sealed, kek))


def test_tensor_parallel_workers_reopen_a_sealed_model_from_its_spec(
    model: tuple[Path, Path, FileKeyProvider],
) -> None:
    clear, sealed, kek = model
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(EngineConfig(model=clear, dtype="float32", device="cpu")).generate(PROMPTS, params)
    files = SealedFiles.from_spec(sealed, f"file:{kek.path}")
    config = EngineConfig(model=sealed, dtype="float32", device="cpu", tensor_parallel_size=2)
    llm = LLM(config, files=files)  # rank 1 is a spawned process: it unwrapped the data key itself
    try:
        got = llm.generate(PROMPTS, params)
    finally:
        llm.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_a_copy_carries_the_spec_and_only_the_variables_it_names(
    model: tuple[Path, Path, FileKeyProvider], tmp_path: Path
) -> None:
    _, sealed, kek = model
    secret = kek.path.read_text().strip()
    environ = {"TIANMEN_KEK": secret, "OTHER_SECRET": "s3cret"}
    files = SealedFiles.from_spec(sealed, "env:TIANMEN_KEK", environ)
    blob = pickle.dumps(files)
    assert b"s3cret" not in blob and b"OTHER_SECRET" not in blob
    copy = pickle.loads(blob)
    assert copy.digest == files.digest and copy.read("config.json") == files.read("config.json")
    with pytest.raises(TypeError, match="from_spec"):
        pickle.dumps(SealedFiles(sealed, kek))


def test_a_copy_refuses_a_manifest_swapped_after_the_open(
    model: tuple[Path, Path, FileKeyProvider], tmp_path: Path
) -> None:
    clear, sealed, kek = model
    moved = tmp_path / "sealed"
    shutil.copytree(sealed, moved)
    blob = pickle.dumps(SealedFiles.from_spec(moved, f"file:{kek.path}"))
    shutil.rmtree(moved)
    seal(clear, moved, kek, chunk_size=4096)  # the same weights sealed again: another data key, another manifest
    with pytest.raises(SealError, match="changed after the model was opened"):
        pickle.loads(blob)
