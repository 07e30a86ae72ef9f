from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import InvalidRequestError
from engine.loader import ModelFiles
from engine.loop import EngineLoop
from engine.outputs import Logprob, Usage
from engine.params import SamplingParams
from engine.sampler import SamplerFn
from engine.tokenizer import Tokenizer


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error" (this prompt failed inside the engine; the others did not)
    usage: Usage
    logprobs: list[Logprob] = field(default_factory=list)


class LLM:
    """Offline batches: LLM(EngineConfig(model=...)).generate(prompts, params) → one Completion per prompt."""

    def __init__(self, config: EngineConfig, files: ModelFiles | None = None, sampler: SamplerFn | None = None) -> None:
        self.core = EngineCore(config, files, sampler)
        self.tokenizer: Tokenizer | None = None  # token ids in, token ids out when the model has no tokenizer
        if "tokenizer.json" in self.core.files.names():
            self.tokenizer = Tokenizer.from_files(self.core.files.read)
        self._loop = EngineLoop(self.core, self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[Completion]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError("pass one SamplingParams per prompt, or one for all", param="params")
        requests = []
        for prompt, p in zip(prompts, params_list):  # all checked before any is queued
            if isinstance(prompt, str) and self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids", param="prompt")
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt  # type: ignore[union-attr]
            grammar = self._loop.compile(p)
            requests.append(self.core.make_request(f"llm-{next(self._ids)}", ids, p, cache_salt, grammar))
            self._loop.check(p)
        results = {r.req_id: Completion("", [], "", Usage(0, 0)) for r in requests}
        try:
            for req in requests:
                self._loop.add(req)
            while self._loop.has_unfinished():
                for d in self._loop.step():
                    c = results[d.req_id]
                    c.text += d.new_text
                    c.token_ids.extend(d.new_token_ids)
                    c.logprobs.extend(lp for lp in d.logprobs or [] if lp is not None)
                    if d.finish_reason is not None:
                        c.finish_reason = d.finish_reason
                    if d.usage is not None:
                        c.usage = d.usage
        finally:  # a failed step (or KeyboardInterrupt) must not leave this batch's requests in the core
            for req_id, c in results.items():
                if not c.finish_reason:
                    self._loop.abort(req_id)
        return list(results.values())

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks, if any (they also end with this process)."""
        self.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer", param="messages")
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]
