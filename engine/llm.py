from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import InvalidRequestError
from engine.loader import ModelFiles
from engine.output_processor import OutputProcessor
from engine.outputs import Logprob, Usage
from engine.params import SamplingParams
from engine.request import Request
from engine.tokenizer import Tokenizer


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[Logprob] = field(default_factory=list)


class LLM:
    """Offline batches: LLM(EngineConfig(model=...)).generate(prompts, params) → one Completion per prompt."""

    def __init__(self, config: EngineConfig, files: ModelFiles | None = None) -> None:
        self.core = EngineCore(config, files)
        self.tokenizer: Tokenizer | None = None  # token ids in, token ids out when the model has no tokenizer
        if "tokenizer.json" in self.core.files.names():
            self.tokenizer = Tokenizer.from_files(self.core.files.read)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[Completion]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        processor = OutputProcessor(self.tokenizer)
        req_ids: list[str] = []
        for prompt, p in zip(prompts, params_list):
            if isinstance(prompt, str) and self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids", param="prompt")
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)  # type: ignore[union-attr]
            req = Request(f"llm-{next(self._ids)}", ids, p, cache_salt=cache_salt)
            self.core.add_request(req)
            processor.add(req.req_id, ids, p)
            req_ids.append(req.req_id)
        results: dict[str, Completion] = {r: Completion("", [], "", Usage(0, 0)) for r in req_ids}
        while self.core.has_unfinished():
            deltas, stopped = processor.process(self.core.step())
            for req_id, stop in stopped:
                self.core.finish_request(req_id, "stop", stop)
            for d in deltas:
                c = results[d.req_id]
                c.text += d.new_text
                c.token_ids.extend(d.new_token_ids)
                c.logprobs.extend(d.logprobs or [])
                if d.finish_reason is not None:
                    c.finish_reason = d.finish_reason
                if d.usage is not None:
                    c.usage = d.usage
        return [results[r] for r in req_ids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer", param="messages")
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]
