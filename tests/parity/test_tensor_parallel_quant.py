"""Quantized checkpoints under tensor parallelism: each rank reads its part of every packed, grouped or scaled
tensor (column-parallel rows, row-parallel columns, merged QKV and gate/up shards, MLA projections, experts),
and TP=2 gives TP=1's logits and tokens — GPTQ, AWQ and compressed-tensors W4A16 up to float sums. W8A8 takes
each token's activation scale over a rank's own slice of a row-parallel layer's inputs (as vLLM's row-parallel
layers do): a finer scale, so TP=2 is not TP=1 but must be as close to the unquantized model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig
from engine.core import EngineCore
from engine.errors import ModelLoadError
from engine.quant.quantize import quantize
from tests.parity.conftest import build_llama, build_qwen2, make_core, mixed_prompts, run_core, step_logits
from tests.parity.test_deepseek import build_deepseek
from tests.unit.test_quant_loading import _write

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # every rank's K (o: 64, down: 128) holds whole groups of 64
    return build_llama(tmp_path_factory.mktemp("tpq") / "llama", hidden_size=128, intermediate_size=256)


def _logits_and_tokens(core: EngineCore) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    logits: list[torch.Tensor] = []
    head = core.runner.model.compute_logits
    core.runner.model.compute_logits = lambda h: logits.append(head(h)) or logits[-1]  # type: ignore[method-assign]
    return logits, run_core(core, mixed_prompts(4), NEW_TOKENS)


def _compare(path: Path, rel: float) -> None:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=8, max_model_len=160)
    one = make_core(path, **cfg)
    logits1, tokens1 = _logits_and_tokens(one)
    two = make_core(path, **cfg, tensor_parallel_size=2)
    try:
        assert two.config.quantization == one.config.quantization != "none"
        logits2, tokens2 = _logits_and_tokens(two)
    finally:
        two.close()
    assert tokens2 == tokens1
    assert len(logits2) == len(logits1)
    for a, b in zip(logits1, logits2, strict=True):
        assert (a - b).abs().max() <= rel * a.abs().max(), float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct-asym"])
def test_w4a16_formats_split_over_two_ranks(llama: Path, tmp_path: Path, fmt: str) -> None:
    _write(llama, tmp_path / fmt, fmt)
    _compare(tmp_path / fmt, 1e-4)


BUILDERS = {
    "qwen2": build_qwen2,  # QKV biases, tied embeddings, one KV head replicated on both ranks
    "deepseek-v3": lambda p: build_deepseek("v3", p),  # MLA with q_lora, shared and routed experts split in halves
}


@pytest.mark.parametrize("model", list(BUILDERS))
def test_tianmen_quantize_w4a16_splits_over_two_ranks(tmp_path: Path, model: str) -> None:
    quantize(BUILDERS[model](tmp_path / model), tmp_path / "q", "w4a16", group_size=8)
    _compare(tmp_path / "q", 1e-4)


@pytest.mark.parametrize("model", list(BUILDERS))
def test_w8a8_over_two_ranks_is_as_close_to_the_float_model(tmp_path: Path, model: str) -> None:
    src = BUILDERS[model](tmp_path / model)
    quantize(src, tmp_path / "q", "w8a8")
    prompts = mixed_prompts(4)
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=160)
    want = step_logits(make_core(src, **cfg), prompts, 1)[0]  # the prompts' prefill: the same inputs for all
    one = step_logits(make_core(tmp_path / "q", **cfg), prompts, 1)[0]
    two_core = make_core(tmp_path / "q", **cfg, tensor_parallel_size=2)
    try:
        two = step_logits(two_core, prompts, 1)[0]
    finally:
        two_core.close()
    err1, err2 = (one - want).abs().max(), (two - want).abs().max()
    assert err1 > 0 and err2 <= 1.5 * err1, (float(err1), float(err2))  # quantized, and no worse split


def test_a_group_that_does_not_fit_a_rank_is_refused_before_any_worker_starts(llama: Path, tmp_path: Path) -> None:
    quantize(llama, tmp_path / "q", "w4a16", group_size=64)  # o_proj's K of 128: 64 a rank over 2, 32 over 4
    with pytest.raises(ModelLoadError, match=r"o_proj: a 128x32 weight cannot hold 4-bit groups of 64"):
        EngineCore(EngineConfig(model=tmp_path / "q", dtype="float32", device="cpu", tensor_parallel_size=4))
