"""Data parallel: several whole engine replicas behind one front with AsyncEngine's surface.

Each replica is an AsyncEngine over its own EngineCore (its own scheduler, KV cache and step thread; itself tensor
parallel when tensor_parallel_size > 1, its ranks on its own devices). A request goes to the replica whose prefix
cache holds the longest prefix of its prompt for its tenant (cache_salt), else to the least loaded one, and stays
there. The replicas share nothing but the tokenizer, so the front serves while any one is busy; it is healthy
only while every replica is.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import ConfigError, InvalidRequestError
from engine.loader import ModelFiles
from engine.outputs import RequestOutput
from engine.parallel.launch import torchrun_rank
from engine.params import SamplingParams
from engine.sampler import SamplerFn
from engine.step_thread import ENGINE_THREAD_NAME, StepThread
from engine.tokenizer import Tokenizer

_SUMMED = (
    "num_running",
    "num_waiting",
    "kv_blocks_total",
    "kv_blocks_free",
    "kv_blocks_used",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prompt_tokens_total",
    "generation_tokens_total",
    "preemptions_total",
)


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica `index`'s settings: its own devices (cuda:index*tp onwards) or its share of the CPU's cores."""
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    changes: dict[str, Any] = {"data_parallel_size": 1}
    device = config.torch_device
    if device.type == "cuda":
        changes["device"] = f"cuda:{(device.index or 0) + index * tp}"
    elif device.type == "cpu" and config.num_threads is None:
        changes["num_threads"] = max(1, len(os.sched_getaffinity(0)) // (dp * tp))
    return dataclasses.replace(config, **changes)


class DataParallelEngine:
    def __init__(self, replicas: list[AsyncEngine]) -> None:
        self.replicas = replicas
        first = replicas[0]
        self.tokenizer, self.config = first.tokenizer, first.config
        self.model_name, self.max_model_len = first.model_name, first.max_model_len
        self._owner: dict[str, AsyncEngine] = {}

    @classmethod
    def from_config(
        cls, config: EngineConfig, files: ModelFiles | None = None, sampler: SamplerFn | None = None
    ) -> DataParallelEngine:
        if torchrun_rank() is not None:
            raise ConfigError("data_parallel_size > 1 under torchrun is not implemented: start one server per replica")
        cores: list[EngineCore] = []
        threads: list[StepThread] = []
        try:
            for i in range(config.data_parallel_size):
                threads.append(StepThread(f"{ENGINE_THREAD_NAME}-{i}"))  # each replica built on its stepping thread
                cores.append(threads[-1].call(lambda i=i: EngineCore(replica_config(config, i), files, sampler)))  # type: ignore[misc]
            tokenizer = Tokenizer.from_files(cores[0].files.read)
            replicas = [AsyncEngine(core, tokenizer, thread) for core, thread in zip(cores, threads, strict=True)]
        except BaseException:
            for core in cores:
                core.close()
            raise
        finally:
            for thread in threads:
                thread.finish()  # each ends with its replica (at once where there is none)
        return cls(replicas)

    @property
    def healthy(self) -> bool:
        return all(r.healthy for r in self.replicas)

    @property
    def ready(self) -> bool:
        return all(r.ready for r in self.replicas)

    def route(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> int:
        """The replica for a prompt: the longest cached prefix of it for this tenant, ties (and no hit at all)
        going to the replica with the fewest requests under way."""

        def score(i: int) -> tuple[int, int]:
            r = self.replicas[i]
            return (r.core.block_manager.cached_prefix_blocks(prompt_token_ids, cache_salt), -r.num_active)

        return max(range(len(self.replicas)), key=score)

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        batches = self.generate_batches(prompt_token_ids, params, request_id, cache_salt)
        try:
            async for batch in batches:
                for out in batch:
                    yield out
        finally:
            await batches.aclose()

    async def generate_batches(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
    ) -> AsyncIterator[list[RequestOutput]]:
        if request_id in self._owner:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        replica = self.replicas[self.route(list(prompt_token_ids), cache_salt)]
        self._owner[request_id] = replica
        batches = replica.generate_batches(prompt_token_ids, params, request_id, cache_salt)
        try:
            async for batch in batches:
                yield batch
        finally:
            await batches.aclose()
            self._owner.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            await replica.abort(request_id)

    def stats(self) -> dict[str, Any]:
        """The replicas' figures summed (usage and hit rate over the whole); "replicas": each one's own."""
        each = [r.stats() for r in self.replicas]
        total: dict[str, Any] = {k: sum(s[k] for s in each) for k in _SUMMED}
        total["kv_cache_usage"] = total["kv_blocks_used"] / total["kv_blocks_total"]
        queries = total["prefix_cache_queries"]
        total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / queries if queries else 0.0
        total["ranks"] = [rank | {"replica": i} for i, s in enumerate(each) for rank in s["ranks"]]
        total["replicas"] = each
        return total

    def profile(self, steps: int, trace_path: str | Path) -> None:
        """Replica 0's next `steps` steps (the replicas run the same code)."""
        self.replicas[0].profile(steps, trace_path)

    async def shutdown(self) -> None:
        for r in self.replicas:
            await r.shutdown()
