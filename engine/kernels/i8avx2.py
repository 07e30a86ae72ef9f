"""W8A8 linear layers for CPUs with AVX2 but no VNNI (engine/kernels/i8avx2.c): int8 weights with a float scale
per output channel, float32 activations quantized to int8 per row inside the call exactly as compressed-tensors
defines it (engine.quant.weights.quantize_tokens), exact int32 sums by VPMADDWD over int16-widened bytes. Two
entry points: `linear` widens each weight row as it reads it, for every row of x (decode); `panel` widens a
16-column block once per 512 inputs into a buffer shared by every row (batches). Each has a gated-MLP twin with
silu(gate) * up in its epilogue (`linear_silu_mul`, `panel_silu_mul`), and `grouped` runs a MoE layer's experts in
one call.

Without VNNI, oneDNN's int8 GEMM saturates on this kind of CPU and torch._int_mm was 4x slower than the float
model (a Zen 3, 2026-12-04). The engine times this kernel against them per shape and batch class
(engine.quant.paths).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels.cbuild import Once, SelfCheckError, build, cpu_flags
from engine.kernels.gemm import CEntry, interleave_halves
from engine.kernels.program import ProgramBuilder, address
from engine.quant.weights import Int8Weight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("i8avx2.c")
NC, KC = 4, 32  # columns a tile, inputs a step (NC in i8avx2.c; K is padded to whole steps)

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@dataclass(slots=True)
class PackedInt8Rows:
    """A weight in the kernel's layout ([N4, K32] int8, zero-padded) with its scales and bias (float32 [N4];
    None without)."""

    packed: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    n: int
    k: int


# the C function a decode program calls for each entry method (I8AVX2.c_fn)
_PROGRAM_FNS = {
    "linear": "i8avx2_program_linear",
    "panel": "i8avx2_program_panel",
    "linear_silu_mul": "i8avx2_program_silu_mul",
    "panel_silu_mul": "i8avx2_program_panel_silu_mul",
}


class I8AVX2:
    """The compiled kernel: pack an int8 weight once, then run W8A8 linear layers over it (float32)."""

    dtype = torch.float32  # the rows' type, in and out (code over several kernels reads it)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for fn in (lib.i8avx2_linear, lib.i8avx2_linear_panel, lib.i8avx2_linear_silu_mul,
                   lib.i8avx2_linear_panel_silu_mul):  # fmt: skip
            fn.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            fn.restype = _int
        lib.i8avx2_grouped.argtypes = [_i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _int]
        lib.i8avx2_grouped.restype = _int

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> I8AVX2:
        return cls(build(SOURCE, flags))

    def c_fn(self, entry: str) -> ctypes._CFuncPtr:
        """The C function a decode program calls for an entry method (`linear`, `panel`: with i8mm_linear's
        arguments; `linear_silu_mul`, `panel_silu_mul`: with i8mm_linear_silu_mul's), the program's signatures for
        W8A8 (the column sums they pass are ignored)."""
        return getattr(self.lib, _PROGRAM_FNS[entry])

    @staticmethod
    def pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> PackedInt8Rows:
        """q: int8 [N, K]; scale: float [N]; bias: [N] or None → the kernel's layout."""
        n, k = q.shape
        pn, pk = -(-n // NC) * NC - n, -(-k // KC) * KC - k
        # zero weights where padded; an aligned weight is read where it lies (no second copy of the model)
        packed = F.pad(q, (0, pk, 0, pn)) if pk or pn else q.contiguous()
        b = F.pad(bias.float(), (0, pn)).contiguous() if bias is not None else None
        return PackedInt8Rows(packed, F.pad(scale.float(), (0, pn)).contiguous(), b, n, k)

    def linear(self, x: torch.Tensor, w: PackedInt8Rows) -> torch.Tensor:
        """x [..., K] → x W^T + b, [..., N] float32 (the weight widened per row of x)."""
        return self._call(self.lib.i8avx2_linear, x, w)

    def panel(self, x: torch.Tensor, w: PackedInt8Rows) -> torch.Tensor:
        """The same, each block of the weight widened once for every row of x."""
        return self._call(self.lib.i8avx2_linear_panel, x, w)

    def linear_silu_mul(self, x: torch.Tensor, w: PackedInt8Rows) -> torch.Tensor:
        """x [..., K] → silu(gate) * up, [..., N / 2] float32, over a gated MLP's [gate; up] weight whose rows
        (scales, bias) were interleaved in blocks of 32 (interleave_halves; N % 64 == 0): gate and up are the
        floats `linear` gives, SiLU as the float32 kernels write it (wbf16.c)."""
        assert w.n % 64 == 0, "a fused gated MLP's N is a multiple of 64"
        return self._call(self.lib.i8avx2_linear_silu_mul, x, w, w.n // 2)

    def panel_silu_mul(self, x: torch.Tensor, w: PackedInt8Rows) -> torch.Tensor:
        """The same through the panel (the same bits)."""
        assert w.n % 64 == 0, "a fused gated MLP's N is a multiple of 64"
        return self._call(self.lib.i8avx2_linear_panel_silu_mul, x, w, w.n // 2)

    def grouped_entry(self) -> ctypes._CFuncPtr:
        """`grouped`'s C entry point, which a decode program calls itself (engine.kernels.program)."""
        return self.lib.i8avx2_grouped

    def grouped(
        self, x: torch.Tensor, counts: ctypes.Array, shape: tuple[int, int], weights: tuple[ctypes.Array, ...],
        silu_mul: bool,
    ) -> torch.Tensor:  # fmt: skip
        """Layer e's counts[e] consecutive rows of x [rows, K] (float32, contiguous) through packed weight e
        (`weights`: the packed weights', column sums' and scales' pointers, I8MM.grouped's; the column sums are
        ignored and may be NULL; all [N, K], no bias) in one call → [rows, N] float32, or [rows, N / 2] =
        silu(gate) * up where the weights are gated MLPs' [gate; up] rows interleaved in blocks of 32 (N a multiple
        of 64). Each expert's rows get the bits `linear` (`linear_silu_mul`) gives them alone. The C side trusts its
        arguments: engine.quant.grouped checks them."""
        n, k = shape
        assert not silu_mul or n % 64 == 0, "a fused gated MLP's N is a multiple of 64"
        y = torch.empty(x.shape[0], n // 2 if silu_mul else n, dtype=torch.float32)
        rc = self.lib.i8avx2_grouped(
            len(counts), counts, n, k, x.data_ptr(), *weights, y.data_ptr(), torch.get_num_threads(), int(silu_mul)
        )
        if rc != 0:
            raise MemoryError("i8avx2: no memory for the quantized rows")
        return y

    @staticmethod
    def _call(fn: ctypes._CFuncPtr, x: torch.Tensor, w: PackedInt8Rows, n: int | None = None) -> torch.Tensor:
        """fn (an entry with i8avx2_linear's arguments) over x's rows → [..., n] float32 (n: N unless fused)."""
        n = w.n if n is None else n
        x2 = x.reshape(-1, w.k).float().contiguous()
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        rc = fn(
            x2.shape[0], w.n, w.k, x2.data_ptr(), w.packed.data_ptr(), w.scale.data_ptr(),
            w.bias.data_ptr() if w.bias is not None else None, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("i8avx2: no memory for the quantized rows or a widened panel")
        return y.view(*x.shape[:-1], n)


def i8avx2_entry(fn: ctypes._CFuncPtr, w: PackedInt8Rows, silu: bool = False) -> CEntry:
    """How a decode program calls `fn` (I8AVX2.c_fn) over `w` with float32 rows: N columns out, or with `silu` (a
    fused entry over an interleaved [gate; up] weight) N / 2 of silu(gate) * up."""
    bias = w.bias.data_ptr() if w.bias is not None else None

    def emit(builder: ProgramBuilder, k: int, x: int, y: int) -> None:
        builder.i8mm(address(fn), w.n, w.k, x, w.packed.data_ptr(), None, w.scale.data_ptr(), bias, y, silu)

    keep = tuple(t for t in (w.packed, w.scale, w.bias) if t is not None)
    return CEntry(w.n // 2 if silu else w.n, torch.float32, emit, keep)


def self_check(kernel: I8AVX2) -> None:
    """Both entry points: column and K tails, row tails of the panel's tiles and passes, more than one panel chunk
    of inputs, the products at their extremes (-128 against -128); then both fused gated-MLP entries."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 70, 33), (7, 130, 64), (33, 64, 9), (3, 16, 256), (98, 20, 1100)):
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        q[:, : k // 2] = 127
        q[::2, : k // 2] = -128
        scale = torch.rand(n, generator=g) * 0.02 + 1e-3
        bias = torch.randn(n, generator=g)
        x = torch.randn(m, k, generator=g)
        x[:, : k // 2] = -1.0  # every row's largest magnitude is negative: it quantizes to -128
        want = Int8Weight(q, scale).reference(x, bias)
        packed = I8AVX2.pack(q, scale, bias)
        for entry in (kernel.linear, kernel.panel):
            got = entry(x, packed)
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()):
                err = (got - want).abs().max().item()
                raise SelfCheckError(f"i8avx2 {entry.__name__} self-check failed at {m}x{n}x{k}: max error {err:.3g}")
    # the fused entries against `linear` and SiLU in torch: units of 64 columns, K tails, more than one pass and chunk
    for m, n, k in ((1, 128, 33), (5, 64, 96), (98, 192, 1100)):
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale, bias = torch.rand(n, generator=g) * 0.02 + 1e-3, torch.randn(n, generator=g)
        x = torch.randn(m, k, generator=g)
        gate, up = kernel.linear(x, I8AVX2.pack(q, scale, bias)).chunk(2, dim=-1)
        want = F.silu(gate) * up
        fused = I8AVX2.pack(interleave_halves(q), interleave_halves(scale), interleave_halves(bias))
        for entry in (kernel.linear_silu_mul, kernel.panel_silu_mul):
            got = entry(x, fused)
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()):
                raise SelfCheckError(f"i8avx2 {entry.__name__} self-check failed at {m}x{n}x{k}")


def supported() -> bool:
    """AVX2 (VPMADDWD and VPMOVSXBW on 256 bits)."""
    return "avx2" in cpu_flags()


_once = Once(I8AVX2.build, log, "W8A8 layers will use torch._int_mm (slower)", check=self_check)
# the same kernel without its software prefetch (PF_TILES was set on one Zen 3): timed beside it, never forced
_once_plain = Once(
    lambda: I8AVX2.build(("-march=native", "-DPF_TILES=0")),
    log,
    "W8A8 layers are not timed without software prefetch",
    check=self_check,
)


def kernel() -> I8AVX2 | None:
    """The process-wide kernel; None without AVX2, or (logged once) where it can't be built."""
    return _once() if supported() else None


def kernel_without_prefetch() -> I8AVX2 | None:
    """The kernel built with no prefetch ahead (PF_TILES=0: it asks for the tile it reads), as kernel() otherwise."""
    return _once_plain() if supported() else None
