"""The engine computing in bfloat16 (dtype "auto" on CPUs with AVX512-BF16 or AMX) against transformers in
bfloat16 on the same bf16 checkpoints.

bf16 arithmetic rounds differently in every implementation, so "the same numbers" means: prefill logits as
close to float32's as transformers' own bf16 logits are, and every greedy token one that transformers' bf16
forward pass also ranks first, up to bf16 rounding; both with the engine's CPU kernels (engine.kernels:
the AVX512-BF16 GEMM where the CPU has it, fused RMSNorm, paged decode attention) and without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import amxmm, bf16mm
from engine.layers.linear import Linear
from engine.layers.mlp import GatedMLP
from tests.parity.conftest import build_llama, make_core, mixed_prompts, run_core, same_length_prompts, step_logits

NEW_TOKENS = 32
# Teacher-forced, transformers' bf16 logit for our token may trail its best by this much of the largest logit:
# a near-tie that bf16 rounding may break either way. Measured: <= 0.004 on these models; transformers' own
# bf16 logits sit ~0.005 from float32's.
NEAR_TIE = 0.01


@pytest.fixture(scope="module")
def hf16(bf16_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16).eval()


def _core(path: Path, **over: object):  # type: ignore[no-untyped-def]
    return make_core(path, dtype="bfloat16", **over)


@pytest.mark.skipif(not bf16mm.supported(), reason="this CPU has no AVX512-BF16: oneDNN runs every GEMM")
def test_every_linear_layer_runs_through_the_kernel(bf16_dir: Path) -> None:
    modules = list(_core(bf16_dir, gemm_path="bf16mm").runner.model.modules())
    linears = [m for m in modules if isinstance(m, Linear)]
    mlps = [m for m in modules if isinstance(m, GatedMLP)]
    assert mlps and all(m.gate_up_act is not None and set(m.gate_up_act.names) == {"bf16mm-silu"} for m in mlps)
    plain = [m for m in linears if not any(m is g.gate_up_proj for g in mlps)]
    assert plain and all(m.plan is not None and set(m.plan.names) == {"bf16mm"} for m in plain)
    off = [m for m in _core(bf16_dir, cpu_kernels=False).runner.model.modules() if isinstance(m, Linear)]
    assert off and all(m.plan is not None and set(m.plan.names) == {"onednn"} for m in off)


def test_prefill_logits_are_as_close_to_float32_as_transformers_bf16(bf16_dir: Path, hf16: torch.nn.Module) -> None:
    from transformers import AutoModelForCausalLM

    hf32 = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).eval()
    prompts = mixed_prompts(3)
    ours = step_logits(_core(bf16_dir), prompts, 1)[0].float()
    for i, p in enumerate(prompts.values()):
        with torch.no_grad():
            ref = hf32(torch.tensor([p])).logits[0, -1]
            theirs = hf16(torch.tensor([p])).logits[0, -1].float()
        scale = ref.abs().max()
        ours_err, theirs_err = (ours[i] - ref).abs().max() / scale, (theirs - ref).abs().max() / scale
        assert ours_err <= 1.5 * theirs_err + 1e-3, (ours_err, theirs_err)
        assert (ours[i] - theirs).abs().max() / scale < 2e-2


CONFIGS = {"selected": {}, "torch-only": {"cpu_kernels": False}, "torch-gemm": {"gemm_path": "torch"}}
if bf16mm.supported():
    CONFIGS["bf16mm"] = {"gemm_path": "bf16mm"}
    CONFIGS["bf16fma"] = {"gemm_path": "bf16fma"}
if amxmm.supported():
    CONFIGS["amxmm"] = {"gemm_path": "amxmm"}
if bf16mm.supported() or amxmm.supported():  # every decode step one C call (engine.models.llama_program)
    CONFIGS["program"] = {"gemm_path": "bf16mm" if bf16mm.supported() else "amxmm", "decode_program": "program"}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("prompts", [mixed_prompts(), same_length_prompts()], ids=["mixed", "same-length"])
def test_greedy_tokens_are_transformers_bf16_choices(
    bf16_dir: Path, hf16: torch.nn.Module, prompts: dict[str, list[int]], config: str
) -> None:
    ours = run_core(_core(bf16_dir, **CONFIGS[config]), prompts, NEW_TOKENS)
    assert_transformers_choices(hf16, prompts, ours)


def assert_transformers_choices(
    hf16: torch.nn.Module, prompts: dict[str, list[int]], ours: dict[str, list[int]]
) -> None:
    """Every token of ours one that transformers' bf16 pass, given our tokens before it, also ranks first, up to
    NEAR_TIE."""
    for rid, prompt in prompts.items():
        assert len(ours[rid]) == NEW_TOKENS
        with torch.no_grad():  # transformers' logits at every position we sampled, given our tokens before it
            logits = hf16(torch.tensor([prompt + ours[rid]])).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(ours[rid])[:, None])[:, 0]
        gap = (logits.max(1).values - chosen) / logits.abs().max(1).values
        assert gap.max() <= NEAR_TIE, f"{rid}: token {int(gap.argmax())} trails transformers' choice by {gap.max():.3g}"


ATTENTION = ("amx", "dp", "dp-prefetch", "dp-t", "dp-t-prefetch", "dp-chunked", "portable", "portable-prefetch")


@pytest.fixture(scope="module")
def heads64(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A Llama whose attention every decode kernel takes: 7 query heads of 64 over one KV head (Qwen2-0.5B's
    group size), saved in bf16, with transformers' bf16 model of it."""
    from transformers import AutoModelForCausalLM

    src = build_llama(tmp_path_factory.mktemp("heads64"), hidden_size=448, intermediate_size=512,
                      num_attention_heads=7, num_key_value_heads=1)  # fmt: skip
    out = tmp_path_factory.mktemp("heads64-bf16")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(out)
    return out, AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("mode", ["program", "layers"])
