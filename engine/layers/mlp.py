from __future__ import annotations

import torch
from torch import nn

from engine.kernels.select import GemmPlan
from engine.layers.activation import ActAndMul
from engine.layers.linear import MergedLinear
from engine.layers.parallel import row_linear, split
from engine.parallel.group import Group, SingleGroup


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): Llama-family MLPs, DeepSeek's dense layers, routed and shared experts.

    With a `group` of several ranks each holds a slice of the intermediate size (gate/up column-parallel, down
    row-parallel); its output is then a partial sum that `reduce` (or the caller, for several at once) all-reduces.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        group: Group | None = None,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        g = self.group = group or SingleGroup()
        start, n = split(intermediate_size, g, "the MLP's intermediate size")
        starts = {"gate": start, "up": start} if g.size > 1 else None
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": n, "up": n}, bias, starts)
        self.down_proj = row_linear(intermediate_size, hidden_size, bias, g)
        self.act = ActAndMul(hidden_act)
        self.reduce = reduce  # False: the caller sums this partial output with others in one all-reduce
        self.gate_up_act: GemmPlan | None = None  # gate_up_proj and act as one plan (a GEMM may fuse the act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_act(x) if self.gate_up_act is not None else self.act(self.gate_up_proj(x))
        out = self.down_proj(h)
        return self.group.all_reduce(out) if self.reduce else out

    def use_plan(self, plan: GemmPlan) -> None:
        """`plan` computes act(gate_up_proj(x)); gate_up_proj's plain weight is dropped."""
        self.gate_up_act = plan
        self.gate_up_proj.use_plan(plan)
