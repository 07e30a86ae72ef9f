from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequestError
from engine.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """One generation request as the scheduler sees it: token ids and progress, nothing else."""

    __slots__ = (
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "eos_token_ids",
        "finish_reason",
        "matcher",
        "max_len",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "output_token_ids",
        "params",
        "pin_prefix",
        "pinned_tokens",
        "prompt_token_ids",
        "req_id",
        "status",
        "stop_reason",
        "stop_token_ids",
        "token_ids",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        cache_salt: str | None = None,
        max_len: int | None = None,
        matcher: Any = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output: what a recompute after preemption re-reads
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.cache_salt = cache_salt
        self.max_len = max_len  # model length limit: prompt + output never exceed it
        self.matcher = matcher  # llguidance.LLMatcher of a structured-output request: it sees every output token
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first admission; -1 until then
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.arrival_time = time.monotonic()
        self.pin_prefix = False  # a warm-up: its prompt's cached full blocks are pinned when it finishes
        self.pinned_tokens = 0  # after a warm-up finished: the tokens it pinned (-1: the KV cache had no room)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> bool:
        """Record a sampled token; False if the request's grammar refuses it (the request cannot go on)."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        return self.matcher is None or self.matcher.consume_token(token_id)

    def check_stop(self) -> bool:
        """After a new token: decide whether it ends the request (EOS, stop token, finished grammar, length)."""
        token = self.output_token_ids[-1]
        if (not self.params.ignore_eos and token in self.eos_token_ids) or token in self.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif self.matcher is not None and self.matcher.is_stopped():  # the grammar is complete: nothing may follow
            self.finish_reason = "stop"
        elif self.num_output_tokens >= self.params.max_tokens or (
            self.max_len is not None and self.num_tokens >= self.max_len
        ):
            self.finish_reason = "length"
        return self.finish_reason is not None


def check_prompt(prompt_token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list, if it fits the model: non-empty, shorter than the context, ids in the vocabulary."""
    if not isinstance(prompt_token_ids, list | tuple):
        raise InvalidRequestError("the prompt must be a list of token ids", param="prompt")
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if n >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens, but this model's context length is {max_model_len} tokens "
            "(prompt + completion); shorten the prompt",
            param="messages",
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})", param="prompt")
    return list(prompt_token_ids)
