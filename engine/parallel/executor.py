"""Who runs a step: the model runner alone (`LocalExecutor`), or rank 0 of a tensor-parallel group
(`TensorParallelExecutor`), which broadcasts the step to the worker ranks and then runs its own part.

The scheduler stays in rank 0's process and never learns how many ranks there are. A worker that dies fails the
engine: the watchdog (spawned workers) sees its process end at once and reports it through `failure` and the
callbacks (AsyncEngine then fails its requests and /health); a step under way fails as soon as a collective
meets the dead rank (gloo: its sockets close), or at the collective timeout for a rank that hangs.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.errors import ConfigError, EngineDeadError, ModelLoadError
from engine.loader import ModelFiles
from engine.model_runner import ModelRunner
from engine.models.registry import model_class
from engine.outputs import ModelOutput, SchedulerOutput
from engine.parallel import control
from engine.parallel.group import Group
from engine.parallel.launch import env_store, local_store, open_groups, torchrun_rank
from engine.parallel.worker import WorkerSpec, rank_config, rank_stats, serve, spawned_main
from engine.quant.modules import quantize_modules
from engine.quant.spec import quant_spec

log = logging.getLogger(__name__)
POLL_S = 0.05
DEATH_GRACE_S = 1.0  # after a failed step: how long a dying worker's process may take to end
_OPEN: weakref.WeakSet[TensorParallelExecutor] = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    # NOTE: an engine nobody closed still stops its workers and drops its groups before the interpreter goes
    # (multiprocessing's own exit handler, registered earlier, runs after this one)
    for executor in list(_OPEN):
        executor.close()


class Executor(Protocol):
    runner: ModelRunner

    @property
    def failure(self) -> BaseException | None: ...
    def on_failure(self, callback: Callable[[BaseException], None]) -> None: ...
    def execute(self, sched: SchedulerOutput) -> ModelOutput: ...
    def rank_stats(self) -> list[dict[str, float | int]]: ...
    def close(self) -> None: ...


class LocalExecutor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    def failure(self) -> BaseException | None:
        return None

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        pass

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        return self.runner.execute(sched)

    def rank_stats(self) -> list[dict[str, float | int]]:
        return [rank_stats(0, self.runner)]

    def close(self) -> None:
        pass


def make_executor(config: EngineConfig, files: ModelFiles, hf_config: dict[str, Any], max_model_len: int) -> Executor:
    """The executor `config` asks for. Under torchrun, a rank other than 0 serves as a worker here and the
    process exits when rank 0 stops (SystemExit): the same command line starts every rank."""
    if config.tensor_parallel_size == 1:
        return LocalExecutor(ModelRunner(config, files, hf_config, max_model_len))
    check_shardable(hf_config, config.tensor_parallel_size, config.enable_expert_parallel)
    rank = torchrun_rank()
    if rank is not None and rank != 0:
        world = config.tensor_parallel_size
        store, rank = env_store(world, datetime.timedelta(seconds=config.distributed_timeout_s))
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        serve(store, rank, world, config, files, hf_config, max_model_len, ranks_here)
        raise SystemExit(0)
    return TensorParallelExecutor(config, files, hf_config, max_model_len)


class _Shape(Group):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size


def check_shardable(hf_config: dict[str, Any], size: int, expert_parallel: bool) -> None:
    """ConfigError (ModelLoadError for a quantized layout) now, before any worker starts, if the model does not
    split over `size` ranks: the model is built on the meta device (no memory), where its layers check their
    splits."""
    spec = quant_spec(hf_config)
    try:
        with torch.device("meta"):
            model = model_class(hf_config)(hf_config, _Shape(size), expert_parallel)
            if spec is not None:  # a rank's slice must hold whole packed words and whole groups
                quantize_modules(model, spec)
    except (ConfigError, ModelLoadError):
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json is missing or has a bad field: {e}") from None


def _check_portable(files: ModelFiles) -> None:
    """Spawned workers open the model from a copy of `files`: one that cannot be copied is refused here, with a
    message, not deep inside torch.multiprocessing."""
    try:
        pickle.dumps(files)
    except Exception:
        raise ConfigError(
            f"tensor_parallel_size > 1 cannot hand these model files ({type(files).__name__}, e.g. a sealed model "
            "opened with a key provider object rather than from its spec) to the worker processes it starts; start "
            "the ranks with torchrun, where each opens the model itself"
        ) from None


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, files: ModelFiles, hf_config: dict[str, Any], max_model_len: int) -> None:
        world = self.world = config.tensor_parallel_size
        self.timeout = datetime.timedelta(seconds=config.distributed_timeout_s)
        self._failure: BaseException | None = None
        self._callbacks: list[Callable[[BaseException], None]] = []
        self._closing = False
        self.procs: list[Any] = []
        self.control_seconds = 0.0
        if torchrun_rank() is not None:
            self.store, _ = env_store(world, self.timeout)
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        else:
            _check_portable(files)
            self.store = local_store(world, self.timeout)
            ranks_here = world
            ctx = mp.get_context("spawn")
            for rank in range(1, world):
                spec = WorkerSpec(rank, world, self.store.port, config, files, hf_config, max_model_len)
                p = ctx.Process(target=spawned_main, args=(spec,), name=f"tianmen-tp{rank}", daemon=True)
                p.start()
                self.procs.append(p)
        _OPEN.add(self)
        self._watch_stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tianmen-tp-watchdog", daemon=True)
        self._watchdog.start()
        try:
            self._wait_for("hello", lambda _: None)
            own = rank_config(config, 0, ranks_here)
            if own.num_threads != config.num_threads and own.num_threads:
                torch.set_num_threads(own.num_threads)  # the runner below keeps config's own setting
            groups = open_groups(self.store, 0, world, config.torch_device, self.timeout)
            self.ctl = groups.ctl
            self.runner = ModelRunner(config, files, hf_config, max_model_len, groups.tp)
            self._wait_for("ready", self._check_ready)
            # NOTE: after the ready handshake, so a rank that could not load reports its own error, not a collective's
            self.runner.agree_with_ranks()
        except BaseException:
            self.close()
            raise

    # ---- failure -------------------------------------------------------------------------------
    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        self._callbacks.append(callback)
        if self._failure is not None:
            callback(self._failure)

    def _fail(self, error: BaseException) -> None:
        if self._failure is not None or self._closing:
            return
        self._failure = error
        log.error("tensor-parallel engine failed: %s", error)
        for cb in self._callbacks:
            try:
                cb(error)
            except Exception:
                log.exception("a failure callback raised")

    def _watch(self) -> None:
        """Spawned workers: the moment one's process ends, the engine has failed."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        while sentinels and not self._watch_stop.is_set():
            for s in wait(list(sentinels), timeout=POLL_S * 4):
                rank, p = sentinels.pop(s)
                p.join(0)
                self._fail(EngineDeadError(f"tensor-parallel worker rank {rank} exited (code {p.exitcode})"))

    def _wait_for(self, what: str, check: Callable[[bytes], None]) -> None:
        """Every worker's `what/<rank>` key in the store, while watching that none dies first."""
        pending = list(range(1, self.world))
        deadline = time.monotonic() + max(self.timeout.total_seconds(), 600.0)  # loading a big model is slow
        while pending:
            if self._failure is not None:
                raise ModelLoadError(f"a worker failed while the engine started: {self._failure}")
            if time.monotonic() > deadline:
                raise ModelLoadError(f"tensor-parallel ranks {pending} did not start ({what}) in time")
            ready = [r for r in pending if self.store.check([f"{what}/{r}"])]
            for r in ready:
                check(self.store.get(f"{what}/{r}"))
                pending.remove(r)
            if pending:
                time.sleep(POLL_S)

    def _check_ready(self, value: bytes) -> None:
        state = json.loads(value)
        if "error" in state:
            raise ModelLoadError(f"a tensor-parallel worker could not load the model: {state['error']}")
        if state["num_blocks"] != self.runner.num_blocks:  # the ranks' caches must hold the same blocks
            raise ModelLoadError(
                f"ranks disagree on the KV cache size ({state['num_blocks']} vs {self.runner.num_blocks})"
            )

    # ---- steps ---------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        if self._failure is not None:
            raise EngineDeadError(str(self._failure)) from self._failure
        t0 = time.perf_counter()
        try:
            control.send(self.ctl, control.encode(sched), self.timeout)
            self.control_seconds += time.perf_counter() - t0
            return self.runner.execute(sched)
        except Exception as e:
            # a collective that meets a killed rank (gloo: connection reset) can fail before the watchdog sees the
            # process end: then name the dead worker, which is the cause the operator must act on
            cause = self._failure or self._dead_worker(DEATH_GRACE_S)
            error = EngineDeadError(str(cause) if cause else f"a tensor-parallel step failed: {type(e).__name__}: {e}")
            self._fail(error)
            raise error from e

    def _dead_worker(self, grace_s: float) -> EngineDeadError | None:
        """A spawned worker whose process has ended, or ends within `grace_s`; None if all still run."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        for s in wait(list(sentinels), timeout=grace_s) if sentinels else ():
            rank, p = sentinels[s]
            p.join(0)
            return EngineDeadError(f"tensor-parallel worker rank {rank} exited (code {p.exitcode})")
        return None

    def rank_stats(self) -> list[dict[str, float | int]]:
        out = [rank_stats(0, self.runner) | {"control_seconds": self.control_seconds}]
        for r in range(1, self.world):
            key = f"stats/{r}"
            try:
                out.append(json.loads(self.store.get(key)) if self.store.check([key]) else {"rank": r})
            except Exception:  # a store that is gone (a failed engine) has no figures, which is no reason to raise
                out.append({"rank": r})
        return out

    def close(self) -> None:
        """Tell the workers to stop, wait for them (a few seconds at most), and drop the groups."""
        if self._closing:
            return
        self._closing = True
        self._watch_stop.set()
        ctl = getattr(self, "ctl", None)
        if ctl is not None and self._failure is None:
            try:
                control.send(ctl, control.STOP, datetime.timedelta(seconds=5))
            except Exception as e:
                log.warning("could not tell the workers to stop (%s)", type(e).__name__)
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        # NOTE: process groups must go before the interpreter exits: one destroyed at exit with a peer gone aborts
        self.ctl = None
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.group.pg = None  # type: ignore[attr-defined]
