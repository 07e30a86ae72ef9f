from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutputs

MAX_TOP_LOGPROBS = 20
# OpenAI's API stops at 2; past ~100 every distribution is uniform to float32 precision, so higher values only
# hide client bugs. Below GREEDY_TEMPERATURE the request samples greedily: logits / t would overflow float32.
MAX_TEMPERATURE = 100.0
GREEDY_TEMPERATURE = 1e-5
# logits are multiplied or divided by it: outside this range they overflow to inf or collapse to 0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # the detokenizer withholds up to this much text and searches it on every token
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit
MAX_ABS_LOGIT_BIAS = 100.0
SEED_MODULUS = 1 << 64
_MASK64 = SEED_MODULUS - 1


def torch_seed(seed: int) -> int:
    """What torch.Generator.manual_seed gets for a request's seed: splitmix64(seed mod 2**64).

    The mix is a bijection of [0, 2**64), so distinct 64-bit seeds stay distinct, and it makes the low 32 bits,
    all that CPU generators (mt19937) keep, depend on every bit. Any Python int is taken mod 2**64 first.
    """
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction (InvalidRequestError naming the field)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # any int; see torch_seed
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n >= 0: sampled token's logprob plus the top n
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    structured: StructuredOutputs | None = None  # the output must match this grammar (a token mask per step)
    skip_special_tokens: bool = True  # False: special tokens' text is in the output (tool-call markers)

    def __post_init__(self) -> None:
        self.check()

    def check(self, vocab_size: int | None = None, max_model_len: int | None = None) -> None:
        """Validate every field; with a model's vocab_size and max_model_len, the model-dependent bounds too."""
        _int("max_tokens", self.max_tokens, 1, max_model_len, "this model's context length")
        _number("temperature", self.temperature, 0, MAX_TEMPERATURE)
        _number("top_p", self.top_p, 0, 1, low_open=True)
        _int("top_k", self.top_k, 0, vocab_size, "the vocabulary size; 0 disables it")
        _number("min_p", self.min_p, 0, 1)
        _number("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        _number("presence_penalty", self.presence_penalty, -2, 2)
        _number("frequency_penalty", self.frequency_penalty, -2, 2)
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", f"must be an integer, got {_show(self.seed)}")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS, vocab_size)
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise _bad("structured", f"must be a StructuredOutputs, got {_show(self.structured)}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, f"must be true or false, got {_show(getattr(self, name))}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias, vocab_size)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _bad(param: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {why}", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    # a huge int would be a huge message (and repr past 4300 digits raises); content is never echoed
    if _is_int(value) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, bool | int | float) or value is None:
        return repr(value)
    return f"a {type(value).__name__}"


def _int(param: str, value: Any, low: int, high: int | None = None, high_is: str = "") -> None:
    if not _is_int(value):
        raise _bad(param, f"must be an integer, got {_show(value)}")
    if value < low or (high is not None and value > high):
        where = f">= {low}" if high is None else f"in [{low}, {high}]" + (f" ({high_is})" if high_is else "")
        raise _bad(param, f"must be {where}, got {_show(value)}")


def _number(param: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(param, f"must be a number, got {_show(value)}")
    if (_is_int(value) and value.bit_length() > 64) or not math.isfinite(value):
        raise _bad(param, f"must be a finite number, got {_show(value)}")
    if not (low < value if low_open else low <= value) or value > high:
        raise _bad(param, f"must be in {'(' if low_open else '['}{low}, {high}], got {_show(value)}")


def _stop_strings(stop: Any) -> list[str]:
    if not isinstance(stop, list | tuple):
        raise _bad("stop", f"must be a list of strings, got {_show(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"accepts at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str):
            raise _bad("stop", f"must be a list of strings, got {_show(s)} in it")
        if not s:
            raise _bad("stop", "must not contain empty strings")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise _bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
    return list(stop)


def _token_id(param: str, token: Any, vocab_size: int | None) -> None:
    if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
        where = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise _bad(param, f"token ids must be integers in {where}, got {_show(token)}")


def _token_ids(param: str, ids: Any, max_len: int, vocab_size: int | None) -> list[int]:
    if not isinstance(ids, list | tuple):
        raise _bad(param, f"must be a list of token ids, got {_show(ids)}")
    if len(ids) > max_len:
        raise _bad(param, f"accepts at most {max_len} token ids, got {len(ids)}")
    for t in ids:
        _token_id(param, t, vocab_size)
    return list(ids)


def _logit_bias(bias: Any, vocab_size: int | None) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise _bad("logit_bias", f"must map token ids to numbers, got {_show(bias)}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"accepts at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    for token, value in bias.items():
        _token_id("logit_bias", token, vocab_size)
        _number("logit_bias", value, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
    return {int(t): float(v) for t, v in bias.items()}
