"""Our engine against transformers on tiny random Llama / Qwen2 / Mistral checkpoints, in float32."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.kernels.bind import gemm_paths
from engine.layers.linear import Linear
from engine.outputs import SchedulerOutput
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

NEW_TOKENS = 32


def _expected(cache: dict, path: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return hf_expected(cache, path, prompts, NEW_TOKENS)


# rows come out decodes first: one-token prompts (which decode) would reorder them, so none here
@pytest.mark.parametrize(
    "prompts",
    [mixed_prompts(3), {r: p for r, p in same_length_prompts().items() if len(p) > 1}],
    ids=["mixed", "same-length"],
)
def test_prefill_logits_match(model_dir: Path, hf_models: dict, prompts: dict[str, list[int]]) -> None:
    ours = step_logits(make_core(model_dir), prompts, 1)[0]  # the first step prefilled all prompts together
    hf = hf_model(hf_models, model_dir)
    for i, p in enumerate(prompts.values()):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(ours[i], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("limit", [0, 20, 4096], ids=["sdpa", "split", "in-place"])
def test_prompts_attend_in_place_or_through_sdpa_alike(model_dir: Path, hf_models: dict, limit: int) -> None:
    """Prompt chunks up to `prefill_in_place` tokens attend through the decode kernel, longer ones through SDPA;
    with the limit between the prompts' lengths (20: 3, 17 and 8 tokens in place, 33, 64, 40 and 25 not) the
    runner lays the short ones out first, and each row's logits still go back to its own request."""
    core = make_core(model_dir, gemm_path="onednn")  # forced: every kernel bound, decode attention included
    assert core.runner.attention_in_place
    core.runner.prefill_in_place = limit
    prompts = {r: p for r, p in mixed_prompts().items() if len(p) > 1}
    ours = step_logits(core, prompts, 1)[0]
    hf = hf_model(hf_models, model_dir)
    for i, p in enumerate(prompts.values()):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(ours[i], ref, rtol=1e-4, atol=1e-4)
    core = make_core(model_dir, gemm_path="onednn")
    core.runner.prefill_in_place = limit
    assert run_core(core, prompts, NEW_TOKENS) == _expected(hf_models, model_dir, prompts)


def test_the_row_layout_does_not_depend_on_the_in_place_limit(model_dir: Path) -> None:
    """Tensor-parallel ranks each measure their own limit and then add their rows together: the rows a step lays
    out (tokens, positions, cache slots, sampled rows) must be the same whatever the limit, only how many of
    them attend in place may differ."""
    from engine.params import SamplingParams
    from engine.request import Request

    core = make_core(model_dir, gemm_path="onednn")
    for rid, p in mixed_prompts().items():
        core.add_request(Request(rid, p, SamplingParams(max_tokens=2, temperature=0)))
    sched = core.scheduler.schedule()
    layouts, in_place = [], []
    for limit in (0, 20, 4096):
        core.runner.prefill_in_place = limit
        ids, pos, ctx, rows = core.runner._prepare(sched)
        layouts.append((ids.tolist(), pos.tolist(), ctx.slot_mapping.tolist(), rows.tolist()))
        in_place.append(ctx.num_decodes)
    assert layouts[0] == layouts[1] == layouts[2]
    # the one-token prompt schedules as a decode; then the 3-, 8- and 17-token prompts (shortest first) fit 20
    assert in_place == [1, 1 + 3 + 8 + 17, sum(len(p) for p in mixed_prompts().values())]


@pytest.mark.parametrize("prompts", [mixed_prompts(), same_length_prompts()], ids=["mixed", "same-length"])
def test_greedy_batch_matches_generate(model_dir: Path, hf_models: dict, prompts: dict[str, list[int]]) -> None:
    assert run_core(make_core(model_dir), prompts, NEW_TOKENS) == _expected(hf_models, model_dir, prompts)


def test_prefix_cache_hits_keep_tokens(model_dir: Path, hf_models: dict) -> None:
    prefix = [random.Random(5).randrange(3, VOCAB) for _ in range(40)]
    prompts = mixed_prompts(prefix=prefix)
    core = make_core(model_dir, block_size=8)
    first = {"r0": prompts["r0"]}
    run_core(core, first, NEW_TOKENS)
    got = run_core(core, {r: p for r, p in prompts.items() if r != "r0"}, NEW_TOKENS)
    assert core.stats()["prefix_cache_hits"] >= 7 * 40 // 8 * 8
    expected = _expected(hf_models, model_dir, prompts)
    assert got == {r: t for r, t in expected.items() if r != "r0"}


def test_chunked_prefill_keeps_tokens(model_dir: Path, hf_models: dict) -> None:
    prompts = mixed_prompts()
    core = make_core(model_dir, max_num_batched_tokens=16)
    chunks: list[tuple[str, int, int]] = []
    original = core.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = original()
        chunks.extend((s.req_id, s.start, len(s.token_ids)) for s in out.seqs if len(s.token_ids) > 1)
        assert out.num_tokens <= 16
        return out

    core.scheduler.schedule = spy  # type: ignore[method-assign]
    assert run_core(core, prompts, NEW_TOKENS) == _expected(hf_models, model_dir, prompts)
    r4_chunks = [c for c in chunks if c[0] == "r4"]  # 64 prompt tokens under a 16-token budget
    assert len(r4_chunks) >= 4 and sum(n for _, _, n in r4_chunks) == 64


