"""Tensor and expert parallel over gloo, one worker process beside this one: TP=2 (and, for DeepSeek, EP=2)
against TP=1 on tiny float32 models.

One run per model exercises prefix-cache hits, chunked prefill and preemption together, so TP=2 must match TP=1
token for token, and its logits step by step, through all three."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from engine import ConfigError, EngineConfig
from engine.core import EngineCore
from engine.layers.mlp import GatedMLP
from engine.layers.moe import MoE
from engine.outputs import SchedulerOutput
from tests.parity.conftest import VOCAB, build_llama, build_qwen2, make_core, mixed_prompts, run_core
from tests.parity.test_deepseek import build_deepseek

NEW_TOKENS = 12
MODELS = {
    "llama-gqa": lambda p: build_llama(p),  # 2 KV heads: one per rank
    "llama-kv1": lambda p: build_llama(p, num_key_value_heads=1),  # fewer KV heads than ranks: replicated
    "qwen2": build_qwen2,  # QKV biases, tied embeddings, 1 KV head
    "deepseek-v2-lite": lambda p: build_deepseek("v2-lite", p),  # MLA without q_lora, 2 shared experts
    "deepseek-v2-grouped": lambda p: build_deepseek("v2-grouped", p),  # q_lora, group-limited routing, biases, YaRN
    "deepseek-v3": lambda p: build_deepseek("v3", p),  # sigmoid routing with correction bias, n_group / topk_group
}
RUNS = [
    ("llama-gqa", False),
    ("llama-kv1", False),
    ("qwen2", False),
    ("deepseek-v2-lite", False),
    ("deepseek-v3", False),
    ("deepseek-v2-grouped", True),  # expert parallel
    ("deepseek-v3", True),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {}


def _model(models: dict[str, Path], name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if name not in models:
        models[name] = MODELS[name](tmp_path_factory.mktemp(name))
    return models[name]


def _run(core: EngineCore) -> tuple[dict[str, list[int]], list[torch.Tensor], list[SchedulerOutput]]:
    """Requests behind a shared prefix, arriving once the first has cached it; logits and schedules per step."""
    prefix = [random.Random(7).randrange(3, VOCAB) for _ in range(40)]
    prompts = mixed_prompts(6, prefix=prefix)
    logits: list[torch.Tensor] = []
    scheds: list[SchedulerOutput] = []
    model, schedule = core.runner.model, core.scheduler.schedule
    head = model.compute_logits
    model.compute_logits = lambda h: logits.append(head(h)) or logits[-1]  # type: ignore[method-assign]
    core.scheduler.schedule = lambda: scheds.append(schedule()) or scheds[-1]  # type: ignore[method-assign]
    tokens = run_core(core, prompts, NEW_TOKENS, arrivals={0: ["r0"], 4: ["r1", "r2", "r3", "r4", "r5"]})
    return tokens, logits, scheds


def _deepseek(hf: dict) -> bool:
    return hf["architectures"][0].startswith("Deepseek")


def _assert_holds_its_part(core: EngineCore, hf: dict, ep: bool) -> None:
    """Rank 0 holds half the heads, vocabulary and MLP (or experts): its part, not a copy of the model."""
    model = core.runner.model.model
    attn = model.layers[0].self_attn
    assert attn.num_heads == hf["num_attention_heads"] // 2
    assert model.embed_tokens.weight.shape[0] == VOCAB // 2
    assert model.layers[0].mlp.down_proj.in_features == hf["intermediate_size"] // 2  # a dense MLP
    if not _deepseek(hf):
        assert attn.num_kv_heads == max(1, hf["num_key_value_heads"] // 2)
        return
    moe = model.layers[-1].mlp
    assert isinstance(moe, MoE)
    held = [e for e in range(hf["n_routed_experts"]) if moe.holds_expert(e)]
    assert held == (list(range(hf["n_routed_experts"] // 2)) if ep else list(range(hf["n_routed_experts"])))
    size = hf["moe_intermediate_size"] if ep else hf["moe_intermediate_size"] // 2  # whole experts, or halves
    assert moe.experts[0].down_proj.in_features == size
    assert isinstance(moe.experts[-1], GatedMLP) != ep  # under EP, another rank's expert is a placeholder


@pytest.mark.parametrize(("name", "ep"), RUNS, ids=[f"{n}{'-ep' if ep else ''}" for n, ep in RUNS])
def test_tp2_matches_tp1_through_prefix_hits_chunks_and_preemption(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, name: str, ep: bool
) -> None:
    model = _model(models, name, tmp_path_factory)
    # a 32-token budget chunks the prompts (up to 104 tokens); 26 blocks of 8 cannot hold 5 sequences at once
    cfg = dict(max_num_seqs=5, max_num_batched_tokens=32, block_size=8, max_model_len=160)
    one = make_core(model, **cfg)
    blocks = 26
    hf = json.loads((model / "config.json").read_text())
    per_block = one.runner.kv_bytes_per_block()
    if not _deepseek(hf):  # a rank's KV heads: its cache blocks are that much smaller (MLA's latent is whole)
        per_block = per_block * max(1, hf["num_key_value_heads"] // 2) // hf["num_key_value_heads"]
    one = make_core(model, **cfg, kv_cache_bytes=one.runner.kv_bytes_per_block() * blocks)
    two = make_core(model, **cfg, kv_cache_bytes=per_block * blocks, tensor_parallel_size=2, enable_expert_parallel=ep)
    try:
        assert one.block_manager.num_blocks == two.block_manager.num_blocks == blocks
        _assert_holds_its_part(two, hf, ep)
        tokens1, logits1, scheds1 = _run(one)
        tokens2, logits2, scheds2 = _run(two)
        s1, s2 = one.stats(), two.stats()
        ranks = two.stats()["ranks"]
    finally:
        two.close()
    assert tokens2 == tokens1
    assert len(logits2) == len(logits1)
    for a, b in zip(logits1, logits2):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    # the run really did hit the prefix cache, chunk a prefill and preempt, in both
    for s, scheds in ((s1, scheds1), (s2, scheds2)):
        assert s["prefix_cache_hits"] >= 5 * 40 // 8 * 8
        assert s["preemptions_total"] > 0
        assert any(len(q.token_ids) > 1 and q.start > 0 for sched in scheds for q in sched.seqs)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["steps"] == len(scheds2) - sum(1 for q in scheds2 if q.empty)
    assert ranks[0]["comm_seconds"] > 0 and ranks[0]["collectives"] > 0


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (dict(num_attention_heads=4, num_key_value_heads=2), "num_attention_heads"),  # 4 heads over 3 ranks
        (dict(num_attention_heads=12, num_key_value_heads=6, hidden_size=48), "num_key_value_heads"),
    ],
)
def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(
    tmp_path: Path, over: dict, message: str
) -> None:
    path = build_llama(tmp_path / "m", **over)
    size = 3 if over["num_attention_heads"] == 4 else 4  # 6 KV heads neither split over 4 ranks nor divide 4
    with pytest.raises(ConfigError, match=message):
        EngineCore(EngineConfig(model=path, dtype="float32", device="cpu", tensor_parallel_size=size))
