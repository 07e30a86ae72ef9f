"""A MoE layer's quantized routed experts in two kernel calls a step (the grouped entry points of
engine.kernels.w4mm, or w4amx on AMX CPUs, for W4A16 and engine.kernels.i8mm, or i8amx on AMX CPUs, for W8A8; in
float32 math w4f32's and i8avx2's): every expert's gate/up projection with the fused SiLU, then every expert's down
projection; rows in and out in the kernel's type (bf16, or float32 for w4f32 and i8avx2).

The bf16 experts have had this since engine.kernels.grouped; quantized ones ran a GEMM plan per expert and
projection, a Python round trip and a parallel region each (~25 us on a 2-core Zen 4), two per active expert
and layer: hundreds a decode step at batch 32. engine.kernels.op_choice times this against a call per expert
and the MoE layer takes it only where it wins.
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.grouped import check_groups
from engine.kernels.i8amx import I8AMX
from engine.kernels.i8avx2 import I8AVX2
from engine.kernels.i8mm import I8MM
from engine.kernels.program import OP_GROUPED_I8, OP_GROUPED_W4, ProgramBuilder, address
from engine.kernels.w4_builds import compact_scales, is_compact
from engine.kernels.w4amx import W4AMX
from engine.kernels.w4f32 import W4F32
from engine.kernels.w4mm import W4MM
from engine.kernels.w4vnni import W4VNNI
from engine.quant.paths import W4F32Path, W4MMPath, interleaved
from engine.quant.weights import Int4Weight, Int8Weight, QuantWeight

# w4mm's packed layout serves the bf16 W4 kernels, i8mm's both bf16 W8 ones; w4f32 and i8avx2 (float32 rows) have
# layouts of their own
QuantKernel = W4MM | W4AMX | W4VNNI | I8MM | I8AMX | W4F32 | I8AVX2
W4_KERNELS = (W4MM, W4AMX, W4VNNI, W4F32)


def rows_dtype(kernel: QuantKernel) -> torch.dtype:
    """The type of the rows a kernel's grouped call takes and gives (i8mm's float32-rows form says its own)."""
    return torch.float32 if isinstance(kernel, W4F32 | I8AVX2) else getattr(kernel, "rows", torch.bfloat16)


def _layout(kernel: QuantKernel) -> type:
    """The kernels that share one packed copy of a weight: one class stands for its family."""
    if isinstance(kernel, W4F32 | I8AVX2):
        return type(kernel)
    return W4MM if isinstance(kernel, W4MM | W4AMX | W4VNNI) else I8MM


def shares_packing(a: QuantKernel, b: QuantKernel) -> bool:
    """Whether two kernels' grouped calls run over one packed copy (a GroupedQuantLinear `like` the other)."""
    return _layout(a) is _layout(b) and is_compact(a) == is_compact(b)


