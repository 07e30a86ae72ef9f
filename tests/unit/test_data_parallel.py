"""Data parallel: two real engine replicas behind one front (the tiny chat model, float32, CPU)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.data_parallel import DataParallelEngine
from engine.outputs import RequestOutput
from tests.tiny_model import build_tiny_chat_model

WAIT_S = 120  # a generous bound: the test fails rather than hangs


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


def _engine(model: Path, **kw: object) -> DataParallelEngine:
    config = EngineConfig(model=model, dtype="float32", device="cpu", max_num_seqs=4, block_size=8, **kw)  # type: ignore[arg-type]
    engine = AsyncEngine.from_config(config)
    assert isinstance(engine, DataParallelEngine)
    return engine


async def _run(
    engine: DataParallelEngine, rid: str, prompt: list[int], n: int, salt: str | None
) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [out async for out in engine.generate(prompt, params, rid, salt)]


def _generated(engine: DataParallelEngine) -> list[int]:
    return [s["generation_tokens_total"] for s in engine.stats()["replicas"]]


async def test_requests_spread_over_both_replicas_and_prefix_hits_stay_with_their_replica(model: Path) -> None:
    engine = _engine(model, data_parallel_size=2)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 300) for _ in range(48)]  # 6 full blocks
    try:
        # a long request keeps replica 0 busy: the next one goes to the least loaded replica, 1
        blocker = asyncio.create_task(_run(engine, "blocker", [5, 6, 7], 200, "t1"))
        while engine.replicas[0].num_active == 0:
            await asyncio.sleep(0.005)
        assert engine.route(prompt, "t1") == 1
        first = await asyncio.wait_for(_run(engine, "first", prompt, 4, "t1"), WAIT_S)
        await asyncio.wait_for(blocker, WAIT_S)
        assert all(g > 0 for g in _generated(engine))  # both replicas served
        assert first[-1].usage is not None and first[-1].usage.cached_tokens == 0

        # both idle now, so load alone would pick replica 0; the cached prefix is on replica 1
        hits_before = [s["prefix_cache_hits"] for s in engine.stats()["replicas"]]
        second = await asyncio.wait_for(_run(engine, "second", [*prompt, 9, 10], 4, "t1"), WAIT_S)
        hits_after = [s["prefix_cache_hits"] for s in engine.stats()["replicas"]]
        assert second[-1].usage is not None and second[-1].usage.cached_tokens == 48
        assert hits_after[1] - hits_before[1] == 48 and hits_after[0] == hits_before[0]

        # another tenant never sees that prefix: no hit anywhere, so the least loaded (first) replica
        assert engine.route([*prompt, 9, 10], "t2") == 0
        other = await asyncio.wait_for(_run(engine, "other", [*prompt, 9, 10], 4, "t2"), WAIT_S)
        assert other[-1].usage is not None and other[-1].usage.cached_tokens == 0
        assert [o.new_token_ids for o in other] == [o.new_token_ids for o in second]  # same model on both

        s = engine.stats()
        assert s["kv_blocks_total"] == sum(r["kv_blocks_total"] for r in s["replicas"])
        assert [r["replica"] for r in s["ranks"]] == [0, 1]
        assert engine.healthy and engine.ready
    finally:
        await engine.shutdown()


async def test_tp2_by_dp2_serves_on_every_replica(model: Path) -> None:
    single = AsyncEngine.from_config(EngineConfig(model=model, dtype="float32", device="cpu", block_size=8))
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23]]
    try:
        expected = [await _run(single, f"s{i}", p, 6, None) for i, p in enumerate(prompts)]  # type: ignore[arg-type]
    finally:
        await single.shutdown()
    engine = _engine(model, data_parallel_size=2, tensor_parallel_size=2)
    try:
        got = await asyncio.wait_for(
            asyncio.gather(*(_run(engine, f"r{i}", p, 6, None) for i, p in enumerate(prompts))), WAIT_S
        )
        assert [[t for o in out for t in o.new_token_ids] for out in got] == [
            [t for o in out for t in o.new_token_ids] for out in expected
        ]
        assert all(g == 6 for g in _generated(engine))  # one request on each replica
        ranks = engine.stats()["ranks"]
        assert [(r["replica"], r["rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    finally:
        await engine.shutdown()
