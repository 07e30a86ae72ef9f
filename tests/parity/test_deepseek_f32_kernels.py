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
    VOCAB,
    hf_expected,
    hf_model,
    make_core,
    mixed_prompts,
    run_core,
    same_length_prompts,
    step_logits,
)

NEW_TOKENS = 24
CONFIG: dict[str, object] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,  # 2I = 64: whole gate/up block pairs of the grouped call
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    kv_lora_rank=512,  # latent + rope = 576: the float32 latent kernel's row
    qk_nope_head_dim=16,
    qk_rope_head_dim=64,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    q_lora_rank=24,
    max_position_embeddings=512,
    initializer_range=0.1,  # spread router scores: float rounding must not flip a near-tied expert choice
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
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
    prompts = mixed_prompts(3)
    captured = step_logits(make_core(ds_bf16, **CONFIGS[config]), prompts, 2)
    hf = hf_model(hf_cache, ds_bf16)
    for i, p in enumerate(prompts.values()):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(captured[0][i], ref, rtol=1e-4, atol=1e-4)  # prefill
    for i, p in enumerate(prompts.values()):  # the second step decoded all three through the latent cache
        with torch.no_grad():
            ref = hf(torch.tensor([p + [int(captured[0][i].argmax())]])).logits[0, -1]
        torch.testing.assert_close(captured[1][i], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prompts", [mixed_prompts(), same_length_prompts()], ids=["mixed", "same-length"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_batch_matches_generate(
    ds_bf16: Path, hf_cache: dict, config: str, prompts: dict[str, list[int]]
) -> None:
    got = run_core(make_core(ds_bf16, **CONFIGS[config]), prompts, NEW_TOKENS)
    assert got == hf_expected(hf_cache, ds_bf16, prompts, NEW_TOKENS)
