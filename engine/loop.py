"""The one engine step that both fronts (AsyncEngine, LLM) run."""

from __future__ import annotations

from engine.core import EngineCore
from engine.errors import InvalidRequestError
from engine.output_processor import Ending, OutputProcessor
from engine.outputs import EngineOutput, RequestOutput
from engine.params import SamplingParams
from engine.request import Request
from engine.structured import Grammar, GrammarCompiler
from engine.tokenizer import Tokenizer


class EngineLoop:
    """schedule → run the model → sample → detokenize and find stop strings → finish what ended.

    `step()` does it all in the caller's thread (LLM). AsyncEngine splits it: `step_tokens()` on the step thread,
    `processor.process_one()` on the event loop, and `finish()` back on the step thread for what a stop string
    ended. A delta with finish_reason "error" is a request that failed alone; its blocks are already free.
    Anything `step()` / `step_tokens()` raises is a failure of the whole step.
    """

    def __init__(self, core: EngineCore, tokenizer: Tokenizer | None) -> None:
        self.core = core
        self.processor = OutputProcessor(tokenizer, core.eos_token_ids)
        self.grammars: GrammarCompiler | None = None
        if tokenizer is not None:
            self.grammars = GrammarCompiler(tokenizer.backend_json(), core.vocab_size, core.eos_token_ids)

    def compile(self, params: SamplingParams) -> Grammar | None:
        """params.structured compiled (cached by schema), or None; blocking (milliseconds): keep it off the step
        thread. InvalidRequestError names what cannot be compiled."""
        if params.structured is None:
            return None
        if self.grammars is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this model has none", "structured")
        return self.grammars.compile(params.structured)

    def check(self, params: SamplingParams) -> None:
        """What add() would refuse that the core's make_request does not check (stop strings without a tokenizer)."""
        self.processor.check(params)

    def add(self, req: Request) -> None:
        self.processor.add(req.req_id, req.prompt_token_ids, req.params)
        try:
            self.core.add_request(req)
        except BaseException:
            self.processor.drop(req.req_id)
            raise

    def abort(self, req_id: str) -> RequestOutput | None:
        """End a request now; its final delta, or None if it had already ended."""
        self.processor.drop(req_id)
        out = self.core.finish_request(req_id, "abort")
        return None if out is None else RequestOutput(req_id, [], "", "abort", out.usage)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step_tokens(self) -> list[EngineOutput]:
        """One step, token ids only: its outputs still need `processor` and then `finish()`."""
        return self.core.step()

    def finish(self, endings: list[Ending]) -> None:
        """Tell the core about requests that the output processor ended (a stop string, a detokenizing fault)."""
        for req_id, reason, stop in endings:
            self.core.finish_request(req_id, reason, stop)

    def step(self) -> list[RequestOutput]:
        deltas, endings = self.processor.process(self.step_tokens())
        self.finish(endings)
        return deltas
