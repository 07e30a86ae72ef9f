"""The engine reads a sealed tiny Llama through SealedFiles exactly as it reads the clear directory."""

from __future__ import annotations

import json
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
