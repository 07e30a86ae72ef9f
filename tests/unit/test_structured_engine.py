"""Structured outputs in the engine: llguidance grammars compiled once, a matcher per request, the step's
token bitmask applied by the sampler. A random tiny model is the adversary: only the mask makes its output valid."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from engine import LLM, AsyncEngine, EngineConfig, InvalidRequestError, SamplingParams
from engine.kernels import bitmask as bitmask_kernel
from engine.structured import GrammarMask, StructuredOutputs
from engine.structured.bitmask import apply_torch
from engine.structured.spec import MAX_SPEC_BYTES
from tests.structured_schemas import SCHEMAS
from tests.tiny_model import build_tiny_chat_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(EngineConfig(model=model, dtype="float32", enable_prefix_caching=False))


def constrained(temperature: float = 0.0, max_tokens: int = 200, seed: int = 3, **spec: object) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, structured=StructuredOutputs(**spec)
    )


def test_eight_schemas_in_one_batch_all_validate(llm: LLM) -> None:
    params = [constrained(t, json=s) for t in (0.0, 1.0) for s in SCHEMAS]  # greedy and sampled alike
    outs = llm.generate(["Hello world"] * len(params), params)
    for out, p in zip(outs, params, strict=True):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), p.structured.json)  # type: ignore[union-attr]
    assert llm.core.stats()["kv_blocks_used"] == 0


def test_regex_choice_lark_gbnf_and_json_object(llm: LLM) -> None:
    choices = ("yes", 'a "quoted" \\ one', "中文")
    params = [
        constrained(regex=r"[0-9]{3}-[a-z]{2}"),
        constrained(1.0, choice=choices),
        constrained(grammar='start: "ticket " NUM\nNUM: /[0-9]{1,4}/'),
        constrained(grammar='root ::= "id=" [a-f]{2}'),
        constrained(1.0, json_object=True, max_tokens=400),
    ]
    outs = llm.generate(["Hello world"] * len(params), params)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].text)
    assert outs[1].text in choices
    assert re.fullmatch(r"ticket [0-9]{1,4}", outs[2].text)
    assert re.fullmatch(r"id=[a-f]{2}", outs[3].text)
    if outs[4].finish_reason == "stop":  # an unbounded object may run to max_tokens; if it ended, it is JSON
        assert isinstance(json.loads(outs[4].text), dict)
    else:
        assert outs[4].finish_reason == "length" and outs[4].text.startswith("{")
    assert all(o.finish_reason == "stop" for o in outs[:4])


def test_max_tokens_mid_object_is_length(llm: LLM) -> None:
    out = llm.generate(["Hello world"], constrained(json=SCHEMAS[0], max_tokens=4))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith('{"')
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm: LLM) -> None:
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True)
    prompts = ["Hello world", "The quick brown fox"]
    alone = llm.generate(prompts, [free, seeded])
    mixed = llm.generate(
        [prompts[0], "What is", prompts[1], "Tianmen"],
        [free, constrained(json=SCHEMAS[1]), seeded, constrained(1.0, json=SCHEMAS[3])],
    )
    assert mixed[0].token_ids == alone[0].token_ids
    assert mixed[2].token_ids == alone[1].token_ids  # each row draws from its own generator, mask or no mask


def test_logprobs_are_of_the_constrained_distribution(llm: LLM) -> None:
    params = constrained(1.0, json=SCHEMAS[1])
    params.logprobs = 3
    out = llm.generate(["Hello world"], params)[0]
    assert len(out.logprobs) == len(out.token_ids)
    assert all(lp.logprob > float("-inf") for lp in out.logprobs)  # the sampled token was allowed
    forced = [lp for lp in out.logprobs if lp.logprob == 0.0]  # e.g. the quote after `{`: the only token allowed
    assert forced and all(v == float("-inf") for lp in forced for _, v in lp.top[1:])


def test_a_schema_that_cannot_compile_names_the_problem(llm: LLM) -> None:
    for spec, words in (
        ({"json": {"type": "strin"}}, "strin"),
        ({"json": {"$ref": "#/nope"}}, "nope"),
        ({"regex": "(a"}, "unclosed group"),
        ({"grammar": "start: foo"}, "foo"),
        ({"grammar": "root ::= (("}, "GBNF"),
        ({"grammar": "\n\n"}, "root"),  # the converter's bare Exceptions: no root rule, an unknown rule
        ({"grammar": 'root ::= "a" tail'}, "tail"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(["Hello"], SamplingParams(structured=StructuredOutputs(**spec, field="response_format")))
        assert e.value.param == "response_format" and words in str(e.value), str(e.value)
    assert not llm.core.has_unfinished()


def test_the_spec_is_bounded_and_takes_exactly_one_constraint() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs(regex="a", json_object=True)
    with pytest.raises(InvalidRequestError, match="bytes"):
        StructuredOutputs(regex="a" * (MAX_SPEC_BYTES + 1))
    with pytest.raises(InvalidRequestError, match="choices"):
        StructuredOutputs(choice=tuple(str(i) for i in range(257)))
    with pytest.raises(InvalidRequestError, match="must be an object"):
        StructuredOutputs(json="[1]")
    for spec in ({"choice": ("a", "\ud800")}, {"regex": "a\udfff"}, {"json": {"enum": ["\ud800"]}}):
        with pytest.raises(InvalidRequestError, match="lone surrogate"):
            StructuredOutputs(**spec)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="structured"):
        SamplingParams(structured={"json": {}})  # type: ignore[arg-type]


def test_grammars_are_cached_by_canonical_schema(llm: LLM) -> None:
    compiler = llm._loop.grammars
    assert compiler is not None
    a = compiler.compile(StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = compiler.compile(StructuredOutputs(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}'))
    assert a is b
    assert a.matcher() is not a.matcher()  # each request gets its own matcher


async def test_async_engine_compiles_off_the_loop_and_serves_constrained_requests(model: Path) -> None:
    engine = AsyncEngine.from_config(EngineConfig(model=model, dtype="float32"))
    try:
        ids = engine.tokenizer.encode("Hello world")

        async def run(rid: str, p: SamplingParams) -> str:
            text = ""
            async for out in engine.generate(ids, p, rid):
                text += out.new_text
            return text

        texts = await asyncio.gather(*(run(f"r{i}", constrained(1.0, seed=i, json=s)) for i, s in enumerate(SCHEMAS)))
        for text, schema in zip(texts, SCHEMAS, strict=True):
            jsonschema.validate(json.loads(text), schema)
        with pytest.raises(InvalidRequestError):
            await run("bad", SamplingParams(structured=StructuredOutputs(regex="(")))
        assert engine.healthy and engine.stats()["kv_blocks_used"] == 0
    finally:
        await engine.shutdown()


def test_the_bitmask_kernel_matches_its_torch_definition() -> None:
    k = bitmask_kernel.kernel()
    assert k is not None, "the C kernel should build where tests run (gcc)"
    g = torch.Generator().manual_seed(1)
    for vocab in (1, 31, 33, 400, 49152):
        logits = torch.randn(5, vocab, generator=g)
        words = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int32)
        words[0] = 0
        words[1] = -1
        want = apply_torch(logits.clone(), [4, 0, 2], words)
        assert torch.equal(GrammarMask([4, 0, 2], words).apply(logits), want)
        assert torch.equal(want[[1, 3]], logits[[1, 3]])  # rows without a mask are untouched
        assert torch.isinf(want[4]).all() and torch.equal(want[0], logits[0])
