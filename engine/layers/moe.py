"""DeepSeekMoE: a router over routed experts plus always-on shared experts.

Over several ranks the router is replicated (every rank routes every token alike) and the MoE's output is one
all-reduce of partial outputs. Tensor parallel: every expert, shared ones included, holds a slice of its
intermediate size. Expert parallel: each rank holds whole experts, a contiguous 1/ranks of them, and runs only
the (token, expert) pairs routed to those; the shared experts are replicated and added once, by rank 0. The
tokens are replicated across ranks already (attention's all-reduce), so no dispatch is needed before the experts:
the all-reduce is the combine, the same one collective tensor parallel pays (benchmarks/parallel.py measures it).
An all-to-all dispatch pays off only where attention is data parallel (tokens split over ranks), not built yet."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.grouped import GroupedExperts
from engine.kernels.pointwise import PointwiseKernels, moe_combine
from engine.layers.mlp import GatedMLP
from engine.layers.parallel import split
from engine.parallel.group import Group, SingleGroup

if TYPE_CHECKING:
    from engine.kernels.kernel_set import CpuKernels


class MoEGate(nn.Module):
    """Top-k expert choice as transformers' DeepseekV2TopkRouter (softmax; greedy or group-limited greedy)
    and DeepseekV3TopkRouter (sigmoid + e_score_correction_bias, groups ranked by their top-2 sum)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring: str,  # "softmax" (V2) | "sigmoid" (V3, noaux_tc)
        num_groups: int,
        topk_groups: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        assert scoring in ("softmax", "sigmoid") and num_experts % num_groups == 0
        self.top_k, self.scoring, self.num_groups, self.topk_groups = top_k, scoring, num_groups, topk_groups
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        # NOTE: routing stays in float32 whatever the model dtype, as transformers keeps gate.weight in fp32
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        if scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)  # [T, E]
        if self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
            choice, fill = scores, 0.0
        else:
            scores = logits.sigmoid()
            choice, fill = scores + self.e_score_correction_bias, float("-inf")
        if self.num_groups > 1:
            grouped = choice.view(x.shape[0], self.num_groups, -1)  # [T, G, E / G]
            rank = grouped.max(-1).values if self.scoring == "softmax" else grouped.topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(rank, dtype=torch.bool)
            keep.scatter_(1, rank.topk(self.topk_groups, dim=-1)[1], True)  # [T, G]
            choice = choice.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).flatten(1), fill)
        ids = choice.topk(self.top_k, dim=-1)[1]  # [T, K]
        # NOTE: transformers' V2 router (unlike DeepSeek's remote code) ignores norm_topk_prob; so do we
        weights = choice.gather(1, ids) if self.scoring == "softmax" else scores.gather(1, ids)  # [T, K]
        if self.norm_topk_prob and self.scoring == "sigmoid":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class _Elsewhere(nn.Module):
    """A routed expert that another expert-parallel rank holds: no weights here, never run here."""