def test_preemption_keeps_tokens(model_dir: Path, hf_models: dict) -> None:
    prompts = mixed_prompts()
    core = make_core(model_dir, max_model_len=128)
    per_block = core.runner.kv_bytes_per_block()
    core = make_core(model_dir, max_model_len=128, kv_cache_bytes=per_block * 16)  # 16 blocks of 16 tokens
    assert run_core(core, prompts, NEW_TOKENS) == _expected(hf_models, model_dir, prompts)
    assert core.stats()["preemptions_total"] > 0
    assert core.stats()["kv_blocks_free"] == 16


def test_arrivals_during_decode_keep_tokens(model_dir: Path, hf_models: dict) -> None:
    prompts = mixed_prompts()
    arrivals = {0: ["r0", "r1"], 3: ["r2", "r3", "r4"], 10: ["r5", "r6"], 20: ["r7"]}
    got = run_core(make_core(model_dir), prompts, NEW_TOKENS, arrivals)
    assert got == _expected(hf_models, model_dir, prompts)


def test_a_forced_gemm_path_binds_every_cpu_kernel(model_dir: Path) -> None:
    """With a forced GEMM path (the parametrized test below) the engine's CPU kernels (fused add + RMSNorm, RoPE
    in place, paged decode attention, greedy argmax) are bound wherever they apply, untimed; with "auto" (the
    tests above) only those measured faster than torch here are."""
    from engine.layers.attention import PagedAttention
    from engine.layers.norm import RMSNorm
    from engine.models.llama import LlamaAttention

    runner = make_core(model_dir, gemm_path="onednn").runner
    attn = [m for m in runner.model.modules() if isinstance(m, PagedAttention)]
    norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
    ropes = [m for m in runner.model.modules() if isinstance(m, LlamaAttention)]
    assert attn and all(m.kernel is not None for m in attn)
    assert norms and all(m.kernel is not None for m in norms)
    assert ropes and all(m.kernel is not None for m in ropes)
    assert runner.sampler.argmax.__self__ is norms[0].kernel  # type: ignore[attr-defined]
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.plan is not None for m in linears)  # every GEMM as the selection chose


@pytest.mark.parametrize("at", [(True, False, False, False), (False, True, True, True)], ids=["one-row", "batches"])
def test_decode_attention_runs_in_place_only_at_the_batch_classes_chosen(
    model_dir: Path, hf_models: dict, at: tuple[bool, ...]
) -> None:
    """The decode kernel chosen per batch class (engine.kernels.op_choice): a step of one row and steps of several
    each take their class's path, mask or no mask, and the tokens stay transformers'."""
    from engine.kernels.decode_attn import DECODE_ROWS
    from engine.layers.attention import PagedAttention

    core = make_core(model_dir, gemm_path="onednn")  # forced: the decode kernel bound at every class
    layers = [m for m in core.runner.model.modules() if isinstance(m, PagedAttention)]
    assert layers and all(m.kernel is not None for m in layers)
    ran: list[int] = []  # the rows of each call through the kernel
    kernel = layers[0].kernel
    for m in layers:
        m.kernel_at = at
        m.kernel = lambda q, *rest, k=kernel: ran.append(q.shape[0]) or k(q, *rest)  # type: ignore[assignment, misc]
    core.runner.plan_attention()
    assert core.runner.in_place_at == at and not core.runner.attention_in_place and core.runner.prefill_in_place == 0
    prompts = mixed_prompts(4)
    single = {"solo": prompts.pop("r0")}
    assert run_core(core, single, NEW_TOKENS) == _expected(hf_models, model_dir, single)
    assert bool(ran) == at[0] and set(ran) <= {1}
    ran.clear()
    assert run_core(core, prompts, NEW_TOKENS) == _expected(hf_models, model_dir, prompts)
    in_class = [rows for rows in ran if rows > 1]
    assert bool(in_class) == at[1] and all(rows <= DECODE_ROWS[1] for rows in ran)


@pytest.mark.parametrize("prompts", [mixed_prompts(), same_length_prompts()], ids=["mixed", "same-length"])
def test_without_cpu_kernels_the_tokens_are_the_same(
    model_dir: Path, hf_models: dict, prompts: dict[str, list[int]]
) -> None:
    core = make_core(model_dir, cpu_kernels=False)
    assert not any(getattr(m, "kernel", None) for m in core.runner.model.modules())
    plans = [m.plan for m in core.runner.model.modules() if isinstance(m, Linear)]
    assert plans and all(p is not None and set(p.names) == {"onednn"} for p in plans)
    assert run_core(core, prompts, NEW_TOKENS) == hf_expected(hf_models, model_dir, prompts, NEW_TOKENS)


FORCED = sorted({p.name.split("-")[0] for p in gemm_paths(torch.float32, 8, True, True)})


@pytest.mark.parametrize("path", FORCED)
def test_every_gemm_path_forced_in_turn_gives_the_same_tokens(model_dir: Path, hf_models: dict, path: str) -> None:
    """Whatever the selection picks on another CPU, each candidate it can pick is right on its own."""
    core = make_core(model_dir, gemm_path=path)
    plans = [m.plan for m in core.runner.model.modules() if isinstance(m, Linear)]
    if path != "wbf16":  # the bf16-weight kernel takes only weights that are exactly bf16 (test_bf16_weights.py)
        assert plans and all(p is not None and p.names[0].startswith(path) for p in plans)
    prompts = mixed_prompts(4)
    assert run_core(core, prompts, NEW_TOKENS) == _expected(hf_models, model_dir, prompts)
