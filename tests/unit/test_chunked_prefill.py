"""A long prompt arriving while 16 streams decode, on a tiny real model: every step still gives every stream
its token (no step without decode progress), the prompt is prefilled in chunks, and a newcomer's first token
comes in the step after it arrives. Asserted on steps, never on time."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import EngineConfig, SamplingParams
from engine.core import EngineCore
from tests.tiny_model import build_tiny_chat_model

STREAMS = 16
BUDGET, CHUNK = 96, 32  # max_num_batched_tokens, long_prefill_token_threshold
LONG = 300  # prompt tokens: ten chunks


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


def core_for(model: Path) -> EngineCore:
    config = EngineConfig(
        model=model,
        dtype="float32",
        max_num_seqs=32,
        max_num_batched_tokens=BUDGET,
        long_prefill_token_threshold=CHUNK,
        enable_prefix_caching=False,
    )
    return EngineCore(config)


def add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    core.add_request(core.make_request(rid, prompt, params))


def run_alone(core: EngineCore, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    add(core, rid, prompt, max_tokens)
    tokens: list[int] = []
    while core.has_unfinished():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    return tokens


def test_a_long_prompt_never_stalls_the_decoding_streams(model: Path) -> None:
    core = core_for(model)
    rng = random.Random(0)
    vocab = core.vocab_size
    prompts = {f"s{i}": [rng.randrange(vocab) for _ in range(8 + i)] for i in range(STREAMS)}
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        add(core, rid, prompt, 48)
    while not all(tokens.values()):  # until every stream decodes
        for out in core.step():
            tokens[out.req_id] += out.new_token_ids

    long_prompt = [rng.randrange(vocab) for _ in range(LONG)]
    add(core, "long", long_prompt, 4)
    tokens["long"] = []
    steps = 0
    while not tokens["long"]:
        outs = core.step()
        steps += 1
        got = {out.req_id for out in outs}
        assert got >= set(prompts), f"step {steps}: {sorted(set(prompts) - got)} got no token"
        for out in outs:
            tokens[out.req_id] += out.new_token_ids
        if steps == 3:  # a newcomer while the long prompt is still prefilling
            add(core, "new", [5, 6, 7, 8], 4)
            tokens["new"] = []
        if steps == 4:
            assert tokens["new"], "the newcomer's first token did not come in the step after it arrived"
    assert steps == -(-LONG // CHUNK)  # chunked: one chunk of CHUNK tokens a step, next to the decodes
    while core.has_unfinished():
        for out in core.step():
            tokens[out.req_id] += out.new_token_ids
    assert all(len(tokens[rid]) == 48 for rid in prompts)

    # greedy parity: what each stream got under load is what it gets alone
    for rid in ("s0", "s7", "s15"):
        assert run_alone(core, f"{rid}-alone", prompts[rid], 48) == tokens[rid]
    assert run_alone(core, "long-alone", long_prompt, 4) == tokens["long"]
    assert core.stats()["kv_blocks_used"] == 0
