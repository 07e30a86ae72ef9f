"""Which failures stop what: one request's fault fails it alone; a failed step stops the engine, loudly."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine import LLM, AsyncEngine, EngineConfig, EngineDeadError, RequestFailedError, SamplingParams
from engine.core import EngineCore
from engine.outputs import Logprob
from engine.sampler import Sampler
from engine.tokenizer import Tokenizer
from tests.tiny_model import build_tiny_chat_model

HANG_GUARD_S = 300  # only so that a regression (a caller never told) fails instead of hanging the suite


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


def cfg(path: Path) -> EngineConfig:
    # no prefix caching: a cached prefix would change the second run's batch shapes, and so its floats
    return EngineConfig(model=path, dtype="float32", enable_prefix_caching=False)


class PoisonedSampler(Sampler):
    """Raises for any batch holding `poison`, after drawing from every generator as a late fault would."""

    def __init__(self) -> None:
        super().__init__()
        self.poison: SamplingParams | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]] = (),
        output_ids: Sequence[Sequence[int]] = (),
    ) -> tuple[list[int], list[Logprob] | None]:
        result = super().__call__(logits, params, generators, prompt_ids, output_ids)
        if any(p is self.poison for p in params):
            raise RuntimeError("injected fault: secret prompt text")
        return result


def test_a_sampling_fault_fails_its_request_alone(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    sampler = PoisonedSampler()
    llm = LLM(cfg(model), sampler=sampler)
    prompts = ["Hello world", "The quick brown fox", "What is the capital"]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True, logprobs=2)
    # the baseline's third request ends after its first token, when the poisoned one will fail:
    # from there on both runs step the same two requests
    baseline = llm.generate(prompts, [greedy, seeded, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)])
    sampler.poison = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    caplog.set_level(logging.ERROR)
    out = llm.generate(prompts, [greedy, seeded, sampler.poison])
    assert out[2].finish_reason == "error" and out[2].token_ids == []
    assert [o.finish_reason for o in out[:2]] == ["length", "length"]
    assert out[0].token_ids == baseline[0].token_ids  # greedy: identical
    assert out[1].token_ids == baseline[1].token_ids  # seeded: each generator drew once, not twice
    assert out[1].logprobs == baseline[1].logprobs
    assert len(set(out[1].token_ids)) > 1  # it really samples
    assert llm.core.stats()["kv_blocks_used"] == 0
    assert "failed while sampling (RuntimeError)" in caplog.text and "secret" not in caplog.text
    again = llm.generate(prompts[:1], greedy)[0]  # the engine goes on
    assert again.token_ids == baseline[0].token_ids


async def test_async_sampling_fault_leaves_the_engine_healthy(model: Path) -> None:
    sampler = PoisonedSampler()
    core = EngineCore(cfg(model), sampler=sampler)
    engine = AsyncEngine(core, Tokenizer.from_files(core.files.read))
    try:
        ids = engine.tokenizer.encode("Hello world")
        greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        sampler.poison = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

        async def collect(rid: str, p: SamplingParams) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate(ids, p, rid):
                tokens += out.new_token_ids
                assert out.finish_reason in (None, "length")
            return tokens

        a, bad, b = await asyncio.wait_for(
            asyncio.gather(
                collect("a", greedy), collect("bad", sampler.poison), collect("b", greedy), return_exceptions=True
            ),
            HANG_GUARD_S,
        )
        assert isinstance(bad, RequestFailedError) and "bad" in str(bad)
        assert isinstance(a, list) and len(a) == 20 and a == b
        assert engine.healthy and engine.ready
        assert await asyncio.wait_for(collect("after", greedy), HANG_GUARD_S) == a
        stats = engine.stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    finally:
        await engine.shutdown()


async def test_a_failed_forward_pass_stops_the_engine_and_tells_every_caller(model: Path) -> None:
    engine = AsyncEngine.from_config(cfg(model))
    ids = engine.tokenizer.encode("Hello world")
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    running = asyncio.Event()
    hooks = []

    def out_of_memory(module: torch.nn.Module, args: object) -> None:
        raise RuntimeError("injected: out of memory")

    async def consume(rid: str) -> None:
        async for _ in engine.generate(ids, params, rid):
            if not hooks and running.is_set():
                hooks.append(engine.core.runner.model.register_forward_pre_hook(out_of_memory))
            running.set()

    try:
        tasks = [asyncio.create_task(consume(r)) for r in ("a", "b")]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), HANG_GUARD_S)
        assert hooks and all(isinstance(r, EngineDeadError) for r in results), results
        assert not engine.healthy and not engine.ready
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate(ids, params, "c"):
                pass
    finally:
        for h in hooks:
            h.remove()
        await engine.shutdown()


async def test_an_unwritable_profile_trace_is_logged_and_the_engine_steps_on(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    engine = AsyncEngine.from_config(cfg(model))
    ids = engine.tokenizer.encode("Hello world")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def run(rid: str) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(ids, params, rid):
            tokens += out.new_token_ids
        return tokens

    try:
        # its directory is a regular file: tests run as root, so permission bits would not stop the write
        target = blocker / "trace.json"
        engine.profile(2, target)
        assert len(await asyncio.wait_for(run("r1"), HANG_GUARD_S)) == 4
        assert engine.healthy
        assert f"could not write the profile trace to {target}" in caplog.text
        good = tmp_path / "trace.json"
        engine.profile(2, good)
        assert len(await asyncio.wait_for(run("r-good"), HANG_GUARD_S)) == 4
        assert "traceEvents" in json.loads(good.read_text())
        assert f"wrote a profile of engine steps to {good}" in caplog.text
    finally:
        await engine.shutdown()


async def test_shutdown_tells_waiting_callers_and_refuses_new_ones(model: Path) -> None:
    engine = AsyncEngine.from_config(cfg(model))
    ids = engine.tokenizer.encode("Hello world")
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    stream = engine.generate(ids, params, "long")
    await anext(stream)
    await engine.shutdown()
    with pytest.raises(EngineDeadError, match="shutting down"):
        async for _ in stream:
            pass
    with pytest.raises(EngineDeadError, match="shutting down"):
        async for _ in engine.generate(ids, params, "late"):
            pass
