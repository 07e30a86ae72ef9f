"""The engine's public surface on a tiny real model: typed errors, abort, stops, stats."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import (
    LLM,
    AsyncEngine,
    ConfigError,
    EngineConfig,
    InvalidRequestError,
    ModelLoadError,
    SamplingParams,
)
from tests.tiny_model import build_tiny_chat_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


def cfg(path: Path, **kw: object) -> EngineConfig:
    return EngineConfig(model=path, **{"dtype": "float32", **kw})  # type: ignore[arg-type]


def test_bad_model_directories_raise_model_load_error(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(cfg(tmp_path / "nowhere"))
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON"):
        LLM(cfg(broken))
    (broken / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported model architecture"):
        LLM(cfg(broken))
    shutil.copy(model / "config.json", broken / "config.json")
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        LLM(cfg(broken))


def test_bad_config_values_say_what_to_change(model: Path) -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        cfg(model, max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ConfigError, match="dtype"):
        cfg(model, dtype="int3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kv_cache_bytes"):
        LLM(cfg(model, kv_cache_bytes=1024))
    for bad in ("on", "", "PROGRAM", None):
        with pytest.raises(ConfigError, match="decode_program must be one of auto, program, layers"):
            cfg(model, decode_program=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("machine", "avx512_bf16", "amx", "expected"),
    [
        ("x86_64", True, False, torch.bfloat16),  # Zen 4, Cooper Lake: native bf16
        ("x86_64", False, True, torch.bfloat16),  # Sapphire Rapids: AMX
        ("x86_64", False, False, torch.float32),  # Cascade Lake, Zen 2/3: oneDNN would only emulate bf16
        ("aarch64", False, False, torch.bfloat16),  # ARM: oneDNN's own check (patched to True below) decides
    ],
)
def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it(
    model: Path, monkeypatch: pytest.MonkeyPatch, machine: str, avx512_bf16: bool, amx: bool, expected: torch.dtype
) -> None:
    monkeypatch.setattr("engine.config.platform.machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # what oneDNN says on AVX-512
    assert EngineConfig(model=model, dtype="auto", device="cpu").torch_dtype == expected
    assert EngineConfig(model=model, dtype="float32", device="cpu").torch_dtype == torch.float32


def test_prompt_too_long_is_refused(model: Path) -> None:
    llm = LLM(cfg(model, max_model_len=32))
    with pytest.raises(InvalidRequestError, match="context length is 32"):
        llm.generate([list(range(40))])


def test_max_model_len_ends_generation(model: Path) -> None:
    llm = LLM(cfg(model, max_model_len=32))
    out = llm.generate([list(range(5, 25))], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12


def test_stop_strings_end_requests_and_free_blocks(model: Path) -> None:
    llm = LLM(cfg(model))
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = llm.generate(["Hello world"], greedy)[0]
    stop = full.text[4:7]
    out = llm.generate(["Hello world"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    assert llm.core.stats()["kv_blocks_used"] == 0


def test_async_abort_returns_every_block(model: Path) -> None:
    async def run() -> None:
        engine = AsyncEngine.from_config(cfg(model))
        try:
            params = SamplingParams(max_tokens=10_000 // 20, temperature=0, ignore_eos=True)
            ids = engine.tokenizer.encode("Hello world " * 10)
            seen = 0
            async for out in engine.generate(ids, params, "r1"):
                seen += len(out.new_token_ids)
                if seen >= 3:
                    assert engine.stats()["kv_blocks_used"] > 0
                    break  # leaving the iterator aborts the request
            for _ in range(200):
                if engine.stats()["kv_blocks_used"] == 0:
                    break
                await asyncio.sleep(0.02)
            stats = engine.stats()
            assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
            # explicit abort of a running request ends its stream with finish_reason "abort"
            outs = []

            async def consume() -> None:
                async for out in engine.generate(ids, params, "r2"):
                    outs.append(out)
                    if len(outs) == 2:
                        await engine.abort("r2")

            await consume()
            assert outs[-1].finish_reason == "abort" and engine.stats()["kv_blocks_used"] == 0
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_async_errors_are_typed(model: Path) -> None:
    async def run() -> None:
        engine = AsyncEngine.from_config(cfg(model, max_model_len=16))
        try:
            with pytest.raises(InvalidRequestError, match="context length"):
                async for _ in engine.generate(list(range(5, 30)), SamplingParams(), "r"):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(run())


async def test_the_issue_s_seeds_and_top_k_no_longer_stop_the_engine(model: Path) -> None:
    engine = AsyncEngine.from_config(cfg(model, enable_prefix_caching=False))
    ids = engine.tokenizer.encode("Hello world")

    async def run(rid: str, **kw: object) -> list[int]:
        params = SamplingParams(max_tokens=8, temperature=0.9, ignore_eos=True, **kw)  # type: ignore[arg-type]
        tokens: list[int] = []
        async for out in engine.generate(ids, params, rid):
            tokens += out.new_token_ids
        return tokens

    try:
        # each alone, so equal seeds see equal batches
        huge, low = await run("s1", seed=2**64), await run("s2", seed=-(2**63) - 1)
        top, wrapped = await run("s3", seed=2**64 - 1), await run("s4", seed=2**64 - 1 + 1)  # n=2: seed + i
        assert all(len(t) == 8 for t in (huge, low, top, wrapped))
        assert await run("s5", seed=2**64) == huge  # same seed, same tokens
        assert await run("s6", seed=0) == huge == wrapped  # 2**64 wraps to 0 (engine.params.torch_seed)
        assert await run("s7", seed=-1) == top  # and -1 to 2**64 - 1
        with pytest.raises(InvalidRequestError, match="vocabulary size") as e:
            await run("k", top_k=9223372036854775808)
        assert e.value.param == "top_k"
        assert engine.healthy and len(await run("after")) == 8
    finally:
        await engine.shutdown()


async def test_invalid_requests_are_refused_before_anything_is_queued(model: Path) -> None:
    engine = AsyncEngine.from_config(cfg(model))
    vocab = engine.core.vocab_size
    ids = engine.tokenizer.encode("Hello world")
    cases: list[tuple[list[int], SamplingParams, str]] = [
        (ids, SamplingParams(top_k=vocab + 1), "top_k"),
        (ids, SamplingParams(max_tokens=engine.max_model_len + 1), "max_tokens"),
        (ids, SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
        (ids, SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
        ([5, vocab], SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
    ]
    try:
        for prompt, params, param in cases:
            with pytest.raises(InvalidRequestError) as e:
                async for _ in engine.generate(prompt, params, "x"):
                    pass
            assert e.value.param == param
            assert engine._inbox.empty()  # the step thread never saw it
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        first = engine.generate(ids, params, "dup")
        out = await anext(first)
        with pytest.raises(InvalidRequestError, match="already in use"):
            async for _ in engine.generate(ids, params, "dup"):
                pass
        tokens = list(out.new_token_ids)
        async for out in first:
            tokens += out.new_token_ids
        assert len(tokens) == 6 and out.finish_reason == "length"
    finally:
        await engine.shutdown()


def test_one_bad_prompt_in_a_batch_queues_none_of_it(model: Path) -> None:
    llm = LLM(cfg(model))
    good = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["Hello", "world"], [good, SamplingParams(top_k=10**6)])
    assert e.value.param == "top_k" and not llm.core.has_unfinished()
    assert [len(c.token_ids) for c in llm.generate(["Hello", "world"], good)] == [3, 3]


def test_logit_bias_steers_a_real_model(model: Path) -> None:
    llm = LLM(cfg(model))

    def first_tokens(bias: dict[int, float] | None) -> list[int]:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias=bias)
        return llm.generate(["Hello world"], params)[0].token_ids

    plain = first_tokens(None)
    assert first_tokens({plain[0]: -100})[0] != plain[0]
    assert first_tokens({42: 100}) == [42] * 4
