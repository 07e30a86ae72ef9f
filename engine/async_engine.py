from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import EngineDeadError, EngineError, InvalidRequestError, RequestFailedError
from engine.loader import ModelFiles
from engine.loop import EngineLoop
from engine.outputs import RequestOutput
from engine.params import SamplingParams
from engine.request import Request
from engine.sampler import SamplerFn
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_Collector = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]
_DEAD = "the engine stopped after an internal error; restart the server"
_SHUT_DOWN = "the engine is shutting down"


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
        self._loop = EngineLoop(core, tokenizer)
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
    def from_config(
        cls, config: EngineConfig, files: ModelFiles | None = None, sampler: SamplerFn | None = None
    ) -> AsyncEngine:
        core = EngineCore(config, files, sampler)
        return cls(core, Tokenizer.from_files(core.files.read))

    @property
    def healthy(self) -> bool:
        """False once a whole engine step failed: nothing can be served until the process restarts."""
        return self._dead is None

    @property
    def ready(self) -> bool:
        return self.healthy and not self._stop

    # ---- requests --------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request. Raises InvalidRequestError before anything is queued, RequestFailedError if
        the request failed alone inside the engine, EngineDeadError if the engine stopped."""
        if self._dead is not None:
            raise EngineDeadError(_DEAD) from self._dead
        if self._stop:
            raise EngineDeadError(_SHUT_DOWN)
        if request_id in self._collectors:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        req = self.core.make_request(request_id, prompt_token_ids, params, cache_salt)
        self._loop.check(params)
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._collectors[request_id] = (asyncio.get_running_loop(), q)
        if self._dead is not None or self._stop:  # stopped after the checks above: its broadcast may have missed us
            self._collectors.pop(request_id, None)
            raise EngineDeadError(_DEAD if self._dead is not None else _SHUT_DOWN) from self._dead
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
        """Record the next `steps` engine steps with torch.profiler; the Chrome trace goes to `trace_path`.

        A trace that cannot be written is logged, never raised: the engine steps on."""
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
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # that caller's event loop is closed: nobody is listening, the others still are
                self._collectors.pop(req_id, None)
                self._inbox.put(("abort", req_id))

    # ---- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if not self._loop.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                deltas = self._loop.step()
                if self._profiler is not None:
                    self._profile_step()
                for delta in deltas:
                    if delta.finish_reason == "error":
                        self._deliver(delta.req_id, RequestFailedError(_failed(delta.req_id)))
                    else:
                        self._deliver(delta.req_id, delta)
        except BaseException as e:  # NOTE: every waiting caller must hear of it, or it would hang forever
            log.exception("an engine step failed; the engine is stopped")
            self._dead = e  # set before the broadcast: generate() checks it after registering its collector
        why = _DEAD if self._dead is not None else _SHUT_DOWN
        for req_id in list(self._collectors):
            self._deliver(req_id, EngineDeadError(why))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload)
            elif kind == "profile":
                self._start_profile(*payload)
            else:
                out = self._loop.abort(payload)
                if out is not None:
                    self._deliver(payload, out)

    def _add(self, req: Request) -> None:
        try:
            self._loop.add(req)
        except EngineError as e:  # a duplicate id or a full queue
            self._deliver(req.req_id, e)
        except Exception as e:
            log.error("request %s failed while being added (%s)", req.req_id, type(e).__name__)
            self._deliver(req.req_id, RequestFailedError(_failed(req.req_id)))

    # ---- profiling: a failure here is logged and the engine steps on -----------------------------------
    def _start_profile(self, steps: int, path: Path) -> None:
        if self._profiler is not None:
            return  # one trace at a time
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        try:
            profiler = tp.profile(activities=activities, record_shapes=True)
            profiler.start()
        except Exception as e:
            log.error("could not start the profiler (%s)", type(e).__name__)
            return
        self._profiler = profiler
        self._profile_left, self._profile_path = steps, path

    def _profile_step(self) -> None:
        self._profile_left -= 1
        if self._profile_left > 0:
            return
        prof, self._profiler, path = self._profiler, None, self._profile_path
        try:
            prof.stop()
            with open(path, "w"):  # torch's exporter only logs a file it cannot open; this raises
                pass
            prof.export_chrome_trace(str(path))
            if not _ends_like_json(path):  # ...nor does it report a failed write (a full disk)
                raise OSError("the trace file is incomplete")
        except Exception as e:
            log.error("could not write the profile trace to %s: %s", path, e)
            return
        log.info("wrote a profile of engine steps to %s", path)


def _failed(req_id: str) -> str:
    return f"request {req_id} failed inside the engine; other requests are unaffected"


def _ends_like_json(path: Path) -> bool:
    try:
        size = path.stat().st_size
        if not path.is_file() or size == 0:
            return False
        with open(path, "rb") as f:
            f.seek(max(0, size - 64))
            return f.read(64).rstrip().endswith((b"}", b"]"))
    except OSError:
        return False