@pytest.mark.parametrize("name", ATTENTION)
def test_every_decode_attention_kernel_gives_transformers_bf16_choices(
    heads64: tuple[Path, torch.nn.Module], name: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decode attention kernel the op choice may pick, forced in turn, in a whole model (through the layers
    and inside a decode program), contexts past one 256-token chunk among them: greedy tokens transformers' bf16
    pass also ranks first, as above."""
    import engine.model_runner

    path, hf16 = heads64
    found = {n: k for n, k in engine.model_runner.decode_attention_kernels().items() if n == name}
    gemm = "bf16mm" if bf16mm.supported() else "amxmm" if amxmm.supported() else None
    if not found or gemm is None:
        pytest.skip(f"{name} is not built on this CPU, or no bf16 GEMM kernel runs here")
    monkeypatch.setattr(engine.model_runner, "decode_attention_kernels", lambda: found)
    core = _core(path, gemm_path=gemm, decode_program=mode)  # forced: every kernel bound untimed
    assert all(m.kernel is found[name] for m in core.runner.model.attention_layers())
    prompts = {**mixed_prompts(3), "long": mixed_prompts(8, seed=5)["r4"] * 5}  # 320 tokens
    assert_transformers_choices(hf16, prompts, run_core(core, prompts, NEW_TOKENS))


@pytest.mark.skipif(not amxmm.supported(), reason="this CPU has no AMX tiles: prompts run torch's SDPA")
def test_the_amx_prefill_attention_gives_transformers_bf16_choices(
    heads64: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole prompts through the AMX prefill attention (engine.kernels.prefill_attn_amx), forced, with no decode
    attention kernel (which would otherwise take the prompts in place) and the prompts in chunks of at most 64
    tokens (a 320-token prompt's later chunks read the cache through SDPA): greedy tokens transformers' bf16 pass
    also ranks first."""
    import engine.model_runner
    from engine.kernels.prefill_attn_amx import PrefillAttention

    path, hf16 = heads64
    monkeypatch.setattr(engine.model_runner, "decode_attention_kernels", lambda: {})
    calls: list[int] = []
    original = PrefillAttention.__call__
    monkeypatch.setattr(
        PrefillAttention, "__call__", lambda self, q, *a: calls.append(q.shape[0]) or original(self, q, *a)
    )
    core = _core(path, gemm_path="amxmm", long_prefill_token_threshold=64)  # forced: every kernel bound untimed
    assert all(m.prefill_kernel is not None for m in core.runner.model.attention_layers())
    prompts = {**mixed_prompts(3), "long": mixed_prompts(8, seed=5)["r4"] * 5}  # 320 tokens
    assert_transformers_choices(hf16, prompts, run_core(core, prompts, NEW_TOKENS))
    assert calls  # the prompts' first chunks went through it
