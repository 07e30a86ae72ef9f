from __future__ import annotations

from collections import deque

from engine.block_manager import BlockManager, cdiv
from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.outputs import EngineOutput, ModelOutput, ScheduledSeq, SchedulerOutput, Usage
from engine.request import Request, RequestStatus


class Scheduler:
    """Continuous batching: each step spends a token budget on running requests, then admits waiting ones.

    Requests carry `num_computed_tokens` and `num_tokens`; a step gives each one a chunk of its
    uncomputed tokens (a decode is a chunk of one), so prefill chunks and decodes mix freely. Every decode is
    served before any prefill chunk, and while others run or wait a prefill chunk is at most
    `long_prefill_token_threshold` tokens, so a long prompt neither stalls the streams nor the newcomers, and the
    step's prefill chunks together at most `max_prefill_tokens_per_step`, so prompts that arrive together are
    prefilled a few at a time (shortest time to first token on average) rather than all in one long step.
    When blocks run out, the newest running request is preempted and later recomputed.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_waiting: int = 1024,
        long_prefill_token_threshold: int = 0,
        max_prefill_tokens_per_step: int = 0,
    ) -> None:
        self.bm = block_manager
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: a chunk takes what the budget allows
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step  # 0: prefills share the whole budget
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: list[str] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    # ---- admission -----------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a complete, validated Request (EngineCore.make_request builds one)."""
        if req.req_id in self.requests:
            raise InvalidRequestError(f"request id {req.req_id!r} is already in use", param="request_id")
        if len(self.waiting) >= self.max_waiting:
            raise EngineOverloadedError(f"the engine's waiting queue is full ({self.max_waiting} requests)")
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False

        # decodes first: only they may preempt, and only a request not yet scheduled in this step (the newest)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_tokens - req.num_computed_tokens != 1:
                i += 1
                continue
            while not self.bm.can_allocate(req, 1):
                victim = self.running.pop()  # the newest request gives its blocks back
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                self.bm.allocate(req, 1)
                scheduled.append((req, 1))
                budget -= 1
                i += 1
                continue
            break

        cap = self._prefill_cap()
        prefill_left = self._prefill_budget()
        for req in self.running:  # prefills under way (chunked, or recomputed), oldest first
            if min(budget, prefill_left) <= 0:
                break
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining <= 1:
                continue
            num_new = min(remaining, budget, prefill_left, cap)
            if not self.bm.can_allocate(req, num_new):
                break  # blocks are short: the next step's decodes will preempt if they must
            self.bm.allocate(req, num_new)
            scheduled.append((req, num_new))
            budget -= num_new
            prefill_left -= num_new

        # NOTE: after a preemption nothing new is admitted, or it would be preempted again at once.
        while (
            not preempted and self.waiting and min(budget, prefill_left) > 0 and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            computed = self.bm.get_computed_blocks(req)
            num_computed = len(computed) * self.bm.block_size
            num_new = min(req.num_tokens - num_computed, budget, prefill_left, cap)
            if not self.bm.can_allocate(req, num_new, computed):
                break
            self.bm.allocate(req, num_new, computed)
            self.waiting.popleft()
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new
            prefill_left -= num_new

        decodes = [self._seq(r, n) for r, n in scheduled if n == 1]
        prefills = [self._seq(r, n) for r, n in scheduled if n > 1]
        for req, n in scheduled:
            req.num_computed_tokens += n
        out = SchedulerOutput(
            seqs=decodes + prefills,
            num_decodes=len(decodes),
            num_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
        )
        self.finished_req_ids = []
        return out

    def _prefill_budget(self) -> int:
        """The most tokens all prefill chunks of this step may take together: capped only while others wait too."""
        if self.max_prefill_tokens_per_step <= 0 or len(self.running) + len(self.waiting) <= 1:
            return self.max_num_batched_tokens
        return self.max_prefill_tokens_per_step

    def _prefill_cap(self) -> int:
        """The most tokens one prefill chunk may take this step: capped only while it would hold others up."""
        if self.long_prefill_token_threshold <= 0 or len(self.running) + len(self.waiting) <= 1:
            return self.max_num_batched_tokens
        return self.long_prefill_token_threshold

    def _seq(self, req: Request, num_new: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        return ScheduledSeq(
            req_id=req.req_id,
            token_ids=req.token_ids[start : start + num_new],
            start=start,
            block_ids=self.bm.block_ids(req.req_id),
            sample=start + num_new == req.num_tokens,
            params=req.params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            matcher=req.matcher,
        )

    def _preempt(self, req: Request) -> None:
        self.bm.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, sched: SchedulerOutput, out: ModelOutput) -> list[EngineOutput]:
        """The one place that changes request state after a step: append tokens, check stops, free."""
        for seq in sched.seqs:
            self.num_prompt_tokens += max(0, min(len(seq.token_ids), len(seq.prompt_token_ids) - seq.start))
        outputs = []
        for k, (req_id, token) in enumerate(zip(out.req_ids, out.token_ids)):
            req = self.requests.get(req_id)
            if req is None or req.finished:  # aborted while the step ran
                continue
            if not req.append_output(token):  # a token its grammar refuses: only a fault gets here (masks forbid it)
                out.failed_req_ids.append(req_id)
                continue
            self.num_generation_tokens += 1
            if req.check_stop():
                self._finish(req)
            row_lp = out.logprobs[k] if out.logprobs is not None and req.params.logprobs is not None else None
            lp = [row_lp] if row_lp is not None else None
            outputs.append(EngineOutput(req_id, [token], lp, req.finish_reason, self.usage(req)))
        for req_id in out.failed_req_ids:  # the runner could not sample for these: they end, the others go on
            req = self.requests.get(req_id)
            if req is None or req.finished:
                continue
            req.finish_reason = "error"
            self._finish(req)
            outputs.append(EngineOutput(req_id, [], None, "error", self.usage(req)))
        return outputs

    # ---- ending ------------------------------------------------------------------------------
    def finish_request(self, req_id: str, reason: str, stop_reason: str | int | None = None) -> Request | None:
        """End a request from outside a step (abort, or a stop string found by the detokenizer)."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        req.finish_reason, req.stop_reason = reason, stop_reason
        self._finish(req)
        return req

    def _finish(self, req: Request) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        if req.pin_prefix and req.finish_reason in ("stop", "length"):
            keep_free = cdiv(self.max_model_len, self.bm.block_size)  # one full-length sequence still fits
            req.pinned_tokens = self.bm.pin(req, keep_free)
        self.bm.free(req)
        del self.requests[req.req_id]
        self.finished_req_ids.append(req.req_id)

    @staticmethod
    def usage(req: Request) -> Usage:
        return Usage(req.num_prompt_tokens, req.num_output_tokens, max(0, req.num_cached_tokens))
