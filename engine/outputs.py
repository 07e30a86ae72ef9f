"""Plain data passed between scheduler, runner, core and the async front end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.params import SamplingParams


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: tokens [start, start + len(token_ids)) of its sequence."""

    req_id: str
    token_ids: list[int]  # the new input tokens of this step
    start: int  # position of token_ids[0] (= num_computed_tokens before the step)
    block_ids: list[int]  # the whole block table
    sample: bool  # this chunk ends at the sequence's last known token: sample the next one
    params: SamplingParams
    prompt_token_ids: list[int]  # for repetition penalties
    output_token_ids: list[int]  # tokens generated so far (read-only view)
    matcher: Any = None  # the request's grammar matcher (structured outputs): the runner masks its logits


@dataclass(slots=True)
class SchedulerOutput:
    """What to run this step. Decodes (one token each) come before prefill chunks."""

    seqs: list[ScheduledSeq]
    num_decodes: int
    num_tokens: int
    finished_req_ids: list[str] = field(default_factory=list)  # per-request state the runner may drop

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass(slots=True)
class Logprob:
    """The sampled token's log-probability and the top-n alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class ModelOutput:
    """Sampled tokens for the seqs with sample=True, in SchedulerOutput order, less the ones that failed."""

    req_ids: list[str]
    token_ids: list[int]
    logprobs: list[Logprob | None] | None = None  # None where a row did not ask for logprobs
    failed_req_ids: list[str] = field(default_factory=list)  # sampling raised for these: they end with "error"


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class EngineOutput:
    """Token-level output of one step for one request (core → front end)."""

    req_id: str
    new_token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error" (failed alone)
    usage: Usage


@dataclass(slots=True)
class RequestOutput:
    """A delta yielded by AsyncEngine.generate / collected by LLM.generate."""

    req_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[Logprob] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
