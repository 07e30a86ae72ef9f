"""How the ranks of one tensor-parallel engine find each other and open their process groups.

Two ways in: the engine spawns its workers itself (one machine: a TCPStore on 127.0.0.1 that rank 0 hosts), or
torchrun started every rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment: its env://
rendezvous). Either way each rank then opens two groups over the same store: `tp` for the model's collectives
(gloo on CPU, NCCL on CUDA) with the engine's collective timeout, and `ctl`, always gloo, on which rank 0
broadcasts each step and where a worker waits, without a deadline, while the engine is idle.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.errors import ConfigError
from engine.parallel.group import TorchGroup

IDLE = datetime.timedelta(days=365)  # a worker waits this long for the next step: forever, in practice


def torchrun_rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """This process's rank when torchrun (or any env:// launcher) started it, else None."""
    if all(k in environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(environ["RANK"])
    return None


def local_rank(rank: int, environ: Mapping[str, str] = os.environ) -> int:
    """Which of this machine's devices the rank drives."""
    return int(environ.get("LOCAL_RANK", rank)) if torchrun_rank(environ) is not None else rank


def env_store(world: int, timeout: datetime.timedelta) -> tuple[dist.Store, int]:
    """torchrun's rendezvous: the store its agent (or rank 0) hosts, and this process's rank."""
    store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
    if size != world:
        raise ConfigError(f"torchrun started {size} ranks but tensor_parallel_size is {world}: make them equal")
    return store, rank


def local_store(world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A store on a free port of 127.0.0.1 that spawned workers join (rank 0 hosts it)."""
    return dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)


def join_store(port: int, world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)


@dataclass
class Groups:
    tp: TorchGroup
    ctl: dist.ProcessGroup  # gloo: a step's broadcast; waits without a deadline on workers


def open_groups(store: dist.Store, rank: int, world: int, device: torch.device, timeout: datetime.timedelta) -> Groups:
    """Both groups; blocks until every rank has opened them (or `timeout` passes)."""
    ctl = dist.ProcessGroupGloo(dist.PrefixStore("ctl", store), rank, world, IDLE)
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ConfigError("tensor_parallel_size > 1 on CUDA needs torch built with NCCL")
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg: dist.ProcessGroup = dist.ProcessGroupNCCL(dist.PrefixStore("tp", store), rank, world, opts)
    else:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, world, timeout)
    return Groups(TorchGroup(pg, rank, world, device), ctl)
