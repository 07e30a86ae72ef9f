"""Config variants of the Llama family: RoPE scaling, biases, activations, MHA, sharded checkpoints."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.errors import ModelLoadError
from tests.parity.conftest import VOCAB, build_llama, hf_greedy, hf_model, make_core, run_core

VARIANTS: dict[str, dict[str, object]] = {
    "rope-llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "rope-linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 500.0},
    "biases-gelu": {"attention_bias": True, "mlp_bias": True, "hidden_act": "gelu"},
    "mha-tied": {"num_key_value_heads": 4, "tie_word_embeddings": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_transformers(variant: str, tmp_path: Path) -> None:
    path = build_llama(tmp_path / variant, **VARIANTS[variant])
    if variant == "biases-gelu":  # random init leaves biases at zero: make them count
        from safetensors.torch import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        gen = torch.Generator().manual_seed(3)
        tensors = {
            k: (torch.randn(v.shape, generator=gen) * 0.3 if k.endswith(".bias") else v) for k, v in tensors.items()
        }
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(3, VOCAB) for _ in range(n)] for i, n in enumerate([5, 90, 130])}
    hf = hf_model({}, path)
    expected = {r: hf_greedy(hf, p, 16) for r, p in prompts.items()}
    assert run_core(make_core(path), prompts, 16) == expected


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = build_llama(tmp_path / "one")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    prompts = {"a": [5, 6, 7, 8, 9]}
    assert run_core(make_core(tmp_path / "sharded"), prompts, 8) == run_core(make_core(path), prompts, 8)


def test_unsupported_rope_is_a_clear_error(tmp_path: Path) -> None:
    path = build_llama(tmp_path / "m")
    cfg = (path / "config.json").read_text().replace('"rope_type": "default"', '"rope_type": "dynamic", "factor": 2.0')
    if "dynamic" not in cfg:  # older transformers writes rope_scaling: null
        cfg = cfg.replace('"rope_scaling": null', '"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}')
    (path / "config.json").write_text(cfg)
    with pytest.raises(ModelLoadError, match="unsupported rope_scaling type 'dynamic'"):
        make_core(path)
