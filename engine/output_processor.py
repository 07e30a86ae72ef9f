from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.outputs import EngineOutput, RequestOutput
from engine.params import SamplingParams
from engine.tokenizer import Tokenizer


class OutputProcessor:
    """Token outputs → text deltas. Finds stop strings; the caller must then finish those requests."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer  # None: token ids only (a model directory without tokenizer.json)
        self.detok: dict[str, IncrementalDetokenizer | None] = {}

    def add(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self.tokenizer is None:
            if params.stop:
                raise InvalidRequestError("stop strings need a tokenizer; this model has none", param="stop")
            self.detok[req_id] = None
            return
        self.detok[req_id] = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.stop, include_stop_str_in_output=params.include_stop_str_in_output
        )

    def drop(self, req_id: str) -> None:
        self.detok.pop(req_id, None)

    def process(self, outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the deltas and (req_id, stop string) for requests a stop string just ended."""
        deltas: list[RequestOutput] = []
        stopped: list[tuple[str, str]] = []
        for out in outputs:
            if out.req_id not in self.detok:
                continue
            detok = self.detok[out.req_id]
            finish, stop_reason = out.finish_reason, None
            text, stop = detok.add(out.new_token_ids) if detok is not None and out.new_token_ids else ("", None)
            if stop is not None:
                if finish is None:  # the core does not know yet: the caller finishes the request
                    stopped.append((out.req_id, stop))
                finish, stop_reason = "stop", stop
            elif finish is not None:
                text += detok.flush() if detok is not None else ""
                if finish == "stop" and out.new_token_ids:
                    stop_reason = out.new_token_ids[-1]  # EOS or a stop token id
            if finish is not None:
                del self.detok[out.req_id]
            deltas.append(
                RequestOutput(out.req_id, out.new_token_ids, text, finish, out.usage, out.logprobs, stop_reason)
            )
        return deltas, stopped
