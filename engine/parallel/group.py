"""The collectives a tensor-parallel model runs: all-reduce and all-gather over one group of ranks.

A `Group` wraps a torch.distributed process group (gloo on CPU, NCCL on CUDA, HCCL through torch_npu) used as an
object, not through torch.distributed's global default group: several engines (a test's TP=1 and TP=2, or
data-parallel replicas) can then live in one process. `SingleGroup` is the one-rank group every model is built
with when it runs alone; its collectives are no-ops, so a layer never asks how many ranks there are at run time.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class Group:
    """One rank's view of a tensor-parallel group: its rank, the size, and the time spent communicating."""

    rank: int = 0
    size: int = 1

    def __init__(self) -> None:
        self.comm_seconds = 0.0  # wall time inside collectives, waits for slower ranks included
        self.num_collectives = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `x`, in place."""
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, in rank order."""
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value`: how ranks agree on a limit each measured for itself."""
        return value


class SingleGroup(Group):
    """A model that runs alone: every collective is the identity."""


class TorchGroup(Group):
    """A torch.distributed ProcessGroup built with the engine's collective timeout: a collective that waits
    longer raises, so a rank that hangs fails the step instead of hanging the engine. A rank that dies fails it
    at once (gloo: its sockets close)."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, size: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.pg, self.rank, self.size = pg, rank, size
        self.device = device or torch.device("cpu")  # where the backend takes tensors (NCCL: the rank's GPU)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        self.pg.allreduce([x]).wait()
        self._count(t0)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        t0 = time.perf_counter()
        self.pg.allgather([parts], [x]).wait()
        self._count(t0)
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def _count(self, t0: float) -> None:
        # NOTE: on CPU (gloo) wait() returns when the data is there; on CUDA it only orders the stream, so this
        # is the host's share and the device time shows in the step time instead
        self.comm_seconds += time.perf_counter() - t0
        self.num_collectives += 1
