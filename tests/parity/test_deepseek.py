"""DeepSeek-V2/V3 (MLA + MoE) against transformers on tiny random checkpoints, in float32."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from engine.outputs import SchedulerOutput
from engine.params import SamplingParams
from engine.request import Request
from tests.parity.conftest import (
    VOCAB,
    assert_prefill_and_decode_logits_match,
    hf_expected,
    hf_model,
    make_core,
    mixed_prompts,
    run_core,
    same_length_prompts,
)

NEW_TOKENS = 32
BASE: dict[str, object] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    max_position_embeddings=512,
    initializer_range=0.1,  # spread router scores: float rounding must not flip a near-tied expert choice
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def _yarn(mscale: float, mscale_all_dim: float) -> dict[str, object]:
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


CONFIGS: dict[str, dict[str, object]] = {
    "v2-lite": dict(q_lora_rank=None, num_experts_per_tok=2, topk_method="greedy", n_shared_experts=2),
    "v2-grouped": dict(
        q_lora_rank=24,
        num_experts_per_tok=3,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=16.0,
        attention_bias=True,
        rope_parameters=_yarn(0.707, 0.707),
    ),
    "v3": dict(
        q_lora_rank=24,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=_yarn(1.0, 0.8),
    ),
    "v3-rope-halves": dict(q_lora_rank=24, num_experts_per_tok=2, n_group=2, topk_group=1, rope_interleave=False),
}


def build_deepseek(name: str, path: Path) -> Path:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    v3 = name.startswith("v3")
    config_cls, model_cls = (
        (DeepseekV3Config, DeepseekV3ForCausalLM) if v3 else (DeepseekV2Config, DeepseekV2ForCausalLM)
    )
    torch.manual_seed(len(name))
    model = model_cls(config_cls(**(BASE | CONFIGS[name]))).float()
    with torch.no_grad():  # random init leaves these at zero: make them count
        for n, t in model.named_parameters():
            if n.endswith(".bias"):
                t.normal_(0, 0.3)
        for n, t in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                t.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(CONFIGS))
def ds_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deepseek(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf_cache() -> dict:
    return {}


def _expected(cache: dict, path: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return hf_expected(cache, path, prompts, NEW_TOKENS)


def test_prefill_and_decode_logits_match(ds_dir: Path, hf_cache: dict) -> None:
    # the second step decodes all three through the latent cache
    assert_prefill_and_decode_logits_match(make_core(ds_dir), hf_model(hf_cache, ds_dir), mixed_prompts(3))


@pytest.mark.parametrize("prompts", [mixed_prompts(), same_length_prompts()], ids=["mixed", "same-length"])
def test_greedy_batch_matches_generate(ds_dir: Path, hf_cache: dict, prompts: dict[str, list[int]]) -> None:
    assert run_core(make_core(ds_dir), prompts, NEW_TOKENS) == _expected(hf_cache, ds_dir, prompts)


def test_prefix_cache_hits_keep_tokens(ds_dir: Path, hf_cache: dict) -> None:
    prefix = [random.Random(5).randrange(3, VOCAB) for _ in range(40)]
    prompts = mixed_prompts(prefix=prefix)
    core = make_core(ds_dir, block_size=8)
    run_core(core, {"r0": prompts["r0"]}, NEW_TOKENS)
    got = run_core(core, {r: p for r, p in prompts.items() if r != "r0"}, NEW_TOKENS)
    assert core.stats()["prefix_cache_hits"] >= 7 * 40 // 8 * 8
    expected = _expected(hf_cache, ds_dir, prompts)
    assert got == {r: t for r, t in expected.items() if r != "r0"}


def test_chunked_prefill_and_arrivals_keep_tokens(ds_dir: Path, hf_cache: dict) -> None:
    prompts = mixed_prompts()
    core = make_core(ds_dir, max_num_batched_tokens=16)
    chunks: list[tuple[str, int]] = []
    original = core.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = original()
        chunks.extend((s.req_id, len(s.token_ids)) for s in out.seqs if len(s.token_ids) > 1)
        return out

    core.scheduler.schedule = spy  # type: ignore[method-assign]
    arrivals = {0: ["r0", "r4"], 3: ["r1", "r2", "r3"], 10: ["r5", "r6"], 20: ["r7"]}
    assert run_core(core, prompts, NEW_TOKENS, arrivals) == _expected(hf_cache, ds_dir, prompts)
    assert len([n for r, n in chunks if r == "r4"]) >= 4  # 64 prompt tokens under a 16-token budget


def test_preemption_keeps_tokens(ds_dir: Path, hf_cache: dict) -> None:
    prompts = mixed_prompts()
    per_block = make_core(ds_dir, max_model_len=128).runner.kv_bytes_per_block()
    core = make_core(ds_dir, max_model_len=128, kv_cache_bytes=per_block * 16)
    assert run_core(core, prompts, NEW_TOKENS) == _expected(hf_cache, ds_dir, prompts)
    assert core.stats()["preemptions_total"] > 0


def test_decode_stays_latent_and_experts_run_once(tmp_path: Path) -> None:
    core = make_core(build_deepseek("v3", tmp_path / "m"))
    model = core.runner.model
    up_projected: list[int] = []  # rows through kv_b_proj (latent -> per-head K/V)
    expert_rows: dict[int, list[int]] = {}
    for layer in model.model.layers:
        layer.self_attn.kv_b_proj.register_forward_hook(lambda m, i, o: up_projected.append(i[0].shape[0]))
    moe = model.model.layers[1].mlp
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, i, o, e=e: expert_rows.setdefault(e, []).append(i[0].shape[0]))
    prompts = mixed_prompts(4)
    for rid, p in prompts.items():
        core.add_request(Request(rid, p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
    core.step()  # all four prompts prefill in one step
    assert up_projected
    assert all(len(rows) == 1 for rows in expert_rows.values())  # each expert ran once, on its tokens only
    assert sum(rows[0] for rows in expert_rows.values()) == sum(map(len, prompts.values())) * moe.gate.top_k
    up_projected.clear()
    core.step()  # decode only
    assert up_projected == []  # absorbed: attention ran over the latent cache


def test_latent_cache_is_10x_smaller() -> None:
    # DeepSeek-V2 / V2.5 / V3 attention: 128 heads, qk 128 + 64, v 128, latent 512 + 64
    heads, nope, rope, v = 128, 128, 64, 128
    cfg = BASE | dict(num_attention_heads=heads, hidden_size=5120, qk_nope_head_dim=nope, qk_rope_head_dim=rope)
    cfg |= dict(v_head_dim=v, kv_lora_rank=512, q_lora_rank=1536, num_experts_per_tok=6, num_hidden_layers=2)
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(cfg)
    num_layers = len(model.attention_layers())
    latent = sum(torch.Size(s).numel() for _, s in model.kv_cache_shape(1, 1)) * num_layers  # elements per token
    per_head_kv = num_layers * heads * (nope + rope + v)
    assert latent == num_layers * (512 + 64)
    assert per_head_kv >= 10 * latent


def test_mtp_layers_are_ignored_and_shards_load(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = build_deepseek("v3", tmp_path / "v3")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    mtp = tmp_path / "mtp"
    shutil.copytree(path, mtp)
    n = BASE["num_hidden_layers"]  # V3 checkpoints append the MTP module as layer num_hidden_layers
    extra = {f"model.layers.{n}.eh_proj.weight": torch.randn(64, 128), f"model.layers.{n}.enorm.weight": torch.ones(64)}
    save_file(extra, mtp / "model-mtp.safetensors", metadata={"format": "pt"})
    prompts = {"a": [5, 6, 7, 8, 9], "b": [11] * 20}
    expected = run_core(make_core(path), prompts, 8)
    assert run_core(make_core(sharded), prompts, 8) == expected
    assert run_core(make_core(mtp), prompts, 8) == expected


def test_bf16_checkpoint_through_the_bf16_weight_kernel(ds_dir: Path, tmp_path: Path) -> None:
    """A bf16 DeepSeek checkpoint computed in float32 with weights kept bf16 (engine.kernels.wbf16): MLA,
    the experts and the shared experts all go through the kernel and the greedy tokens match transformers."""
    from transformers import AutoModelForCausalLM

    from engine.layers.linear import Linear

    AutoModelForCausalLM.from_pretrained(ds_dir, dtype=torch.bfloat16).save_pretrained(tmp_path)
    core = make_core(tmp_path, gemm_path="wbf16")
    compact = [m for m in core.runner.model.modules() if isinstance(m, Linear) and m.plan and "wbf16" in m.plan.names]
    assert len(compact) > 10
    prompts = mixed_prompts()
    assert run_core(core, prompts, NEW_TOKENS) == hf_expected({}, tmp_path, prompts, NEW_TOKENS)
