"""What a Linear layer needs from a CPU GEMM kernel (engine.kernels.wbf16, engine.kernels.bf16mm)."""

from __future__ import annotations

from typing import Protocol

import torch


class GemmKernel(Protocol):
    def accepts(self, weight: torch.Tensor) -> bool:
        """Whether this weight can go to the kernel without changing results."""
        ...

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] weight → the kernel's own layout."""
        ...

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] → x W^T + b, [..., N]."""
        ...
