"""A MoE layer's W4A16 routed experts in two kernel calls a step (engine.kernels.w4mm's grouped entry point):
every expert's gate/up projection with the fused SiLU, then every expert's down projection.

The bf16 experts have had this since engine.kernels.grouped; quantized ones ran a GEMM plan per expert and
projection, a Python round trip and a parallel region each (~25 us on a 2-core Zen 4), two per active expert
and layer: hundreds a decode step at batch 32. engine.kernels.op_choice times this against a call per expert
and the MoE layer takes it only where it wins.
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.gemm import interleave_halves
from engine.kernels.w4mm import W4MM, PackedInt4
from engine.quant.paths import W4MMPath
from engine.quant.weights import Int4Weight


def _interleaved(w: Int4Weight) -> Int4Weight:
    """A gated MLP's [gate; up] rows in blocks of 32 alternating (interleave_halves), the weight's every part."""
    return Int4Weight(interleave_halves(w.packed), interleave_halves(w.scale), interleave_halves(w.zero), w.group_size)


class GroupedInt4Linear:
    """Int4 linear layers of one shape and group size (no bias) over consecutive row groups of one input."""

    def __init__(self, kernel: W4MM, weights: list[Int4Weight], silu_mul: bool = False) -> None:
        self.kernel, self.silu_mul = kernel, silu_mul
        self.n, self.k = weights[0].shape
        self.group_size = weights[0].group_size
        self.packed: list[PackedInt4] = [
            W4MMPath.pack(_interleaved(w) if silu_mul else w) for w in weights
        ]  # fmt: skip
        ptrs = ctypes.c_void_p * len(weights)
        self._nibbles = ptrs(*(p.nibbles.data_ptr() for p in self.packed))
        self._scales = ptrs(*(p.scales.data_ptr() for p in self.packed))

    @staticmethod
    def accepts(weights: list[Int4Weight], silu_mul: bool = False) -> bool:
        """Int4 weights of one shape and group size that w4mm takes (N a multiple of 64 for silu_mul)."""
        if not weights or not all(isinstance(w, Int4Weight) for w in weights):
            return False
        (n, k), g = weights[0].shape, weights[0].group_size
        same = all(w.shape == (n, k) and w.group_size == g for w in weights)
        return same and W4MM.accepts(n, k, g) and (not silu_mul or n % 64 == 0)

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [rows, K], group-major (counts[g] rows for group g, in order) → [rows, N] (N / 2 with silu_mul), bf16."""
        # NOTE: the C side trusts these: a wrong count reads past the weights' pointers or the rows of x
        if len(counts) != len(self.packed) or sum(counts) != x.shape[0] or x.shape[-1] != self.k or min(counts) < 0:
            raise ValueError(
                f"{len(counts)} groups of {sum(counts)} rows for {len(self.packed)} weights, x {tuple(x.shape)}"
            )
        x = x.to(torch.bfloat16).contiguous()
        shape = (self.n, self.k, self.group_size)
        c = (ctypes.c_int64 * len(counts))(*counts)
        return self.kernel.grouped(x, c, shape, self._nibbles, self._scales, self.silu_mul)


class GroupedInt4Experts:
    """A MoE layer's routed experts (SiLU gated MLPs, no bias, W4A16) in two grouped calls."""

    def __init__(self, kernel: W4MM, gate_up: list[Int4Weight], down: list[Int4Weight]) -> None:
        """gate_up: each expert's [2I, H] merged weight ([gate; up]); down: each expert's [H, I]."""
        self.gate_up = GroupedInt4Linear(kernel, gate_up, silu_mul=True)
        self.down = GroupedInt4Linear(kernel, down)

    @staticmethod
    def accepts(gate_up: list[object], down: list[object]) -> bool:
        """Both projections GroupedInt4Linear's, one expert each, and they chain: [2I, H] then [H, I]."""
        if not gate_up or len(gate_up) != len(down):
            return False
        if not all(isinstance(w, Int4Weight) for w in (*gate_up, *down)):
            return False
        (n, k), (h, i) = gate_up[0].shape, down[0].shape  # type: ignore[union-attr]
        fits = GroupedInt4Linear.accepts(gate_up, silu_mul=True) and GroupedInt4Linear.accepts(down)  # type: ignore[arg-type]
        return n == 2 * i and h == k and fits

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [rows, H], expert-major (counts[e] rows for expert e, in order) → the experts' outputs, [rows, H]."""
        return self.down(self.gate_up(x, counts), counts)
