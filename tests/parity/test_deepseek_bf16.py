"""DeepSeek-V2 computing in bfloat16 against transformers in bfloat16, with and without the CPU kernels.

The shapes fit the grouped kernels for MoE and MLA (engine.kernels.grouped's GroupedExperts, and GroupedLinear
for W_UK / W_UV, over amxmm or bf16mm; the latent decode attention of decode_attn_amx or decode_attn_dp), so on a
CPU with AMX tiles or AVX512-BF16 a forced configuration runs those that the CPU has, and the measured one runs
what this machine's timing chose. As in test_bf16_math, "the same" means logits as close to float32's as
transformers' own bf16 logits are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import amxmm, bf16mm
from engine.layers.mla import MLAttention
from engine.layers.moe import MoE
from tests.parity.conftest import VOCAB, make_core, mixed_prompts, run_core, same_length_prompts, step_logits

NEW_TOKENS = 24
NEAR_TIE = 0.01  # as test_bf16_math: how far transformers' bf16 logit for our token may trail its best
CONFIG: dict[str, object] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,  # K and I in whole 32-wide tiles, 2I whole gate/up block pairs
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=32,  # W_UK and W_UV per head: whole 32-wide tiles
    qk_rope_head_dim=32,  # latent + rope = 64: whole 32-wide tiles
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    q_lora_rank=24,
    max_position_embeddings=512,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS: dict[str, dict[str, object]] = {"selected": {}, "torch-only": {"cpu_kernels": False}}
FORCED = [name for name, module in (("amxmm", amxmm), ("bf16mm", bf16mm), ("bf16fma", bf16mm)) if module.supported()]
for name in FORCED:
    CONFIGS[name] = {"gemm_path": name}  # forced: every kernel that fits is bound, untimed (that path's first)


@pytest.fixture(scope="module")
def ds16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("deepseek-bf16")
    DeepseekV2ForCausalLM(DeepseekV2Config(**CONFIG)).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf16(ds16: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ds16, dtype=torch.bfloat16).eval()


def _core(path: Path, **over: object):  # type: ignore[no-untyped-def]
    return make_core(path, dtype="bfloat16", **over)


@pytest.mark.parametrize("forced", FORCED or [pytest.param("none", marks=pytest.mark.skip("no AMX, no AVX512-BF16"))])
def test_forced_kernels_take_the_experts_and_the_latent_attention(ds16: Path, forced: str) -> None:
    modules = list(_core(ds16, **CONFIGS[forced]).runner.model.modules())
    moes = [m for m in modules if isinstance(m, MoE)]
    mlas = [m for m in modules if isinstance(m, MLAttention)]
    kernel = {"amxmm": amxmm.kernel, "bf16mm": bf16mm.kernel, "bf16fma": bf16mm.kernel_fma32}[forced]()
    assert moes and all(m.grouped is not None and m.grouped.down.kernel is kernel for m in moes)
    experts = [lin for m in moes for e in m.local_experts() for lin in (e.gate_up_proj, e.down_proj)]
    assert all(not lin.packable and lin.weight.numel() == 0 for lin in experts)  # no GEMM plans or plain copies
    assert mlas and all(m.absorbed is not None and m.absorbed[0].kernel is kernel for m in mlas)
    assert all(m.kernel is not None for m in mlas)  # the latent attention in place (AMX or dot products)
    off = [m for m in _core(ds16, cpu_kernels=False).runner.model.modules() if isinstance(m, MoE | MLAttention)]
    assert off and all(getattr(m, "grouped", None) is None and getattr(m, "kernel", None) is None for m in off)
    assert all(m.absorbed is None for m in off if isinstance(m, MLAttention))


@pytest.fixture(scope="module")
def hf32(ds16: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ds16, dtype=torch.float32).eval()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_prefill_and_decode_logits_are_as_close_to_float32_as_transformers_bf16(
    ds16: Path, hf16: torch.nn.Module, hf32: torch.nn.Module, config: str
) -> None:
    prompts = list(mixed_prompts(4).values())
    captured = step_logits(_core(ds16, **CONFIGS[config]), dict(enumerate(prompts)), 3)
    for step in range(3):  # the prompt, then two tokens decoded through the latent cache and the experts
        for i, p in enumerate(prompts):
            ids = p + [int(captured[s][i].float().argmax()) for s in range(step)]
            with torch.no_grad():
                ref = hf32(torch.tensor([ids])).logits[0, -1]
                theirs = hf16(torch.tensor([ids])).logits[0, -1].float()
            ours = captured[step][i].float()
            scale = ref.abs().max()
            ours_err, theirs_err = (ours - ref).abs().max() / scale, (theirs - ref).abs().max() / scale
            assert ours_err <= 1.5 * theirs_err + 2e-3, (step, i, ours_err, theirs_err)


def _worst_gap(path: Path, hf16: torch.nn.Module, prompts: dict[str, list[int]], **over: object) -> float:
    """Of every greedy token the engine chose, how far transformers' bf16 logit for it (teacher-forced on the
    engine's tokens) trails transformers' best, as a share of the largest logit: 0 where they agree."""
    ours, worst = run_core(_core(path, **over), prompts, NEW_TOKENS), 0.0
    for rid, prompt in prompts.items():
        assert len(ours[rid]) == NEW_TOKENS
        with torch.no_grad():
            logits = hf16(torch.tensor([prompt + ours[rid]])).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(ours[rid])[:, None])[:, 0]
        worst = max(worst, float(((logits.max(1).values - chosen) / logits.abs().max(1).values).max()))
    return worst


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "torch-only"])
@pytest.mark.parametrize("prompts", [mixed_prompts(), same_length_prompts()], ids=["mixed", "same-length"])
def test_greedy_tokens_are_as_near_transformers_bf16_choices_as_the_torch_codes(
    ds16: Path, hf16: torch.nn.Module, prompts: dict[str, list[int]], config: str
) -> None:
    """bf16 rounding lets the router break a near-tie its own way: on the mixed prompts one token of the torch
    code trails transformers' choice by 0.065-0.10 of the largest logit (measured; test_bf16_math's dense models
    stay under 0.004), while its logits stay as close to float32's as transformers' bf16 (the test above). The
    kernels may differ from the torch code by bf16 rounding (NEAR_TIE), no more."""
    torch_code = _worst_gap(ds16, hf16, prompts, cpu_kernels=False)
    assert _worst_gap(ds16, hf16, prompts, **CONFIGS[config]) <= torch_code + NEAR_TIE


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16"])
def test_quantized_experts_run_grouped_where_their_kernel_has_a_grouped_entry_and_decode(
    ds16: Path, tmp_path: Path, scheme: str
) -> None:
    """A quantized checkpoint's experts take their kernel's grouped call (engine.quant.grouped; w4mm's, and
    i8mm's where the CPU has AVX512-BF16 for its bf16 rows), never the bf16 experts' kernels, in a forced
    configuration too (which binds every kernel that fits); elsewhere they keep their own GEMMs. It decodes."""
    from engine.kernels import i8mm, w4mm
    from engine.quant.grouped import GroupedQuantExperts
    from engine.quant.quantize import quantize

    quantize(ds16, tmp_path / "q", scheme, group_size=8)
    prompts = mixed_prompts(3)
    forced = _core(tmp_path / "q", gemm_path="amxmm" if amxmm.supported() else "onednn")
    k8 = i8mm.kernel()
    grouped_here = w4mm.kernel() is not None if scheme == "w4a16" else k8 is not None and k8.has_grouped
    moes = [m for m in forced.runner.model.modules() if isinstance(m, MoE)]
    assert moes and all(isinstance(m.grouped, GroupedQuantExperts) == grouped_here for m in moes)
    got = run_core(forced, prompts, 8)
    assert all(len(t) == 8 for t in got.values())
