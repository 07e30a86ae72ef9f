from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.kernels.pointwise import PointwiseKernels, rms_norm

if TYPE_CHECKING:
    from engine.kernels.kernel_set import CpuKernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.kernel: PointwiseKernels | None = None

    def bind_kernels(self, kernels: CpuKernels) -> None:
        self.kernel = kernels.rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the fused add saves one pass over activations."""
        if self.kernel is not None and self.kernel.takes(x, self.weight):
            return self.kernel.rms_norm(x, residual, self.weight, self.eps)
        return rms_norm(x, residual, self.weight, self.eps)
