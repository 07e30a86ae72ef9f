"""Greedy parity with transformers for unconstrained requests that share their batches with constrained ones."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.structured import StructuredOutputs
from tests.parity.conftest import hf_greedy, hf_model
from tests.structured_schemas import SCHEMAS
from tests.tiny_model import build_tiny_chat_model

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


def test_unconstrained_greedy_matches_transformers_beside_constrained_rows(model: Path) -> None:
    llm = LLM(EngineConfig(model=model, dtype="float32", device="cpu", max_num_seqs=8))
    assert llm.tokenizer is not None
    texts = ["Hello world", "The capital of France", "天门是一个", "The quick brown fox jumps"]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    free = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    batch, params = [], []
    for i, p in enumerate(prompts):  # free and constrained rows interleaved, greedy and sampled constraints
        batch += [p, p]
        params += [
            free,
            SamplingParams(max_tokens=200, temperature=i % 2, seed=i, structured=StructuredOutputs(json=SCHEMAS[i])),
        ]
    outs = llm.generate(batch, params)
    hf = hf_model({}, model)
    for i, p in enumerate(prompts):
        assert outs[2 * i].token_ids == hf_greedy(hf, p, NEW_TOKENS)
        jsonschema.validate(json.loads(outs[2 * i + 1].text), SCHEMAS[i])
