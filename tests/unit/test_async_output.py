"""AsyncEngine's output path on a tiny real model: one callback per step, deltas batched when the caller is
behind, stop strings found on the event loop (the engine is told; nothing past the stop is sent)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine import LLM, AsyncEngine, EngineConfig, RequestFailedError, RequestOutput, SamplingParams
from engine.core import EngineCore
from engine.output_processor import Ending, OutputProcessor
from engine.outputs import EngineOutput
from engine.tokenizer import Tokenizer
from tests.tiny_model import build_tiny_chat_model

PROMPTS = ["Hello world", "The capital of France is", "Tianmen is a secure", "How are you today?"]
WAIT_S = 60.0  # a bound on waiting for the engine thread, not a speed requirement


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


def cfg(path: Path, **kw: object) -> EngineConfig:
    return EngineConfig(model=path, **{"dtype": "float32", "enable_prefix_caching": False, **kw})  # type: ignore[arg-type]


def greedy(n: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)  # type: ignore[arg-type]


class CountingCore(EngineCore):
    steps = 0

    def step(self) -> list[EngineOutput]:
        self.steps += 1
        return super().step()


class CountingEngine(AsyncEngine):
    """Counts the callbacks the step thread makes into the event loop."""

    callbacks = 0

    def _receive(self, batch: list[tuple[str, EngineOutput | RequestOutput | BaseException]]) -> None:
        self.callbacks += 1
        super()._receive(batch)


async def idle(engine: AsyncEngine) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        stats = engine.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and engine._inbox.empty():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not finish its work")


async def collect(engine: AsyncEngine, prompt: str, params: SamplingParams, rid: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(engine.tokenizer.encode(prompt), params, rid)]


def text(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


async def test_one_callback_per_step_for_every_stream(model: Path) -> None:
    core = CountingCore(cfg(model))
    engine = CountingEngine(core, Tokenizer.from_files(core.files.read))
    try:
        alone = [text(await collect(engine, p, greedy(), f"a{i}")) for i, p in enumerate(PROMPTS)]
        core.steps, engine.callbacks = 0, 0
        outs = await asyncio.gather(*(collect(engine, p, greedy(), f"b{i}") for i, p in enumerate(PROMPTS * 2)))
        assert [text(o) for o in outs] == alone * 2  # greedy parity with each request alone
        assert all(sum(len(o.new_token_ids) for o in out) == 24 for out in outs)
        # 8 streams x 24 tokens = 192 deltas, delivered in at most one callback per step
        assert core.steps >= 24 and engine.callbacks <= core.steps
    finally:
        await engine.shutdown()


async def test_a_caller_that_falls_behind_gets_what_is_ready_in_one_batch(model: Path) -> None:
    engine = AsyncEngine.from_config(cfg(model))
    try:
        alone = await collect(engine, PROMPTS[1], greedy(), "alone")
        batches = engine.generate_batches(engine.tokenizer.encode(PROMPTS[1]), greedy(), "behind")
        first = await anext(batches)  # what is ready when the caller asks (the first token, unless it is late)
        assert first and first[0].new_token_ids == alone[0].new_token_ids
        await idle(engine)  # the caller sleeps while the engine finishes the request
        rest = await anext(batches)  # then everything else at once
        assert len(first) + len(rest) == 24 and len(rest) > 1 and rest[-1].finish_reason == "length"
        assert text(first + rest) == text(alone) and rest[-1].usage == alone[-1].usage
        with pytest.raises(StopAsyncIteration):
            await anext(batches)
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("include", [False, True])
async def test_stop_strings_found_off_the_step_thread_end_the_request_exactly(model: Path, include: bool) -> None:
    llm = LLM(cfg(model))
    full = llm.generate([PROMPTS[0]], greedy(40))[0].text
    stop = full[9:13]  # likely across tokens; whatever it is, the text ends exactly before (or with) it
    expected = full[: full.index(stop)] + (stop if include else "")
    sync = llm.generate([PROMPTS[0]], greedy(40, stop=[stop], include_stop_str_in_output=include))[0]
    assert sync.text == expected
    engine = AsyncEngine.from_config(cfg(model))
    try:
        params = greedy(400, stop=[stop], include_stop_str_in_output=include)
        batches = engine.generate_batches(engine.tokenizer.encode(PROMPTS[0]), params, "s")
        got = await anext(batches)
        await idle(engine)  # every delta up to the stop is ready together; nothing after it ever comes
        got += [out async for batch in batches for out in batch]
        assert text(got) == expected and got[-1].finish_reason == "stop" and got[-1].stop_reason == stop
        assert got[-1].usage is not None and got[-1].usage.completion_tokens == sync.usage.completion_tokens
        assert sum(len(o.new_token_ids) for o in got) == sync.usage.completion_tokens
        stats = engine.stats()  # the engine was told and let the request go long before max_tokens
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["generation_tokens_total"] < 400
        assert text(await collect(engine, PROMPTS[0], params, "again")) == expected
    finally:
        await engine.shutdown()


class FailsFor(OutputProcessor):
    """Raises outside the detokenizer's own guard for one request."""

    def process_one(self, out: EngineOutput) -> tuple[RequestOutput | None, Ending | None]:
        if out.req_id == "bad":
            raise RuntimeError("boom")
        return super().process_one(out)


async def test_a_fault_in_output_processing_fails_that_request_alone(model: Path) -> None:
    core = EngineCore(cfg(model))
    tokenizer = Tokenizer.from_files(core.files.read)
    engine = AsyncEngine(core, tokenizer)
    engine._loop.processor = FailsFor(tokenizer)
    try:
        good, bad = await asyncio.gather(
            collect(engine, PROMPTS[0], greedy(), "good"),
            collect(engine, PROMPTS[1], greedy(), "bad"),
            return_exceptions=True,
        )
        assert isinstance(bad, RequestFailedError) and isinstance(good, list)
        assert sum(len(o.new_token_ids) for o in good) == 24
        await idle(engine)
        assert engine.healthy and engine.stats()["kv_blocks_used"] == 0
    finally:
        await engine.shutdown()
