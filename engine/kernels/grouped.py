"""Several linear layers of one shape in one kernel call: a MoE layer's routed experts, MLA's per-head W_UK / W_UV.

A decode batch gives each of them a handful of rows, and a GEMM call each paid a parallel region and a Python round
trip (~135 us a call for ~10 us of streaming, DeepSeek-V2-tiny's experts at batch 32 on a 2-core Xeon). The
kernels that offer a grouped entry point (engine.kernels.amxmm on AMX, engine.kernels.bf16mm on AVX512-BF16, both
bf16 math; engine.kernels.wbf16 for float32 math over bf16 weights) are timed against a GEMM per layer at start
(engine.kernels.op_choice) and used only where they win.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from engine.kernels.gemm import interleave_halves
from engine.kernels.program import OP_GROUPED, ProgramBuilder, address


class GroupedKernel(Protocol):
    """A compiled kernel over bf16 weights with a grouped entry point."""

    k_multiple: int  # K must be a multiple of this (the kernel's k step)
    dtype: torch.dtype  # of the activations in and out: bf16 (bf16 math) or float32 (float32 math)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bf16 weight → the kernel's own layout."""
        ...

    def grouped(
        self, counts: ctypes.Array, n: int, k: int, x: torch.Tensor, weights: ctypes.Array, y: torch.Tensor,
        silu_mul: bool,
    ) -> None:  # fmt: skip
        """Group g's counts[g] rows of x (group-major) through packed weight g (pointers in `weights`) into y."""
        ...

    def grouped_entry(self) -> object:
        """`grouped`'s C entry point."""
        ...


def check_groups(counts: list[int], groups: int, x: torch.Tensor, k: int) -> None:
    """ValueError unless `counts` gives each of `groups` layers a number of rows (none negative) that together are
    x's [rows, k]. WHY: the grouped C entry points trust them; a wrong count reads past the weights' pointers or
    the rows of x."""
    if len(counts) != groups or sum(counts) != x.shape[0] or x.shape[-1] != k or min(counts, default=0) < 0:
        raise ValueError(f"{len(counts)} groups of {sum(counts)} rows for {groups} weights, x {tuple(x.shape)}")


