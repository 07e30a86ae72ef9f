"""Warm-up on a tiny real model: pinned prefixes are hit under their salt only and survive KV pressure."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine import AsyncEngine, ConfigError, EngineConfig, InvalidRequestError, SamplingParams
from tests.tiny_model import build_tiny_chat_model

BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


def engine(model: Path, **kw: object) -> AsyncEngine:
    return AsyncEngine.from_config(
        EngineConfig(model=model, dtype="float32", block_size=BLOCK, **kw)  # type: ignore[arg-type]
    )


async def cached(e: AsyncEngine, prompt: list[int], salt: str, rid: str, max_tokens: int = 2) -> int:
    usage = None
    async for out in e.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0), rid, cache_salt=salt):
        usage = out.usage or usage
    assert usage is not None
    return usage.cached_tokens


def test_a_pinned_prefix_is_hit_under_its_salt_only_and_survives_pressure(model: Path) -> None:
    # 8 sequences of max_model_len=128 tokens: 64 blocks; the warm prefix pins 3 of them
    e = engine(model, max_model_len=128, kv_cache_bytes=None, max_num_seqs=8)
    try:
        prefix = [(7 * i) % 300 + 3 for i in range(3 * BLOCK + 5)]
        assert e.pin_prefix(prefix, "acme") == 3 * BLOCK
        stats = e.stats()
        assert stats["kv_blocks_pinned"] == 3 and stats["prefix_cache_pinned_tokens"] == 3 * BLOCK
        assert stats["kv_blocks_used"] == 3  # counted against the KV budget
        total = int(stats["kv_blocks_total"])

        async def run() -> None:
            assert await cached(e, [*prefix, 11, 12], "acme", "a") >= 3 * BLOCK
            assert await cached(e, [*prefix, 11, 12], "globex", "b") == 0  # another tenant's salt
            # pressure: distinct prompts that together need every unpinned block many times over
            for wave in range(3):
                prompts = [[(wave * 97 + i * 31 + k) % 390 + 1 for k in range(100)] for i in range(8)]
                await asyncio.gather(*(cached(e, p, "acme", f"p{wave}-{i}", 20) for i, p in enumerate(prompts)))
            assert e.stats()["kv_blocks_free"] == total - 3  # everything else came back
            assert await cached(e, [*prefix, 13], "acme", "c") >= 3 * BLOCK

        asyncio.run(run())
        assert e.stats()["kv_blocks_pinned"] == 3
    finally:
        asyncio.run(e.shutdown())


def test_warm_up_refuses_prompts_that_do_not_fit(model: Path) -> None:
    e = engine(model, max_model_len=64, kv_cache_bytes=None, max_num_seqs=1)  # 4 blocks: one sequence, no spare
    try:
        with pytest.raises(ConfigError, match="kv_cache_bytes"):
            e.pin_prefix(list(range(3, 3 + 2 * BLOCK + 1)), "acme")
        assert e.stats()["kv_blocks_pinned"] == 0 and e.stats()["kv_blocks_free"] == 4
        with pytest.raises(InvalidRequestError, match="context length"):
            e.pin_prefix(list(range(3, 3 + 64)), "acme")
    finally:
        asyncio.run(e.shutdown())
