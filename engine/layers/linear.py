from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.gemm import GemmKernel

log = logging.getLogger(__name__)


class Linear(nn.Module):
    """y = x W^T + b. On CPU the weight is prepacked once: into the layout of one of our kernels where the
    runner has one for this dtype and CPU (engine.kernels: bf16 weights under float32 math, or AVX512-BF16),
    else into oneDNN's blocked layout (~2x faster than F.linear)."""

    bf16_storage = True  # the loader may keep this weight as bf16 for the bf16 kernel (engine.loader)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.kernel: GemmKernel | None = None  # set when `packed` is in that kernel's layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.linear(x, self.packed, self.out_features, self.bias)  # type: ignore[arg-type]
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def prepack(self, batch_hint: int, keep_weight: bool = False, kernel: GemmKernel | None = None) -> bool:
        """Swap the weight for a packed copy; False (and F.linear stays) where torch can't.

        A weight that `kernel` accepts goes to it instead of oneDNN."""
        if kernel is not None and kernel.accepts(self.weight.data):
            self.packed, self.kernel = kernel.pack(self.weight.data), kernel
            self._drop_weight(keep_weight)
            return True
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, batch_hint)
            x = torch.ones(1, self.in_features, dtype=self.weight.dtype)
            torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        except (AttributeError, RuntimeError) as e:  # private ops: missing or unsupported on this CPU
            log.debug("oneDNN prepacking unavailable (%s); using F.linear", e)
            return False
        self.packed = packed
        self._drop_weight(keep_weight)
        return True

    def _drop_weight(self, keep: bool) -> None:
        if not keep:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)


class MergedLinear(Linear):
    """Several projections of the same input stored as one matrix (q/k/v, gate/up): one GEMM instead of 2-3."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        offset, size = self.shard_offsets[shard]
        assert loaded.shape[0] == size, f"shard {shard}: expected {size} rows, got {loaded.shape[0]}"
        param.data[offset : offset + size].copy_(loaded)
