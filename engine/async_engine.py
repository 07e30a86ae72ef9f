from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import EngineDeadError, EngineError
from engine.loader import ModelFiles
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.params import SamplingParams
from engine.request import Request
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_Collector = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class AsyncEngine:
    """Async front end: a background thread steps the core while there is work.

    `generate()` is an async iterator of deltas; leaving it early (client gone, task cancelled)
    aborts the request, whose blocks return to the pool on the engine's next step.
    """

    def __init__(self, core: EngineCore, tokenizer: Tokenizer) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.config = core.config
        self.model_name: str = str(core.config.served_model_name)
        self.max_model_len = core.max_model_len
        self._processor = OutputProcessor(tokenizer)
        self._collectors: dict[str, _Collector] = {}
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._dead: BaseException | None = None
        self._profiler: Any = None  # torch.profiler.profile while recording
        self._profile_left, self._profile_path = 0, Path()
        self._thread = threading.Thread(target=self._run, name="tianmen-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, files: ModelFiles | None = None) -> AsyncEngine:
        core = EngineCore(config, files)
        return cls(core, Tokenizer.from_files(core.files.read))

    @property
    def ready(self) -> bool:
        return self._dead is None and not self._stop

    # ---- requests --------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError("the engine stopped after an internal error; restart the server") from self._dead
        req = Request(request_id, prompt_token_ids, params, cache_salt=cache_salt)
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._collectors[request_id] = (asyncio.get_running_loop(), q)
        self._send("add", req)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def stats(self) -> dict[str, float | int]:
        return self.core.stats()

    def profile(self, steps: int, trace_path: str | Path) -> None:
        """Record the next `steps` engine steps with torch.profiler; the Chrome trace goes to `trace_path`."""
        self._send("profile", (steps, Path(trace_path)))

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 30)

    def _send(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    def _deliver(self, req_id: str, item: RequestOutput | BaseException) -> None:
        collector = self._collectors.get(req_id)
        if collector is not None:
            loop, q = collector
            loop.call_soon_threadsafe(q.put_nowait, item)

    # ---- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if not self.core.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                deltas, stopped = self._processor.process(self.core.step())
                if self._profiler is not None:
                    self._profile_step()
                for req_id, stop in stopped:
                    self.core.finish_request(req_id, "stop", stop)
                for delta in deltas:
                    self._deliver(delta.req_id, delta)
        except BaseException as e:  # NOTE: every waiting caller must hear of it, or it would hang forever
            log.exception("engine step failed; the engine is stopped")
            self._dead = e
            dead = EngineDeadError("the engine stopped after an internal error; restart the server")
            for req_id in list(self._collectors):
                self._deliver(req_id, dead)

    def _start_profile(self, steps: int, path: Path) -> None:
        if self._profiler is not None:
            return  # one trace at a time
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profiler = tp.profile(activities=activities, record_shapes=True)
        self._profiler.start()
        self._profile_left, self._profile_path = steps, path

    def _profile_step(self) -> None:
        self._profile_left -= 1
        if self._profile_left > 0:
            return
        prof, self._profiler = self._profiler, None
        prof.stop()
        prof.export_chrome_trace(str(self._profile_path))
        log.info("wrote a profile of engine steps to %s", self._profile_path)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                req: Request = payload
                try:
                    self.core.add_request(req)
                except EngineError as e:
                    self._deliver(req.req_id, e)
                    continue
                self._processor.add(req.req_id, req.prompt_token_ids, req.params)
            elif kind == "profile":
                self._start_profile(*payload)
            else:
                self._processor.drop(payload)
                out = self.core.finish_request(payload, "abort")
                if out is not None:
                    self._deliver(payload, RequestOutput(payload, [], "", "abort", out.usage))