def _pointers(tensors: list[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


class GroupedQuantLinear:
    """Quantized linear layers of one shape and scheme (no bias) over consecutive row groups of one input."""

    def __init__(
        self, kernel: QuantKernel, weights: list[QuantWeight], silu_mul: bool = False,
        like: GroupedQuantLinear | None = None,
    ) -> None:  # fmt: skip
        """like: the same weights for another kernel of the scheme, whose packed copies this one shares (the bf16
        W4A16 kernels share w4mm's layout, the bf16 W8A8 ones i8mm's)."""
        self.kernel, self.silu_mul = kernel, silu_mul
        self.n, self.k = weights[0].shape
        if like is not None:
            assert shares_packing(kernel, like.kernel)
            self.packed, self.shape, self.pointers = like.packed, like.shape, like.pointers
            return
        ws = [interleaved(w) if silu_mul else w for w in weights]
        if isinstance(kernel, W4_KERNELS):
            pack = W4F32Path.pack if isinstance(kernel, W4F32) else W4MMPath.pack
            self.packed: list[object] = [pack(w, is_compact(kernel)) for w in ws]  # type: ignore[arg-type]
            self.shape: tuple[int, ...] = (self.n, self.k, weights[0].group_size)  # type: ignore[union-attr]
            self.pointers = tuple(_pointers([getattr(p, f) for p in self.packed]) for f in ("nibbles", "scales"))
        elif isinstance(kernel, I8AVX2):  # its rows need no column sums: a null pointer for each
            self.packed = [I8AVX2.pack(w.q, w.scale) for w in ws]  # type: ignore[union-attr]
            self.shape = (self.n, self.k)
            packed, scales = (_pointers([getattr(p, f) for p in self.packed]) for f in ("packed", "scale"))
            self.pointers = (packed, (ctypes.c_void_p * len(ws))(), scales)
        else:
            self.packed = [I8MM.pack(w.q, w.scale) for w in ws]  # type: ignore[union-attr]
            self.shape = (self.n, self.k)
            fields = ("packed", "colsum", "scale")
            self.pointers = tuple(_pointers([getattr(p, f) for p in self.packed]) for f in fields)

    @staticmethod
    def accepts(kernel: QuantKernel, weights: list[object], silu_mul: bool = False) -> bool:
        """Weights of one shape (and group size) of the kernel's scheme that it takes (N a multiple of 64 for
        silu_mul)."""
        if not weights or (silu_mul and weights[0].shape[0] % 64):  # type: ignore[attr-defined]
            return False
        if isinstance(kernel, W4_KERNELS):
            if not all(isinstance(w, Int4Weight) for w in weights):
                return False
            (n, k), g = weights[0].shape, weights[0].group_size  # type: ignore[attr-defined]
            same = all(w.shape == (n, k) and w.group_size == g for w in weights)  # type: ignore[attr-defined]
            # a compact-scales build only over scales of bf16 values (what the kernel choices give it: for_scales)
            exact = not is_compact(kernel) or all(compact_scales(w.scale) for w in weights)  # type: ignore[attr-defined]
            return same and exact and kernel.accepts(n, k, g)
        shape = weights[0].shape  # type: ignore[attr-defined]
        if isinstance(kernel, I8AMX) and not I8AMX.accepts(shape[1]):
            return False
        grouped = isinstance(kernel, I8AVX2) or kernel.has_grouped
        return grouped and all(isinstance(w, Int8Weight) and w.shape == shape for w in weights)

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [rows, K], group-major (counts[g] rows for group g, in order) → [rows, N] (N / 2 with silu_mul), in
        the kernel's row type (rows_dtype)."""
        check_groups(counts, len(self.packed), x, self.k)
        x = x.to(rows_dtype(self.kernel)).contiguous()
        c = (ctypes.c_int64 * len(counts))(*counts)
        if isinstance(self.kernel, W4_KERNELS):
            return self.kernel.grouped(x, c, self.shape, *self.pointers, self.silu_mul)  # type: ignore[arg-type]
        return self.kernel.grouped(x, c, self.shape, self.pointers, self.silu_mul)  # type: ignore[arg-type]

    @property
    def cols(self) -> int:
        """Output columns a row."""
        return self.n // 2 if self.silu_mul else self.n

    def emit(self, b: ProgramBuilder, counts: int, x: int, y: int) -> None:
        """This call as a decode program makes it (engine.kernels.program): counts[g] rows of x (pointers) for
        group g, in the kernel's row type."""
        fn = address(self.kernel.grouped_entry())
        pointers = [ctypes.addressof(p) for p in self.pointers]
        w4 = isinstance(self.kernel, W4_KERNELS)
        kind, group = (OP_GROUPED_W4, self.shape[2]) if w4 else (OP_GROUPED_I8, 0)
        b.grouped(kind, fn, len(self.packed), counts, self.n, self.k, x, pointers, y, self.silu_mul, group)
        b.keep += [*self.packed, *self.pointers]


class GroupedQuantExperts:
    """A MoE layer's routed experts (SiLU gated MLPs, no bias, W4A16 or W8A8) in two grouped calls."""

    def __init__(
        self, kernel: QuantKernel, gate_up: list[QuantWeight], down: list[QuantWeight],
        one_token: QuantKernel | None = None, top_k: int = 1,
    ) -> None:  # fmt: skip
        """gate_up: each expert's [2I, H] merged weight ([gate; up]); down: each expert's [H, I]. one_token: the
        kernel for a single token's top_k rows, where another timed faster there (op_choice), over the same packed
        copies."""
        self.gate_up = GroupedQuantLinear(kernel, gate_up, silu_mul=True)
        self.down = GroupedQuantLinear(kernel, down)
        self.top_k = top_k
        self.one: tuple[GroupedQuantLinear, GroupedQuantLinear] | None = None
        if one_token is not None and one_token is not kernel:
            up = GroupedQuantLinear(one_token, gate_up, silu_mul=True, like=self.gate_up)
            self.one = (up, GroupedQuantLinear(one_token, down, like=self.down))

    def projections(self, rows: int) -> tuple[GroupedQuantLinear, GroupedQuantLinear]:
        """The gate/up and down calls for `rows` routed rows: the one-token kernel's for at most top_k."""
        return self.one if self.one is not None and rows <= self.top_k else (self.gate_up, self.down)

    @staticmethod
    def accepts(kernel: QuantKernel, gate_up: list[object], down: list[object]) -> bool:
        """Both projections GroupedQuantLinear's, one expert each, and they chain: [2I, H] then [H, I]."""
        if not gate_up or len(gate_up) != len(down):
            return False
        fits = GroupedQuantLinear.accepts(kernel, gate_up, silu_mul=True) and GroupedQuantLinear.accepts(kernel, down)
        if not fits:
            return False
        (n, k), (h, i) = gate_up[0].shape, down[0].shape  # type: ignore[attr-defined]
        return n == 2 * i and h == k

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [rows, H], expert-major (counts[e] rows for expert e, in order) → the experts' outputs, [rows, H]."""
        up, down = self.projections(x.shape[0])
        return down(up(x, counts), counts)
