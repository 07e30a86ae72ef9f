from __future__ import annotations

import torch
from torch import nn

from engine.kernels.gemm import GemmKernel
from engine.layers.activation import act_and_mul
from engine.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): Llama-family MLPs, DeepSeek's dense layers, routed and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        sizes = {"gate": intermediate_size, "up": intermediate_size}
        self.gate_up_proj = MergedLinear(hidden_size, sizes, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)
        self.act = act_and_mul(hidden_act)
        self.is_silu = hidden_act in ("silu", "swish")
        self.act_fused = False  # gate_up_proj itself returns silu(gate) * up (fuse_silu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        return self.down_proj(h if self.act_fused else self.act(h))

    def fuse_silu(self, batch_hint: int, kernel: GemmKernel) -> bool:
        """Pack gate_up_proj for a kernel whose GEMM applies silu(gate) * up itself (engine.kernels.bf16mm)."""
        if not self.is_silu or self.gate_up_proj.packed is not None or not kernel.accepts(self.gate_up_proj.weight):
            return False  # left to the ordinary prepacking
        self.act_fused = self.gate_up_proj.prepack(batch_hint, kernel=kernel)
        return self.act_fused
