"""W8A8 linear layers for CPUs with AVX512-VNNI (engine/kernels/i8mm.c): int8 weights with a float scale per
output channel, activations quantized to int8 per row inside the call, exactly as compressed-tensors defines it
(engine.quant.weights.quantize_tokens), int32 sums by VPDPBUSD. The engine times it against oneDNN's int8 GEMM
and torch._int_mm per shape and batch class (engine.quant.paths).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.kernels.cbuild import Once, SelfCheckError, build, cpu_flags
from engine.kernels.gemm import CEntry, interleave_halves
from engine.kernels.program import ProgramBuilder, address
from engine.quant.weights import Int8Weight

if TYPE_CHECKING:
    from engine.kernels.i8amx import I8AMX

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("i8mm.c")
BLOCK = 64  # output columns per packed block (NB in i8mm.c)

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@dataclass(slots=True)
class PackedInt8:
    """A weight in the kernel's layout ([N/64, K4/4, 64, 4] int8) with its columns' sums of weights, scales and
    bias (float32; None without), padded to whole blocks."""

    packed: torch.Tensor
    colsum: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    n: int
    k: int


class I8MM:
    """The compiled kernel: pack an int8 weight once, then run W8A8 linear layers over it."""

    rows = torch.bfloat16  # the grouped call's rows (engine.quant.grouped.rows_dtype)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.i8mm_linear.argtypes = [_i64, _i64, _i64, _ptr, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
        lib.i8mm_linear.restype = _int
        self.has_grouped = hasattr(lib, "i8mm_grouped")  # built where the CPU has AVX512-BF16 (bf16 rows)
        if self.has_grouped:
            lib.i8mm_grouped.argtypes = [_i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _int]
            lib.i8mm_grouped.restype = _int
        lib.i8mm_grouped_f32.argtypes = [_i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _int]
        lib.i8mm_grouped_f32.restype = _int
        self.has_silu_mul = hasattr(lib, "i8mm_linear_silu_mul")  # the same: its epilogue rounds to bf16
        if self.has_silu_mul:
            lib.i8mm_linear_silu_mul.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            lib.i8mm_linear_silu_mul.restype = _int
        lib.i8mm_linear_silu_mul_f32.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
        lib.i8mm_linear_silu_mul_f32.restype = _int

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> I8MM:
        return cls(build(SOURCE, flags))

    def c_fn(self, entry: str) -> ctypes._CFuncPtr | None:
        """The C function behind `linear`, `linear_silu_mul` or `linear_silu_mul_f32` (a decode program calls it:
        i8_entry)."""
        if entry == "linear":
            return self.lib.i8mm_linear
        if entry == "linear_silu_mul_f32":
            return self.lib.i8mm_linear_silu_mul_f32
        return self.lib.i8mm_linear_silu_mul if entry == "linear_silu_mul" and self.has_silu_mul else None

    @staticmethod
    def pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> PackedInt8:
        """q: int8 [N, K]; scale: float [N]; bias: [N] or None → the kernel's layout."""
        n, k = q.shape
        blocks, k4 = -(-n // BLOCK), -(-k // 4) * 4
        padded = F.pad(q, (0, k4 - k, 0, blocks * BLOCK - n))  # zero weights
        packed = padded.view(blocks, BLOCK, k4 // 4, 4).permute(0, 2, 1, 3).contiguous().view(-1)
        colsum = padded.sum(dim=1, dtype=torch.int32)
        b = F.pad(bias.float(), (0, blocks * BLOCK - n)) if bias is not None else None
        return PackedInt8(packed, colsum, F.pad(scale.float(), (0, blocks * BLOCK - n)), b, n, k)

    def linear(self, x: torch.Tensor, w: PackedInt8) -> torch.Tensor:
        """x [..., K] (bf16 or float32) → x W^T + b, [..., N] of x's dtype."""
        return self.run(self.lib.i8mm_linear, x, w, "i8mm")

    def linear_silu_mul(self, x: torch.Tensor, w: PackedInt8) -> torch.Tensor:
        """x [..., K] → silu(gate) * up, [..., N / 2] bf16, over a gated MLP's [gate; up] weight packed with its
        rows interleaved in blocks of 32 (interleave_halves; N % 64 == 0), rounded as the unfused bf16 code."""
        return self.run_silu_mul(self.lib.i8mm_linear_silu_mul, x, w, "i8mm")

    def linear_silu_mul_f32(self, x: torch.Tensor, w: PackedInt8) -> torch.Tensor:
        """linear_silu_mul over float32 rows: [..., N / 2] float32, silu(gate) * up in float32 (float32 math)."""
        return self.run_silu_mul(self.lib.i8mm_linear_silu_mul_f32, x, w, "i8mm", torch.float32)

    @staticmethod
    def run_silu_mul(
        fn: ctypes._CFuncPtr, x: torch.Tensor, w: PackedInt8, name: str, dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """Calls a fused gated-MLP entry point over the interleaved copy (i8mm's, i8amx's): fn(M, N, K, x, packed,
        colsum, scale, b, y, threads) → 0, or -1 without memory for the quantized rows; y [..., N / 2] of the
        entry's row type `dtype` (bf16, or float32 for i8mm_linear_silu_mul_f32)."""
        x2 = x.reshape(-1, w.k).to(dtype).contiguous()
        y = torch.empty(x2.shape[0], w.n // 2, dtype=dtype)
        rc = fn(
            x2.shape[0], w.n, w.k, x2.data_ptr(), w.packed.data_ptr(), w.colsum.data_ptr(), w.scale.data_ptr(),
            w.bias.data_ptr() if w.bias is not None else None, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError(f"{name}: no memory for the quantized rows")
        return y.view(*x.shape[:-1], w.n // 2)

    def grouped_entry(self) -> object:
        """`grouped`'s C entry point, which a decode program calls itself (engine.kernels.program)."""
        return self.lib.i8mm_grouped

    def grouped(
        self, x: torch.Tensor, counts: ctypes.Array, shape: tuple[int, int], weights: tuple[ctypes.Array, ...],
        silu_mul: bool,
    ) -> torch.Tensor:  # fmt: skip
        """Layer e's counts[e] consecutive rows of x [rows, K] (bf16, contiguous) through packed weight e
        (`weights`: the packed weights', column sums' and scales' pointers; all [N, K], no bias) in one call →
        [rows, N] bf16, or [rows, N / 2] = silu(gate) * up where the weights are gated MLPs' [gate; up] rows
        interleaved in blocks of 32 (N a multiple of 64). The C side trusts its arguments: engine.quant.grouped
        checks them."""
        return self.run_grouped(self.grouped_entry(), x, counts, shape, weights, silu_mul, "i8mm", self.rows)

    @staticmethod
    def run_grouped(
        fn: ctypes._CFuncPtr, x: torch.Tensor, counts: ctypes.Array, shape: tuple[int, int],
        weights: tuple[ctypes.Array, ...], silu_mul: bool, name: str, dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:  # fmt: skip
        """Calls a grouped entry point over this layout (i8mm_grouped, i8amx_grouped, i8mm_grouped_f32: `grouped`'s
        arguments), rows of `dtype` out."""
        n, k = shape
        y = torch.empty(x.shape[0], n // 2 if silu_mul else n, dtype=dtype)
        rc = fn(len(counts), counts, n, k, x.data_ptr(), *weights, y.data_ptr(), torch.get_num_threads(), int(silu_mul))
        if rc != 0:
            raise MemoryError(f"{name}: no memory for the quantized rows")
        return y

    @staticmethod
    def run(fn: ctypes._CFuncPtr, x: torch.Tensor, w: PackedInt8, name: str) -> torch.Tensor:
        """Calls an entry point over this layout (i8mm's, i8amx's): fn(M, N, K, x, bf16, packed, colsum, scale, b,
        y, threads) → 0, or -1 without memory for the quantized rows."""
        dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
        x2 = x.reshape(-1, w.k).to(dtype).contiguous()
        y = torch.empty(x2.shape[0], w.n, dtype=dtype)
        rc = fn(
            x2.shape[0], w.n, w.k, x2.data_ptr(), int(dtype == torch.bfloat16), w.packed.data_ptr(),
            w.colsum.data_ptr(), w.scale.data_ptr(), w.bias.data_ptr() if w.bias is not None else None,
            y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError(f"{name}: no memory for the quantized rows")
        return y.view(*x.shape[:-1], w.n)


class I8MMFloat32Rows(I8MM):
    """The same compiled kernel whose grouped call takes and gives float32 rows (i8mm_grouped_f32: float32 math,
    on any AVX512-VNNI CPU, with AVX512-BF16 or not; silu(gate) * up in float32), over i8mm's packed copies."""

    rows = torch.float32

    def __init__(self, kernel: I8MM) -> None:  # shares the library, whose entries I8MM set up
        self.lib, self.has_silu_mul = kernel.lib, kernel.has_silu_mul
        self.has_grouped = True

    def grouped_entry(self) -> object:  # I8MM.grouped calls it: float32 rows x [rows, K] → [rows, N] (N / 2) float32
        return self.lib.i8mm_grouped_f32


def i8_entry(fn: ctypes._CFuncPtr, w: PackedInt8, silu: bool, dtype: torch.dtype = torch.bfloat16) -> CEntry:
    """How a decode program calls `fn` (i8mm's or i8amx's `linear`, or with `silu` their fused entry, bf16 or
    float32 as `dtype` says) over `w` with rows of `dtype` (the plain entry over bf16 takes float32 ones too: the
    entry's `retyped`): N columns out, or N / 2 of silu(gate) * up."""
    bias = w.bias.data_ptr() if w.bias is not None else None

    def emit(builder: ProgramBuilder, k: int, x: int, y: int) -> None:
        ptrs = (w.packed.data_ptr(), w.colsum.data_ptr(), w.scale.data_ptr())
        builder.i8mm(address(fn), w.n, w.k, x, *ptrs, bias, y, silu, dtype == torch.bfloat16)

    def retyped(other: torch.dtype) -> CEntry | None:
        return i8_entry(fn, w, silu, other) if not silu and other == torch.float32 else None

    keep = tuple(t for t in (w.packed, w.colsum, w.scale, w.bias) if t is not None)
    plain = not silu and dtype == torch.bfloat16
    return CEntry(w.n // 2 if silu else w.n, dtype, emit, keep, retyped if plain else None)


def self_check(kernel: I8MM) -> None:
    """Column and K tails, more rows than a tile and a pass, both input types, full-range products (VPDPBUSD
    never saturates: its sums are 32-bit)."""
    check_int8_kernel("i8mm", kernel.linear, ((1, 70, 33), (7, 130, 64), (200, 64, 9), (13, 16, 256)))
    if kernel.has_silu_mul:
        check_int8_silu_mul(kernel, ((1, 128, 33), (7, 256, 64), (200, 64, 96)))


def check_int8_silu_mul(kernel: I8MM | I8AMX, shapes: tuple[tuple[int, int, int], ...], name: str = "i8mm") -> None:
    """The fused silu(gate) * up entry against the unfused entry then the bf16 torch code, at (M, 2I, K) shapes
    with a bias: the same int32 sums, so they may differ only where silu's last bit rounds the other way."""
    g = torch.Generator().manual_seed(1)
    for m, n, k in shapes:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale, bias = torch.rand(n, generator=g) * 0.02 + 1e-3, torch.randn(n, generator=g)
        x = torch.randn(m, k, generator=g).bfloat16()
        gate, up = kernel.linear(x, I8MM.pack(q, scale, bias)).chunk(2, dim=-1)
        want = (F.silu(gate) * up).float()
        i = interleave_halves
        got = kernel.linear_silu_mul(x, I8MM.pack(i(q), i(scale), i(bias))).float()
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1 / 128, atol=1e-3 * want.abs().max().item()):
            raise SelfCheckError(f"{name} fused SiLU self-check failed at {m}x{n}x{k}")


def check_int8_kernel(
    name: str, linear: Callable[[torch.Tensor, PackedInt8], torch.Tensor], shapes: tuple[tuple[int, int, int], ...]
) -> None:  # fmt: skip
    """A kernel over i8mm's layout (linear(x, packed)) against the reference at (M, N, K) shapes, both input types,
    weights of 127 over half of K and one outlier in x; raises SelfCheckError at the first that differs."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in shapes:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        q[:, : k // 2] = 127
        scale = torch.rand(n, generator=g) * 0.02 + 1e-3
        bias = torch.randn(n, generator=g)
        packed = I8MM.pack(q, scale, bias)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=g).to(dtype)
            x[0, 0] = 50.0  # one outlier: the rest quantize to small steps
            want = Int8Weight(q, scale).reference(x, bias)
            got = linear(x, packed).float()
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            if not torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()):
                err = (got - want).abs().max().item()
                raise SelfCheckError(f"{name} self-check failed at {m}x{n}x{k} {dtype}: max error {err:.3g}")


def supported() -> bool:
    """AVX512-VNNI with AVX512-BW: the instructions the kernel is made of."""
    return {"avx512_vnni", "avx512bw"} <= cpu_flags()


_once = Once(I8MM.build, log, "W8A8 layers will use oneDNN's int8 GEMM or torch._int_mm", check=self_check)
# the same kernel without its software prefetch of the next block (bf16mm's setting, tuned on one CPU): timed beside it
_once_plain = Once(
    lambda: I8MM.build(("-march=native", "-DPF_TILES=1")),
    log,
    "W8A8 layers are not timed without software prefetch",
    check=self_check,
)


def kernel() -> I8MM | None:
    """The process-wide kernel; None without AVX512-VNNI, or (logged once) where it can't be built."""
    return _once() if supported() else None


def float32_rows(k: I8MM | None) -> I8MMFloat32Rows | None:
    """`k` (kernel() or kernel_without_prefetch()) with its grouped call over float32 rows; None without it."""
    return I8MMFloat32Rows(k) if k is not None else None


def kernel_without_prefetch() -> I8MM | None:
    """The kernel built with no software prefetch (PF_TILES=1), as kernel() otherwise."""
    return _once_plain() if supported() else None
