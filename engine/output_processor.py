from __future__ import annotations

import logging

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.outputs import EngineOutput, RequestOutput
from engine.params import SamplingParams
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# (req_id, finish reason, stop reason): a request the output processor ended that the core has yet to finish
Ending = tuple[str, str, str | None]


class OutputProcessor:
    """Token outputs → text deltas. Finds stop strings; the caller must then finish those requests."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer  # None: token ids only (a model directory without tokenizer.json)
        self.detok: dict[str, IncrementalDetokenizer | None] = {}
        # the tokens that end a request: never part of its text, even when special tokens are shown
        self.eos_token_ids = eos_token_ids
        self.stop_ids: dict[str, frozenset[int]] = {}

    def check(self, params: SamplingParams) -> None:
        if self.tokenizer is None and params.stop:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none", param="stop")

    def add(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.check(params)
        if self.tokenizer is None:
            self.detok[req_id] = None
            return
        self.detok[req_id] = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        if not params.skip_special_tokens:
            self.stop_ids[req_id] = self.eos_token_ids | frozenset(params.stop_token_ids)

    def drop(self, req_id: str) -> None:
        self.detok.pop(req_id, None)
        self.stop_ids.pop(req_id, None)

    def process(self, outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[Ending]]:
        """The deltas, and the requests that a stop string or a failure here just ended."""
        deltas: list[RequestOutput] = []
        endings: list[Ending] = []
        for out in outputs:
            delta, ending = self.process_one(out)
            if delta is not None:
                deltas.append(delta)
            if ending is not None:
                endings.append(ending)
        return deltas, endings

    def process_one(self, out: EngineOutput) -> tuple[RequestOutput | None, Ending | None]:
        """One request's delta (None: it has ended here already), and its ending if the core must be told."""
        if out.req_id not in self.detok:
            return None, None
        if out.finish_reason == "error":  # failed in the core, which has finished it already
            self.drop(out.req_id)
            return RequestOutput(out.req_id, [], "", "error", out.usage), None
        try:
            delta, stop = self._delta(out)
        except Exception as e:  # one request's detokenizing must not stop the others'
            log.error("request %s failed while detokenizing (%s)", out.req_id, type(e).__name__)
            self.drop(out.req_id)
            return RequestOutput(out.req_id, [], "", "error", out.usage), (out.req_id, "error", None)
        ending: Ending | None = None
        if stop is not None and out.finish_reason is None:  # the core does not know yet
            ending = (out.req_id, "stop", stop)
        if delta.finish_reason is not None:
            self.drop(out.req_id)
        return delta, ending

    def _delta(self, out: EngineOutput) -> tuple[RequestOutput, str | None]:
        detok = self.detok[out.req_id]
        finish, stop_reason = out.finish_reason, None
        ids = out.new_token_ids
        hidden = self.stop_ids.get(out.req_id)
        if hidden and finish == "stop" and ids and ids[-1] in hidden:
            ids = ids[:-1]  # shown special tokens stop short of the EOS (or stop token) that ended the request
        text, stop = detok.add(ids) if detok is not None and ids else ("", None)
        if stop is not None:
            finish, stop_reason = "stop", stop
        elif finish is not None:
            text += detok.flush() if detok is not None else ""
            if finish == "stop" and out.new_token_ids:
                stop_reason = out.new_token_ids[-1]  # EOS or a stop token id
        delta = RequestOutput(out.req_id, out.new_token_ids, text, finish, out.usage, out.logprobs, stop_reason)
        return delta, stop
