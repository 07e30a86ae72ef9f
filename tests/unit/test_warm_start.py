"""EngineConfig.warm_start: the largest step runs once at start, on placeholders, and leaves nothing behind."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.outputs import Logprob
from engine.sampler import Sampler
from tests.tiny_model import build_tiny_chat_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


class CountingSampler(Sampler):
    """Notes the rows of every batch it samples."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]] = (),
        output_ids: Sequence[Sequence[int]] = (),
    ) -> tuple[list[int], list[Logprob] | None]:
        self.rows.append(len(params))
        return super().__call__(logits, params, generators, prompt_ids, output_ids)


def cfg(path: Path, warm: bool) -> EngineConfig:
    return EngineConfig(model=path, dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, warm_start=warm)


def test_start_runs_the_largest_prefill_and_a_full_decode_step_then_forgets_them(model: Path) -> None:
    sampler = CountingSampler()
    llm = LLM(cfg(model, True), sampler=sampler)
    assert sampler.rows == [8, 8]  # 8 prompts of 32 tokens (256, one step), then one decode step of all 8
    core = llm.core
    stats = core.stats()
    assert not core.has_unfinished() and stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["prefix_cache_hits"] == stats["prefix_cache_queries"] == 0
    assert stats["prompt_tokens_total"] == stats["generation_tokens_total"] == stats["preemptions_total"] == 0
    assert all(r["steps"] == 0 for r in stats["ranks"])


def test_requests_after_a_warm_start_get_what_they_get_without_one(model: Path) -> None:
    prompts = ["Hello world", "The quick brown fox", "What is the capital"]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    cold = [o.token_ids for o in LLM(cfg(model, False)).generate(prompts, params)]
    warm_llm = LLM(cfg(model, True))
    assert [o.token_ids for o in warm_llm.generate(prompts, params)] == cold


def test_no_request_reuses_the_placeholders_cached_blocks(model: Path) -> None:
    """The placeholders' blocks sit in the prefix cache under a salt of their own: even a request with their
    very tokens computes its prompt."""
    llm = LLM(cfg(model, True))
    vocab = llm.core.vocab_size
    first = [j % vocab for j in range(32)]  # the first placeholder's prompt
    llm.generate([first], SamplingParams(max_tokens=1, temperature=0))
    assert llm.core.stats()["prefix_cache_hits"] == 0


def test_a_cache_too_small_for_the_full_step_warms_what_fits(model: Path) -> None:
    per_block = LLM(cfg(model, False)).core.runner.kv_bytes_per_block()
    config = cfg(model, True)
    config.max_model_len, config.kv_cache_bytes = 64, 10 * per_block  # 3 placeholders of 3 blocks, not 8
    sampler = CountingSampler()
    llm = LLM(config, sampler=sampler)
    assert sampler.rows == [3, 3]
    out = llm.generate(["Hello world"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
