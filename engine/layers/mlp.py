from __future__ import annotations

import torch
from torch import nn

from engine.kernels.select import GemmPlan
from engine.layers.activation import ActAndMul
from engine.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): Llama-family MLPs, DeepSeek's dense layers, routed and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        sizes = {"gate": intermediate_size, "up": intermediate_size}
        self.gate_up_proj = MergedLinear(hidden_size, sizes, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)
        self.act = ActAndMul(hidden_act)
        self.gate_up_act: GemmPlan | None = None  # gate_up_proj and act as one plan (a GEMM may fuse the act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_act(x) if self.gate_up_act is not None else self.act(self.gate_up_proj(x))
        return self.down_proj(h)

    def use_plan(self, plan: GemmPlan) -> None:
        """`plan` computes act(gate_up_proj(x)); gate_up_proj's plain weight is dropped."""
        self.gate_up_act = plan
        self.gate_up_proj.use_plan(plan)
