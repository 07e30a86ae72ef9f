"""A tensor-parallel worker rank: its part of the model, running every step rank 0 broadcasts, until told to stop
or until rank 0 is gone (then a collective raises and the process ends)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from engine.config import EngineConfig
from engine.loader import ModelFiles
from engine.model_runner import ModelRunner
from engine.parallel import control
from engine.parallel.launch import IDLE, join_store, local_rank, open_groups

log = logging.getLogger(__name__)
STATS_EVERY_S = 1.0  # how often a worker publishes its step and communication times (one store write)


@dataclass
class WorkerSpec:
    """What a spawned worker is started with (pickled by torch.multiprocessing into the new process)."""

    rank: int
    world: int
    port: int  # of rank 0's store on 127.0.0.1
    config: EngineConfig
    files: ModelFiles
    hf_config: dict[str, Any]
    max_model_len: int


def spawned_main(spec: WorkerSpec) -> None:
    """The entry point of a worker the engine started itself."""
    timeout = datetime.timedelta(seconds=spec.config.distributed_timeout_s)
    store = join_store(spec.port, spec.world, timeout)
    serve(store, spec.rank, spec.world, spec.config, spec.files, spec.hf_config, spec.max_model_len, spec.world)


def rank_config(config: EngineConfig, rank: int, ranks_here: int) -> EngineConfig:
    """A rank's own settings: its device (cuda:LOCAL_RANK) and, on CPU, its share of this machine's cores."""
    changes: dict[str, Any] = {}
    device = config.torch_device
    if device.type == "cuda":  # a data-parallel replica's ranks start at its first device (cuda:N)
        changes["device"] = f"cuda:{(device.index or 0) + local_rank(rank)}"
    if device.type == "cpu" and config.num_threads is None and ranks_here > 1:
        changes["num_threads"] = max(1, len(os.sched_getaffinity(0)) // ranks_here)
    return dataclasses.replace(config, **changes) if changes else config


def serve(
    store: dist.Store,
    rank: int,
    world: int,
    config: EngineConfig,
    files: ModelFiles,
    hf_config: dict[str, Any],
    max_model_len: int,
    ranks_here: int,
) -> None:
    """Open the groups, load this rank's part of the model, then run steps until rank 0 says stop."""
    config = rank_config(config, rank, ranks_here)
    timeout = datetime.timedelta(seconds=config.distributed_timeout_s)
    store.set(f"hello/{rank}", "1")
    groups = open_groups(store, rank, world, config.torch_device, timeout)
    try:
        runner = ModelRunner(config, files, hf_config, max_model_len, groups.tp)
    except Exception as e:  # rank 0 raises it as its own start-up failure
        store.set(f"ready/{rank}", json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return
    store.set(f"ready/{rank}", json.dumps({"num_blocks": runner.num_blocks}))
    runner.agree_with_ranks()  # with rank 0, once it has seen every rank ready
    last = 0.0
    while True:
        msg = control.receive(groups.ctl, IDLE)
        if msg["kind"] == "stop":
            break
        runner.execute(control.decode(msg))
        if time.monotonic() - last >= STATS_EVERY_S:
            last = time.monotonic()
            store.set(f"stats/{rank}", json.dumps(rank_stats(rank, runner)))
    store.set(f"stats/{rank}", json.dumps(rank_stats(rank, runner)))


def rank_stats(rank: int, runner: ModelRunner) -> dict[str, float | int]:
    g = runner.group
    return {
        "rank": rank,
        "steps": runner.num_steps,
        "step_seconds": runner.step_seconds,
        "comm_seconds": g.comm_seconds,
        "collectives": g.num_collectives,
    }
