from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import ConfigError, EngineDeadError, EngineError, InvalidRequestError, RequestFailedError
from engine.loader import ModelFiles
from engine.loop import EngineLoop
from engine.outputs import EngineOutput, RequestOutput
from engine.params import SamplingParams
from engine.request import Request
from engine.sampler import SamplerFn
from engine.step_thread import StepThread
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.data_parallel import DataParallelEngine

log = logging.getLogger(__name__)


class _Mailbox:
    """One request's deltas on its event loop: a deque and at most one waiter. WHY not asyncio.Queue: it has one
    reader and an unbounded, never-blocking writer, so the queue's getter/putter machinery was only cost (~2% of
    the event loop's time per request with max_tokens = 1)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> list[RequestOutput | BaseException]:
        """Every item ready now, at least one (waits for it)."""
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items = list(self.items)
        self.items.clear()
        return items


_Collector = tuple[asyncio.AbstractEventLoop, _Mailbox]
# what the step thread hands to an event loop: token outputs still to detokenize, or final items
_Item = tuple[str, EngineOutput | RequestOutput | BaseException]
_DEAD = "the engine stopped after an internal error; restart the server"
_SHUT_DOWN = "the engine is shutting down"


class AsyncEngine:
    """Async front end: a background thread steps the core while there is work.

    `generate()` is an async iterator of deltas (`generate_batches()`: lists of the deltas ready together);
    leaving it early aborts the request. The step thread only runs steps: each step's outputs reach each event
    loop in one callback, which detokenizes them and checks stop strings there, off the step's critical path.
    """

    def __init__(self, core: EngineCore, tokenizer: Tokenizer, thread: StepThread | None = None) -> None:
        """`thread`: the one the core was built on (from_config does so), which then runs its steps, perhaps
        taking turns with other engines; its owner finishes it. Without it, a thread of its own (slower on CPU
        when the core was built on another thread: engine.step_thread says why)."""
        self.core = core
        self.tokenizer = tokenizer
        self.config = core.config
        self.model_name: str = str(core.config.served_model_name)
        self.max_model_len = core.max_model_len
        self._loop = EngineLoop(core, tokenizer)
        self._collectors: dict[str, _Collector] = {}
        self._pins: dict[str, tuple[Request, concurrent.futures.Future[int]]] = {}  # warm-ups under way
        self._pin_ids = itertools.count()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        own = thread is None
        self._thread = thread or StepThread()
        self._wake = self._thread.wake
        self._nudges: set[asyncio.AbstractEventLoop] = set()  # loops with a wake-up scheduled for this pass
        self._ended = threading.Event()  # the step loop has ended and told every waiting caller why
        self._stop = False
        self._dead: BaseException | None = None
        self._profiler: Any = None  # torch.profiler.profile while recording
        self._profile_left, self._profile_path = 0, Path()
        self._thread.attach(self)
        if own:
            self._thread.finish()
        core.on_failure(self._fail)  # a tensor-parallel rank died: fail now, whatever the step thread is doing

    @classmethod
    def from_config(
        cls, config: EngineConfig, files: ModelFiles | None = None, sampler: SamplerFn | None = None,
        thread: StepThread | None = None,
    ) -> AsyncEngine | DataParallelEngine:  # fmt: skip
        """The engine `config` asks for: with data_parallel_size > 1, a front over that many replicas with the
        same surface (engine.data_parallel), each on a thread of its own. `thread`: build and step the engine
        there, in turns with the others on it (several models on the same CPU cores); its owner finishes it."""
        if config.data_parallel_size > 1:
            from engine.data_parallel import DataParallelEngine  # it builds on this module

            return DataParallelEngine.from_config(config, files, sampler)
        own = thread is None
        thread = thread or StepThread()
        core: EngineCore | None = None
        try:
            core = thread.call(lambda: EngineCore(config, files, sampler))
            return cls(core, Tokenizer.from_files(core.files.read), thread)
        except BaseException:
            if core is not None:
                core.close()
            raise
        finally:
            if own:
                thread.finish()  # it ends with the engine (at once where there is none)

    @property
    def healthy(self) -> bool:
        """False once a whole engine step failed: nothing can be served until the process restarts."""
        return self._dead is None

    @property
    def ready(self) -> bool:
        return self.healthy and not self._stop

    @property
    def num_active(self) -> int:
        """Requests between generate() and their end: the load a data-parallel front balances."""
        return len(self._collectors)

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
        """As generate(), but every delta that is ready when the caller asks comes in one list (never empty):
        one item while the caller keeps up, several once it falls behind (a slow client)."""
        if self._dead is not None:
            raise EngineDeadError(_DEAD) from self._dead
        if self._stop:
            raise EngineDeadError(_SHUT_DOWN)
        if request_id in self._collectors:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        grammar = None
        if params.structured is not None:  # compiled (or taken from the cache) in a worker thread, not on the loop
            grammar = await asyncio.to_thread(self._loop.compile, params)
        req = self.core.make_request(request_id, prompt_token_ids, params, cache_salt, grammar)
        self._loop.check(params)
        box = _Mailbox()
        self._collectors[request_id] = (asyncio.get_running_loop(), box)
        if self._dead is not None or self._stop:  # stopped after the checks above: its broadcast may have missed us
            self._collectors.pop(request_id, None)
            raise EngineDeadError(_DEAD if self._dead is not None else _SHUT_DOWN) from self._dead
        self._loop.processor.add(request_id, req.prompt_token_ids, params)
        self._send("add", req)
        finished = False
        try:
            while True:
                items = await box.take()
                ready: list[RequestOutput] = []
                for item in items:
                    if isinstance(item, BaseException):
                        if ready:
                            yield ready  # what came before the failure is the caller's
                        finished = True
                        raise item
                    ready.append(item)
                    if item.finished:
                        break
                finished = ready[-1].finished
                yield ready
                if finished:
                    return
        finally:
            self._collectors.pop(request_id, None)
            self._loop.processor.drop(request_id)
            if not finished:
                self._send("abort", request_id)

    def pin_prefix(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Prefill a prompt into the prefix cache under `cache_salt` and pin its full blocks: never evicted, they
        count against the KV cache, and every later request under that salt whose prompt starts with them skips
        their prefill (its `cached_tokens` counts them). Returns the tokens pinned (whole blocks).

        Blocking: call it at start-up, from a thread that runs no event loop. Raises InvalidRequestError for a
        prompt that does not fit the model, ConfigError if the pinned blocks would leave no room for one
        full-length sequence, EngineDeadError if the engine stopped."""
        if self._dead is not None or self._stop:
            raise EngineDeadError(_DEAD if self._dead is not None else _SHUT_DOWN) from self._dead
        req = self.core.make_warmup_request(f"warmup-{next(self._pin_ids)}", prompt_token_ids, cache_salt)
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._pins[req.req_id] = (req, done)
        if self._dead is not None or self._stop:  # as in generate_batches: the final broadcast may have missed it
            self._pins.pop(req.req_id, None)
            raise EngineDeadError(_DEAD if self._dead is not None else _SHUT_DOWN) from self._dead
        self._send("add", req)
        return done.result()

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def profile(self, steps: int, trace_path: str | Path) -> None:
        """Record the next `steps` engine steps with torch.profiler; the Chrome trace goes to `trace_path`.

        A trace that cannot be written is logged, never raised: the engine steps on."""
        self._send("profile", (steps, Path(trace_path)))

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._ended.wait, 30)
        await asyncio.to_thread(self.core.close)

    def _fail(self, error: BaseException) -> None:
        """From any thread: the engine can serve nothing more; every waiting caller hears so at once."""
        if self._dead is None:
            self._dead = error
        self._wake.set()
        why = f"{_DEAD} ({error})"
        self._deliver([(req_id, EngineDeadError(why)) for req_id in list(self._collectors)])

    def _send(self, kind: str, payload: Any) -> None:
        """Queue a message for the step thread and wake it: from an event loop, once per pass of that loop.

        WHY: waking a sleeping thread costs the event loop a futex call and, on a busy core, a context switch and
        a GIL hand-off; the requests one pass admits (or aborts, or ends) share one wake-up and reach the same
        step, which they would not have beaten the first of them to anyway."""
        self._inbox.put((kind, payload))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a plain thread (pin_prefix at start-up)
            self._wake.set()
            return
        if loop not in self._nudges:
            if self._nudges:  # a loop that closed before its nudge ran is not kept
                self._nudges -= {other for other in self._nudges if other.is_closed()}
            self._nudges.add(loop)
            try:
                loop.call_soon(self._nudge, loop)
            except RuntimeError:  # the loop is closing: wake the thread now
                self._nudges.discard(loop)
                self._wake.set()

    def _nudge(self, loop: asyncio.AbstractEventLoop) -> None:
        self._nudges.discard(loop)
        self._wake.set()

    def _deliver(self, items: list[_Item]) -> None:
        """Hand one step's items to their event loops: one callback per loop, however many requests."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Item]] = {}
        for item in items:
            if item[0] in self._pins:
                self._settle_pin(*item)
                continue
            collector = self._collectors.get(item[0])
            if collector is not None:
                by_loop.setdefault(collector[0], []).append(item)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._receive, batch)
            except RuntimeError:  # that caller's event loop is closed: nobody is listening, the others still are
                for req_id, _ in batch:
                    self._collectors.pop(req_id, None)
                    self._inbox.put(("abort", req_id))

    def _settle_pin(self, req_id: str, item: EngineOutput | RequestOutput | BaseException) -> None:
        """On the step thread: a warm-up's output. Its token is nobody's; its end settles pin_prefix's future."""
        if not isinstance(item, BaseException) and item.finish_reason is None:
            return
        req, done = self._pins.pop(req_id)
        if isinstance(item, BaseException):
            done.set_exception(item)
        elif item.finish_reason == "error":
            done.set_exception(RequestFailedError(_failed(req_id)))
        elif req.pinned_tokens < 0:
            done.set_exception(
                ConfigError(
                    "the warm-up prompts would pin so much of the KV cache that one max_model_len sequence no longer "
                    "fits beside them; raise kv_cache_bytes, lower max_model_len or shorten the warm-up prompts"
                )
            )
        else:
            done.set_result(req.pinned_tokens)

    def _receive(self, batch: list[_Item]) -> None:
        """On the caller's event loop: detokenize, find stop strings (the engine is told), queue the deltas."""
        endings = []
        for req_id, item in batch:
            collector = self._collectors.get(req_id)
            if collector is None:
                continue  # the caller has left; its abort is on the way
            try:
                if isinstance(item, EngineOutput):
                    delta, ending = self._loop.processor.process_one(item)
                    if ending is not None:
                        endings.append(ending)
                    if delta is None:
                        continue  # ended here already (a stop string): the tokens past it are never sent
                    item = RequestFailedError(_failed(req_id)) if delta.finish_reason == "error" else delta
                else:
                    self._loop.processor.drop(req_id)
            except Exception as e:  # NOTE: a raise here would lose the rest of the batch: the others' tokens
                log.error("request %s failed in output processing (%s)", req_id, type(e).__name__)
                self._loop.processor.drop(req_id)
                endings.append((req_id, "error", None))
                item = RequestFailedError(_failed(req_id))
            collector[1].put(item)
        if endings:
            self._send("finish", endings)

    # ---- the engine thread: its turns (engine.step_thread.Stepper) -------------------------------------------
    @property
    def done(self) -> bool:
        return self._ended.is_set()

    def turn(self) -> bool:
        """One pass of the step loop on the step thread: take in what arrived, run a step if there is work (True
        then). Once stopped or failed, tells every waiting caller and is done."""
        if self._ended.is_set():
            return False
        try:
            if self._stop or self._dead is not None:
                self._end()
                return False
            self._drain_inbox()
            if not self._loop.has_unfinished():
                return False
            outputs = self._loop.step_tokens()
            if self._profiler is not None:
                self._profile_step()
            self._deliver([(out.req_id, out) for out in outputs])
            return True
        except BaseException as e:  # NOTE: every waiting caller must hear of it, or it would hang forever
            log.exception("an engine step failed; the engine is stopped")
            if self._dead is None:
                self._dead = e  # set before the broadcast: generate() checks it after registering its collector
            self._end()
            return False

    def _end(self) -> None:
        why = _DEAD if self._dead is not None else _SHUT_DOWN
        self._deliver([(req_id, EngineDeadError(why)) for req_id in [*self._collectors, *self._pins]])
        self._ended.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload)
            elif kind == "finish":
                self._loop.finish(payload)
            elif kind == "profile":
                self._start_profile(*payload)
            else:
                out = self.core.finish_request(payload, "abort")  # the processor is the event loop's
                if out is not None:
                    self._deliver([(payload, RequestOutput(payload, [], "", "abort", out.usage))])

    def _add(self, req: Request) -> None:
        try:
            self.core.add_request(req)
        except EngineError as e:  # a duplicate id or a full queue
            self._deliver([(req.req_id, e)])
        except Exception as e:
            log.error("request %s failed while being added (%s)", req.req_id, type(e).__name__)
            self._deliver([(req.req_id, RequestFailedError(_failed(req.req_id)))])

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
