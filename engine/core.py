from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import ConfigError, InvalidRequestError
from engine.loader import DirectoryFiles, ModelFiles, eos_token_ids, read_json
from engine.outputs import EngineOutput
from engine.parallel.executor import make_executor
from engine.params import SamplingParams
from engine.request import Request, check_prompt
from engine.sampler import SamplerFn
from engine.scheduler import Scheduler
from engine.structured import Grammar


def model_max_len(config: EngineConfig, hf_config: dict) -> int:
    limit = config.max_model_len
    for key in ("max_position_embeddings", "sliding_window"):
        value = hf_config.get(key)
        if (
            isinstance(value, int)
            and value > 0
            and (key != "sliding_window" or hf_config.get("use_sliding_window", True))
        ):
            limit = min(limit, value)
    return limit


WARM_START_SALT = "tianmen-warm-start-"  # placeholder requests' ids, and their cache salt's prefix


class EngineCore:
    """schedule → execute → update, synchronously, on token ids only. `sampler` replaces the runner's (tests).

    With tensor_parallel_size > 1 the executor runs each step on every rank (engine.parallel); `close()` stops
    those ranks. Under torchrun, constructing it on a rank other than 0 serves as that worker and exits."""

    def __init__(self, config: EngineConfig, files: ModelFiles | None = None, sampler: SamplerFn | None = None) -> None:
        self.config = config
        self.files = files or DirectoryFiles(config.model)
        self.hf_config = read_json(self.files, "config.json")
        self.max_model_len = model_max_len(config, self.hf_config)
        if config.max_num_batched_tokens < config.block_size:
            raise ConfigError("max_num_batched_tokens must be >= block_size")
        self.eos_token_ids = eos_token_ids(self.files, self.hf_config)
        self.executor = make_executor(config, self.files, self.hf_config, self.max_model_len)
        self.runner = self.executor.runner  # rank 0's
        if sampler is not None:
            self.runner.sampler = sampler  # type: ignore[assignment]
        self.vocab_size: int = self.runner.model.args.vocab_size  # the logits' width: every token id is below it
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_waiting=config.max_waiting,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_prefill_tokens_per_step=config.max_prefill_tokens_per_step,
        )
        if config.warm_start:
            self._warm_start()

    def _warm_start(self) -> None:
        """config.warm_start: placeholder prompts that fill one step's token budget (max_num_seqs of them, as far
        as the KV cache holds them, sharing max_num_batched_tokens), prefilled and decoded once, then forgotten:
        their blocks are freed, under a salt no request can name, and the counters they moved are zeroed.
        WHY: the first step of each size faults in its activations' memory and pays the kernels' first-call work
        (DeepSeek-V2-tiny's first 32 x 128-token prefill took 1.15 s, the next ones 0.85 s, on a 2-core AMX
        Xeon; a Qwen2-0.5B shape's did not differ), and a server's first requests should not pay for it."""
        c, bm = self.config, self.block_manager
        if self.max_model_len < 3:  # no room for a prompt and two tokens
            return
        length = max(1, min(c.max_num_batched_tokens // c.max_num_seqs, self.max_model_len - 2))
        per_seq = -(-(length + 2) // c.block_size)  # its blocks after a decoded token
        seqs = min(c.max_num_seqs, bm.num_free_blocks // per_seq)
        if seqs == 0:
            return
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        salt = WARM_START_SALT + os.urandom(8).hex()
        for i in range(seqs):
            prompt = [(i * length + j) % self.vocab_size for j in range(length)]
            self.add_request(self.make_request(f"{WARM_START_SALT}{i}", prompt, params, salt))
        for _ in range(4 * seqs + 8):  # a bound, not a timeout: each step prefills or decodes at least one row
            if not self.has_unfinished():
                break
            self.step()
        for i in range(seqs):  # only if the bound was hit: the scheduler is left as it was before
            self.finish_request(f"{WARM_START_SALT}{i}", "abort")
        bm.num_queried_tokens = bm.num_hit_tokens = 0
        sc = self.scheduler
        sc.num_prompt_tokens = sc.num_generation_tokens = sc.num_preemptions = 0
        self.runner.num_steps, self.runner.step_seconds = 0, 0.0  # this process's (a tensor-parallel rank 0's)

    def make_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        grammar: Grammar | None = None,
    ) -> Request:
        """A complete Request, checked against this model; InvalidRequestError names the bad field.

        `grammar`: params.structured compiled (EngineLoop.compile), required when it is set. Reads only what
        never changes after construction, so any thread may call it.
        """
        if not isinstance(req_id, str) or not req_id:
            raise InvalidRequestError("the request id must be a non-empty string", param="request_id")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string", param="cache_salt")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling parameters must be a SamplingParams", param="params")
        prompt = check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        params.check(self.vocab_size, self.max_model_len)
        if (params.structured is None) != (grammar is None):
            raise InvalidRequestError("a structured-output request needs its compiled grammar", param="structured")
        matcher = grammar.matcher() if grammar is not None else None
        return Request(req_id, prompt, params, self.eos_token_ids, cache_salt, self.max_model_len, matcher)

    def make_warmup_request(self, req_id: str, prompt_token_ids: Sequence[int], cache_salt: str | None) -> Request:
        """A request that prefills a prompt into the prefix cache and pins its full blocks when it finishes
        (it samples one token, which nobody reads). InvalidRequestError if the prompt does not fit the model."""
        if not self.config.enable_prefix_caching:
            raise InvalidRequestError("warm-up prompts need enable_prefix_caching", param="warmup_prompts")
        req = self.make_request(req_id, prompt_token_ids, SamplingParams(max_tokens=1, temperature=0), cache_salt)
        req.pin_prefix = True
        return req

    def add_request(self, req: Request) -> None:
        """Queue a Request from make_request; raises only for a duplicate id or a full queue."""
        self.scheduler.add_request(req)

    def finish_request(self, req_id: str, reason: str, stop_reason: str | int | None = None) -> EngineOutput | None:
        req = self.scheduler.finish_request(req_id, reason, stop_reason)
        if req is None:
            return None
        return EngineOutput(req_id, [], None, reason, self.scheduler.usage(req))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        return self.scheduler.update_from_output(sched, self.executor.execute(sched))

    @property
    def failure(self) -> BaseException | None:
        """Why the engine can no longer run steps (a tensor-parallel rank died), or None."""
        return self.executor.failure

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback` (from any thread) the moment the engine fails outside a step, e.g. a rank dies."""
        self.executor.on_failure(callback)

    def close(self) -> None:
        """Stop the other ranks, if any; the core runs no step after it."""
        self.executor.close()

    def stats(self) -> dict[str, Any]:
        """Scheduler and cache figures; "ranks": per rank its steps, step and communication seconds (totals)."""
        s, bm = self.scheduler, self.block_manager
        return {
            "ranks": self.executor.rank_stats(),
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_used": bm.num_blocks - bm.num_free_blocks,
            "kv_cache_usage": bm.usage,
            "kv_blocks_pinned": bm.num_pinned_blocks,  # warm-up prefixes: in use for good, never evicted
            "prefix_cache_pinned_tokens": bm.num_pinned_blocks * bm.block_size,
            "prefix_cache_queries": bm.num_queried_tokens,
            "prefix_cache_hits": bm.num_hit_tokens,
            "prefix_cache_hit_rate": bm.hit_rate,
            "prompt_tokens_total": s.num_prompt_tokens,
            "generation_tokens_total": s.num_generation_tokens,
            "preemptions_total": s.num_preemptions,
        }
