"""DeepSeek-V2 from a bf16 checkpoint computed in float32 (a CPU without bf16 arithmetic), against transformers
loading the same file in float32: the weights widen exactly, so the results must agree as float32's do.

The shapes fit the float32 kernels: the routed experts in one grouped call per projection over the bf16-weight
kernel (engine.kernels.wbf16), and MLA decode over the paged latents in place (engine.kernels.decode_attn_latent:
DeepSeek's 512 + 64 latent row). A forced configuration binds both on every CPU; the measured one runs what this
machine's timing chose; without the CPU kernels, torch alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import decode_attn_latent, wbf16
from engine.layers.mla import MLAttention
from engine.layers.moe import MoE
from tests.parity.conftest import (
    assert_prefill_and_decode_logits_match,
    hf_expected,
    hf_model,
    make_core,
    mixed_prompts,
    run_core,
    same_length_prompts,
)
from tests.parity.test_deepseek import BASE

NEW_TOKENS = 24
# test_deepseek's tiny model, with DeepSeek's own latent row (512 + 64: the float32 latent kernel's width); 2I = 64
# is whole gate/up block pairs of the grouped call
CONFIG: dict[str, object] = BASE | dict(
    kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=24, num_experts_per_tok=2, n_shared_experts=1
)
CONFIGS: dict[str, dict[str, object]] = {
    "forced": {"gemm_path": "wbf16"},  # every kernel that fits is bound, untimed
    "selected": {},
    "torch-only": {"cpu_kernels": False},
}


@pytest.fixture(scope="module")
def ds_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(11)
    path = tmp_path_factory.mktemp("deepseek-f32-kernels")
    DeepseekV2ForCausalLM(DeepseekV2Config(**CONFIG)).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_cache() -> dict:
    return {}


def test_forced_kernels_take_the_experts_and_the_latent_attention(ds_bf16: Path) -> None:
    assert wbf16.kernel() is not None and decode_attn_latent.kernel() is not None  # built on every CPU
    modules = list(make_core(ds_bf16, **CONFIGS["forced"]).runner.model.modules())
    moes = [m for m in modules if isinstance(m, MoE)]
    mlas = [m for m in modules if isinstance(m, MLAttention)]
    assert moes and all(m.grouped is not None and m.grouped.down.kernel is wbf16.kernel() for m in moes)
    assert mlas and all(m.kernel is decode_attn_latent.kernel() for m in mlas)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_prefill_and_decode_logits_match(ds_bf16: Path, hf_cache: dict, config: str) -> None:
    core, hf = make_core(ds_bf16, **CONFIGS[config]), hf_model(hf_cache, ds_bf16)
    assert_prefill_and_decode_logits_match(core, hf, mixed_prompts(3))


@pytest.mark.parametrize("prompts", [mixed_prompts(), same_length_prompts()], ids=["mixed", "same-length"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_batch_matches_generate(
    ds_bf16: Path, hf_cache: dict, config: str, prompts: dict[str, list[int]]
) -> None:
    got = run_core(make_core(ds_bf16, **CONFIGS[config]), prompts, NEW_TOKENS)
    assert got == hf_expected(hf_cache, ds_bf16, prompts, NEW_TOKENS)