class GroupedLinear:
    """Several linear layers of one shape, bf16 weights, (no bias) over consecutive row groups of one input, in one
    parallel region: group g's rows go through weight g. With `silu_mul` the weights are gated MLPs' merged
    [gate; up] projections and the result silu(gate) * up."""

    def __init__(self, kernel: GroupedKernel, weights: list[torch.Tensor], silu_mul: bool = False) -> None:
        self.kernel, self.silu_mul = kernel, silu_mul
        self.n, self.k = weights[0].shape
        self.packed = [kernel.pack(interleave_halves(w) if silu_mul else w) for w in weights]
        self._ptrs = (ctypes.c_void_p * len(weights))(*(t.data_ptr() for t in self.packed))

    @staticmethod
    def accepts(kernel: GroupedKernel, weights: list[torch.Tensor], silu_mul: bool = False) -> bool:
        """bf16 weights of one shape, K in whole k steps of `kernel` (and whole gate/up block pairs for silu_mul)."""
        if not weights:
            return False
        n, k = weights[0].shape
        same = all(w.dtype == torch.bfloat16 and w.dim() == 2 and w.shape == (n, k) for w in weights)
        return same and k % kernel.k_multiple == 0 and (not silu_mul or n % 64 == 0)

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [rows, K], group-major (counts[g] rows for group g, in order) → [rows, N] (N / 2 with silu_mul), in
        the kernel's dtype."""
        check_groups(counts, len(self.packed), x, self.k)
        x = x.to(self.kernel.dtype).contiguous()
        y = torch.empty(x.shape[0], self.n // 2 if self.silu_mul else self.n, dtype=self.kernel.dtype)
        self.kernel.grouped((ctypes.c_int64 * len(counts))(*counts), self.n, self.k, x, self._ptrs, y, self.silu_mul)
        return y

    @property
    def cols(self) -> int:
        """Output columns a row."""
        return self.n // 2 if self.silu_mul else self.n

    def emit(self, b: ProgramBuilder, counts: int, x: int, y: int) -> None:
        """This call as a decode program makes it (engine.kernels.program): counts[g] rows of x (pointers) for
        group g, rows of the kernel's dtype."""
        fn = address(self.kernel.grouped_entry())
        b.grouped(OP_GROUPED, fn, len(self.packed), counts, self.n, self.k, x, [ctypes.addressof(self._ptrs)], y,
                  self.silu_mul)  # fmt: skip
        b.keep += [*self.packed, self._ptrs]


class GroupedExperts:
    """A mixture-of-experts layer's routed experts (SiLU gated MLPs, no bias) in two calls a step instead of two
    per expert: every expert's gate/up projection with the fused SiLU, then every expert's down projection, each
    one GroupedLinear call over all experts' column blocks."""

    def __init__(self, kernel: GroupedKernel, gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> None:
        """gate_up: each expert's [2I, H] merged weight ([gate; up]); down: each expert's [H, I]."""
        self.gate_up = GroupedLinear(kernel, gate_up, silu_mul=True)
        self.down = GroupedLinear(kernel, down)

    @staticmethod
    def accepts(kernel: GroupedKernel, gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> bool:
        """Both projections GroupedLinear's, one expert each, and they chain: [2I, H] then [H, I]."""
        if not gate_up or len(gate_up) != len(down) or gate_up[0].dim() != 2 or down[0].dim() != 2:
            return False
        (n, k), (h, i) = gate_up[0].shape, down[0].shape
        chained = n == 2 * i and h == k
        return chained and GroupedLinear.accepts(kernel, gate_up, silu_mul=True) and GroupedLinear.accepts(kernel, down)

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [rows, H], expert-major (counts[e] rows for expert e, in order) → the experts' outputs, [rows, H]."""
        return self.down(self.gate_up(x, counts), counts)


def bf16_pair(w: torch.Tensor) -> torch.Tensor | None:
    """A float32 weight [N, K] as [hi | lo], [N, 2K] bf16, hi = bf16(w) and lo = bf16(w - hi), whose sum is w
    exactly; None where some value needs more bits than the two halves hold (16 significant bits: a dequantized
    int8 or int4 weight with bf16 scales fits, a float32 checkpoint's values do not)."""
    hi = w.float().to(torch.bfloat16)
    lo = (w.float() - hi.float()).to(torch.bfloat16)
    return torch.cat((hi, lo), dim=1) if torch.equal(hi.float() + lo.float(), w.float()) else None


class SplitGrouped:
    """GroupedLinear over float32 weights held exactly as two bf16 halves along K (bf16_pair), its rows fed twice
    ([x | x]): x W^T = x hi^T + x lo^T, every product and sum in float32, through a bf16-weight kernel's grouped
    call with float32 rows (wbf16's). WHY: in float32 math a W8A8 (or asymmetric W4A16) DeepSeek's kv_b_proj
    dequantizes to values bf16 cannot hold, so MLA's W_UK / W_UV had no grouped call and ran through torch.bmm,
    which kept every decode step out of programs. The halves read as many bytes as bmm's float32 copy."""

    def __init__(self, kernel: GroupedKernel, pairs: list[torch.Tensor]) -> None:
        self.kernel, self.inner = kernel, GroupedLinear(kernel, pairs)
        self.n, self.k = self.inner.n, self.inner.k // 2

    @classmethod
    def make(cls, kernel: GroupedKernel, weights: list[torch.Tensor]) -> SplitGrouped | None:
        """The call over `weights` (float32 [N, K] each), or None where the kernel's rows are not float32, a weight
        has no exact pair or the pairs do not fit the kernel."""
        if kernel.dtype != torch.float32:
            return None
        pairs = [bf16_pair(w) for w in weights]
        if any(p is None for p in pairs) or not GroupedLinear.accepts(kernel, pairs):  # type: ignore[arg-type]
            return None
        return cls(kernel, pairs)  # type: ignore[arg-type]

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """As GroupedLinear's: x [rows, K] group-major → [rows, N] float32."""
        check_groups(counts, len(self.inner.packed), x, self.k)
        return self.inner(torch.cat((x, x), dim=1), counts)

    def emit(self, b: ProgramBuilder, counts: int, x: int, y: int, heads: int, width: int) -> None:
        """This call in a decode program of up to `width` rows a group, `heads` groups: x [heads][rows][K] copied
        twice side by side into a buffer of its own, then the grouped call over the pairs."""
        es = 4  # float32 rows
        doubled = b.buffer(heads * width, 2 * self.k, dtype=torch.float32)
        for half in range(2):
            b.copy(heads, self.k * es, x, self.k * es, 0, doubled.data_ptr() + half * self.k * es, 2 * self.k * es, 0)
        self.inner.emit(b, counts, doubled.data_ptr(), y)
