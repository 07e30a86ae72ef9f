from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.select import GemmPlan


class Linear(nn.Module):
    """y = x W^T + b. On CPU the engine swaps the weight for a GemmPlan (engine.kernels.select): packed copies
    for the paths measured fastest on this machine, one per batch-size class."""

    bf16_storage = True  # the loader may keep this weight as bf16 for the bf16 kernel (engine.loader)
    packable = True  # False: something reads the plain weight, so it stays as it is

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.plan: GemmPlan | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan is not None:
            return self.plan(x)
        return F.linear(x, self.weight, self.bias)

    def use_plan(self, plan: GemmPlan) -> None:
        """Run through `plan` from now on; the plain weight is dropped (the plan holds what it needs)."""
        self.plan = plan
        self.drop_plain_weight()

    def drop_plain_weight(self) -> None:
        """Something else holds this layer's weight in its own layout (a GemmPlan, a grouped kernel)."""
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)


class MergedLinear(Linear):
    """Several projections of the same input stored as one matrix (q/k/v, gate/up): one GEMM instead of 2-3.

    `checkpoint_starts` (tensor parallel): where this rank's rows of each projection begin in the checkpoint's
    tensor; the loader reads only those `shard_sizes[name]` rows."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        checkpoint_starts: dict[str, int] | None = None,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.checkpoint_starts = checkpoint_starts or {}
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def checkpoint_rows(self, shard: str) -> tuple[int, int] | None:
        """The checkpoint rows (start, count) of `shard` this rank loads; None: the whole tensor."""
        start = self.checkpoint_starts.get(shard)
        return None if start is None else (start, self.shard_offsets[shard][1])

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        offset, size = self.shard_offsets[shard]
        assert loaded.shape[0] == size, f"shard {shard}: expected {size} rows, got {loaded.shape[0]}"
        param.data[offset : offset + size].copy_(loaded)
