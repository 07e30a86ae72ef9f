"""SamplingParams refuses what the engine or torch cannot represent, naming the field; seeds map into torch's range."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.params import MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS, SamplingParams, torch_seed
from engine.request import check_prompt

NAN, INF = math.nan, math.inf
FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        *[({name: value}, name) for name in FLOATS for value in (NAN, INF, -INF, "1", True, None)],
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 100.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-39}, "repetition_penalty"),
        ({"repetition_penalty": 101}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"presence_penalty": 2**70}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 16.0}, "max_tokens"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": False}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": True}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": "abc"}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: NAN}}, "logit_bias"),
        ({"logit_bias": {5: "1"}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ],
)
def test_bad_params_raise_typed_errors(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and str(e.value).startswith(param)


def test_limits_themselves_are_accepted() -> None:
    p = SamplingParams(
        temperature=100,
        top_p=1,
        min_p=1,
        repetition_penalty=0.01,
        presence_penalty=-2,
        frequency_penalty=2,
        logprobs=20,
        stop=["s" * MAX_STOP_STRING_CHARS] * 16,
        stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
        logit_bias={i: -100 for i in range(MAX_LOGIT_BIAS)},
    )
    assert p.logit_bias is not None and all(type(v) is float for v in p.logit_bias.values())


def test_lists_are_copied_so_later_edits_bypass_nothing() -> None:
    stop, bias = ["a"], {1: 1.0}
    p = SamplingParams(stop=stop, logit_bias=bias)
    stop.append("")
    bias[2] = math.nan
    assert p.stop == ["a"] and p.logit_bias == {1: 1.0}


def test_model_dependent_bounds_name_the_limit() -> None:
    with pytest.raises(InvalidRequestError, match=r"top_k must be in \[0, 400\]") as e:
        SamplingParams(top_k=9223372036854775808).check(vocab_size=400, max_model_len=512)
    assert e.value.param == "top_k" and "vocabulary size" in str(e.value)
    SamplingParams(top_k=400).check(vocab_size=400, max_model_len=512)
    with pytest.raises(InvalidRequestError, match=r"max_tokens must be in \[1, 512\]") as e:
        SamplingParams(max_tokens=513).check(vocab_size=400, max_model_len=512)
    assert "context length" in str(e.value)
    with pytest.raises(InvalidRequestError, match=r"\[0, 400\)") as e:
        SamplingParams(stop_token_ids=[400]).check(vocab_size=400, max_model_len=512)
    assert e.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError, match=r"\[0, 400\)") as e:
        SamplingParams(logit_bias={400: 1.0}).check(vocab_size=400, max_model_len=512)
    assert e.value.param == "logit_bias"


def test_huge_values_give_short_messages() -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(top_k=10**4000).check(vocab_size=400)
    assert len(str(e.value)) < 200 and "bits" in str(e.value)


def test_tiny_temperatures_sample_greedily() -> None:
    assert SamplingParams(temperature=1e-6).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def draw(seed: int) -> list[float]:
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.empty(4).exponential_(generator=g).tolist()


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 2**200, -(2**200)])
def test_every_int_seed_is_accepted_and_maps_into_torch(seed: int) -> None:
    assert SamplingParams(seed=seed).seed == seed
    mapped = torch_seed(seed)
    assert 0 <= mapped < 2**64 and mapped == torch_seed(seed % 2**64)
    torch.Generator().manual_seed(mapped)


def test_distinct_64_bit_seeds_sample_differently_even_on_cpu() -> None:
    # torch's CPU generator keeps only a seed's low 32 bits: unmixed, these pairs would sample alike
    assert draw(2**63 - 1) == draw(2**64 - 1) and draw(5) == draw(5 + 2**32)
    assert draw(torch_seed(2**63 - 1)) != draw(torch_seed(2**64 - 1))
    assert draw(torch_seed(5)) != draw(torch_seed(5 + 2**32))
    assert len({torch_seed(s) for s in range(-1000, 1000)}) == 2000
    assert draw(torch_seed(7)) == draw(torch_seed(7))  # same seed, same draws
    assert torch_seed(2**64 + 5) == torch_seed(5) and torch_seed(-1) == torch_seed(2**64 - 1)  # wraps mod 2**64


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([], "empty"),
        (list(range(16)), "context length is 16"),
        ([5, 400], r"\[0, 400\)"),
        ([5, -1], r"\[0, 400\)"),
        ([5, True], "integers"),
        ([5, 1.0], "integers"),
        ("abc", "list of token ids"),
    ],
)
def test_prompts_must_fit_the_model(prompt: Any, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        check_prompt(prompt, vocab_size=400, max_model_len=16)


def test_a_fitting_prompt_is_copied() -> None:
    ids = (1, 2, 399)
    assert check_prompt(ids, vocab_size=400, max_model_len=16) == [1, 2, 399]