class MoE(nn.Module):
    def __init__(
        self,
        gate: MoEGate,
        hidden_size: int,
        moe_intermediate_size: int,
        num_shared_experts: int,
        hidden_act: str,
        shared_bias: bool = False,
        group: Group | None = None,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.gate, g = gate, group or SingleGroup()
        self.group = g
        self.num_experts = gate.weight.shape[0]
        ep = expert_parallel and g.size > 1
        self.first, local = split(self.num_experts, g, "n_routed_experts") if ep else (0, self.num_experts)
        inner = SingleGroup() if ep else g  # an expert parallel rank holds whole experts
        self.num_local = local
        # NOTE: every expert keeps its checkpoint number (experts.N.*); another rank's is an empty placeholder
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe_intermediate_size, hidden_act, group=inner, reduce=False)
            if self.first <= e < self.first + local
            else _Elsewhere()
            for e in range(self.num_experts)
        )
        self.shared_experts = None
        self.shared_here = not ep or g.rank == 0  # replicated under expert parallel: rank 0 adds them once
        if num_shared_experts:
            size = moe_intermediate_size * num_shared_experts
            self.shared_experts = GatedMLP(hidden_size, size, hidden_act, shared_bias, inner, reduce=False)

        # this rank's experts in one call (bind_kernels): GroupedExperts, or quantized ones' GroupedQuantExperts
        self.grouped: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None
        self.combine = moe_combine  # or the same in one C pass (bind_kernels)
        self.router: PointwiseKernels | None = None  # the routing and grouping in one C pass (bind_kernels)

    def local_experts(self) -> list[GatedMLP]:
        return list(self.experts[self.first : self.first + self.num_local])  # type: ignore[arg-type]

    def bind_kernels(self, kernels: CpuKernels) -> None:
        """Take the grouped experts kernel where it fits; the experts then keep only its layout (no GEMM plans, no
        plain weights)."""
        self.combine = kernels.moe_combine.moe_combine if kernels.moe_combine is not None else moe_combine
        self.router = kernels.moe_route
        experts = self.local_experts()
        linears = [lin for e in experts for lin in (e.gate_up_proj, e.down_proj)]
        if not all(lin.bias is None for lin in linears) or not all(e.act.is_silu_and_mul for e in experts):
            return
        if all(hasattr(lin, "gemm_weight") for lin in linears):  # quantized (engine.quant)
            if kernels.moe_quant is not None:
                gate_up = [e.gate_up_proj.gemm_weight() for e in experts]  # type: ignore[operator]
                self.grouped = kernels.moe_quant(gate_up, [e.down_proj.gemm_weight() for e in experts])  # type: ignore[operator]
                for lin in linears if self.grouped is not None else ():  # the grouped call holds its own copy
                    lin.packable, lin.quantized = False, None  # type: ignore[attr-defined]
            return  # otherwise they keep their GEMM plans
        plain = not any(hasattr(lin, "gemm_weight") for lin in linears)
        if kernels.moe_experts is None or not plain:
            return
        gate_up, down = [e.gate_up_proj.weight.data for e in experts], [e.down_proj.weight.data for e in experts]
        if not GroupedExperts.accepts(kernels.moe_experts, gate_up, down):
            return
        self.grouped = GroupedExperts(kernels.moe_experts, gate_up, down)
        for lin in linears:  # the grouped call holds what it needs
            lin.packable = False  # engine.kernels.bind plans them no GEMM
            lin.drop_plain_weight()

    def holds_expert(self, e: int) -> bool:
        return self.first <= e < self.first + self.num_local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_k = self.gate.top_k
        # Group the T * K (token, expert) pairs by expert so each expert runs once, on just its tokens.
        xs: torch.Tensor | None = None
        if self.router is not None and self.router.routes(x, self.gate):
            weights, _, order, by_expert, xs = self.router.route(x, self.gate)
            counts = by_expert.tolist()
        else:
            weights, ids = self.gate(x)  # [T, K]
            flat = ids.flatten()
            order = flat.argsort(stable=True)  # [T * K]
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        lo = sum(counts[: self.first])  # the pairs of this rank's experts: rows [lo, hi) in expert-major order
        hi = lo + sum(counts[self.first : self.first + self.num_local])
        order = order[lo:hi]
        xs = xs[lo:hi] if xs is not None else x[order // top_k]  # [pairs, hidden], expert-major
        mine = slice(self.first, self.first + self.num_local)
        if self.grouped is not None:
            ys = self.grouped(xs, counts[mine])
        else:
            ys, start = torch.empty_like(xs), 0
            for expert, n in zip(self.experts[mine], counts[mine], strict=True):
                if n:
                    ys[start : start + n] = expert(xs[start : start + n])
                    start += n
        shared = self.shared_experts(x) if self.shared_experts is not None and self.shared_here else None
        return self.group.all_reduce(self.combine(ys, order, weights, shared, x.shape[0]))  # [T, hidden]
