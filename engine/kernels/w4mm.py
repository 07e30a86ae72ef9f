"""W4A16 linear layers for CPUs with AVX512-BF16 (engine/kernels/w4mm.c): unsigned 4-bit weights with a float
scale and zero point per output channel and group of inputs, bf16 activations.

Entry points over one packed weight: `direct` widens the nibbles in registers, a few rows at a time (a quarter
of bf16's bytes streamed: decode's small batches), `wide` the same in tiles of 6-8 rows (decode's larger batches);
`panel` widens one group of a 64-column block at a time into an L1 buffer and runs bf16mm's tiles over it for every
row (larger batches, prefill); `block` dequantizes a whole 64-column block to bf16 once and runs bf16mm's tiles
over all of K (prefill and the larger decode batches: the widening is paid once per weight, not per row tile or
group). The engine times them, with torch's int4 GEMM, per shape and batch class (engine.quant.paths).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels import bf16mm
from engine.kernels.cbuild import SelfCheckError, build
from engine.kernels.gemm import CEntry, interleave_halves
from engine.kernels.program import ProgramBuilder, address
from engine.kernels.w4_builds import Builds, PackedLayoutKernel, compact_scales
from engine.kernels.w4f32 import PackedInt4F32
from engine.quant.weights import Int4Weight, pack_nibbles

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("w4mm.c")
BLOCK = 64  # output columns per packed block (NB in w4mm.c)
DENSE_STEP = 32  # inputs w4mm_dequantize takes at a time: groups must be whole steps
DENSE_MAX = 1 << 24  # weights dense() dequantizes at a time (32 MB of bf16): a bigger layer goes in row chunks
_scratch = threading.local()  # dense(): .rows, the bf16 rows of the layer being run

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@dataclass(slots=True)
class PackedInt4:
    """A weight in the kernel's layout: nibbles [N/64, K/4, 4, 32] uint8, scales [N/64, K/G, 2, 64] float32 (s,
    then s * (128 + z)), or `compact`: [N/64, K/G, 192] bytes (64 bf16 s, then 64 bytes 128 + z), which only the
    kernels built with -DSCALE16 read (w4mm_common.h)."""

    nibbles: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    group_size: int
    compact: bool = False


class BF16Int4Kernel(PackedLayoutKernel):
    """A kernel over w4mm's packed layout with bf16 rows (w4mm's, w4vnni's, w4amx's, w4fp16's)."""

    def run(
        self, fn: ctypes._CFuncPtr, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None,
        out_cols: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Calls one of this build's entry points: fn(M, N, K, G, x, nibbles, scales, b, y, threads) → 0, or -1
        without memory for its buffers. `out_cols`: y's width (default N)."""
        self.check_layout(w)
        x2 = x.reshape(-1, w.k).to(torch.bfloat16).contiguous()
        out_cols = w.n if out_cols is None else out_cols
        y = torch.empty(x2.shape[0], out_cols, dtype=torch.bfloat16)
        b = bias.to(torch.bfloat16).contiguous() if bias is not None else None  # held until the call returns
        rc = fn(
            x2.shape[0], w.n, w.k, w.group_size, x2.data_ptr(), w.nibbles.data_ptr(), w.scales.data_ptr(),
            b.data_ptr() if b is not None else None, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError(f"{type(self).__name__.lower()}: no memory for the kernel's buffers")
        return y.view(*x.shape[:-1], out_cols)


class W4MM(BF16Int4Kernel):
    """The compiled kernel: pack an int4 weight once, then run bf16 linear layers over it."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        entries = (lib.w4mm_linear, lib.w4mm_linear_panel, lib.w4mm_linear_block, lib.w4mm_linear_silu_mul)
        wide = (lib.w4mm_linear_wide, lib.w4mm_linear_wide_silu_mul)
        for f in (*entries, *wide, lib.w4mm_linear_block_silu_mul):
            f.argtypes = [_i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            f.restype = _int
        lib.w4mm_dequantize.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int]
        lib.w4mm_dequantize.restype = None
        for f in (lib.w4mm_grouped, lib.w4mm_grouped_wide):
            f.argtypes = [_i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int, _int]
            f.restype = _int

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> W4MM:
        return cls(build(SOURCE, flags))

    def c_fn(self, entry: str) -> ctypes._CFuncPtr | None:
        """The C function behind an entry method (`direct`, `wide`, `panel`, `block`, `silu_mul`, `wide_silu_mul`,
        `block_silu_mul`), for a decode program (w4_entry); None for the others."""
        names = {"direct": "w4mm_linear", "wide": "w4mm_linear_wide", "panel": "w4mm_linear_panel",
                 "block": "w4mm_linear_block", "silu_mul": "w4mm_linear_silu_mul",
                 "wide_silu_mul": "w4mm_linear_wide_silu_mul",
                 "block_silu_mul": "w4mm_linear_block_silu_mul"}  # fmt: skip
        return getattr(self.lib, names[entry]) if entry in names else None

    @staticmethod
    def accepts(n: int, k: int, group_size: int) -> bool:
        return k % group_size == 0 and group_size % 4 == 0

    @staticmethod
    def pack(
        values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, compact: bool = False
    ) -> PackedInt4:
        """values: unsigned 4-bit [N, K] (any int dtype); scale, zero: [N, K/G] → the kernel's layout, columns
        padded to whole blocks with zero weights; `compact`: the scales as bf16 and 128 + z as bytes (the scales
        must be bf16 values: compact_scales) for the builds with -DSCALE16."""
        n, k = values.shape
        assert W4MM.accepts(n, k, group_size)
        blocks = -(-n // BLOCK)
        pad = blocks * BLOCK - n
        v = torch.nn.functional.pad(values.to(torch.uint8), (0, 0, 0, pad))
        # [block, 16-column group c, column j, kq, half, kk]: half 0 -> low nibble, half 1 -> high nibble
        v = v.view(blocks, 4, 16, k // 4, 2, 2)
        byte = v[..., 0, :] | (v[..., 1, :] << 4)  # [block, c, j, kq, kk]
        nibbles = byte.permute(0, 3, 1, 2, 4).contiguous()  # [block, kq, c, j, kk]: byte i = j * 2 + kk
        s = torch.nn.functional.pad(scale.float(), (0, 0, 0, pad))
        if compact:
            assert compact_scales(scale)
            z = torch.nn.functional.pad(zero.to(torch.uint8) + 128, (0, 0, 0, pad), value=128)
            s16 = s.to(torch.bfloat16).view(torch.uint8).view(blocks, BLOCK, -1, 2).permute(0, 2, 1, 3)
            zb = z.view(blocks, BLOCK, -1).permute(0, 2, 1)  # [block, group, column]
            groups = torch.cat((s16.reshape(blocks, -1, 2 * BLOCK), zb), dim=2)  # [block, group, 192 bytes]
            return PackedInt4(nibbles.view(-1), groups.contiguous().view(-1), n, k, group_size, True)
        sz = s * (torch.nn.functional.pad(zero.float(), (0, 0, 0, pad)) + 128)  # the kernel sums x * (128 + q)
        scales = torch.stack((s, sz), dim=0).view(2, blocks, BLOCK, -1).permute(1, 3, 0, 2).contiguous()
        return PackedInt4(nibbles.view(-1), scales.view(-1), n, k, group_size)

    def direct(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] → x W^T + b, [..., N] bf16, the nibbles widened in registers."""
        return self.run(self.lib.w4mm_linear, x, w, bias)

    def wide(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """`direct`'s sums (the same bits) in tiles of 6-8 rows x 32 columns, the group totals in memory (fewer
        rows through direct's tiles): for batches of 6 rows and more."""
        return self.run(self.lib.w4mm_linear_wide, x, w, bias)

    def panel(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """The same, each group widened once into a buffer for all the rows and run through bf16mm's tiles."""
        return self.run(self.lib.w4mm_linear_panel, x, w, bias)

    def block(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """The same, each 64-column block dequantized to bf16 once (w rounded to bf16) for all the rows and all of
        K, through bf16mm's tiles."""
        return self.run(self.lib.w4mm_linear_block, x, w, bias)

    def silu_mul(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """`direct` over a gated MLP's [gate; up] weight packed with its rows interleaved in blocks of 32
        (interleave_halves; N % 64 == 0) → silu(gate) * up, [..., N / 2], rounded as the unfused bf16 code."""
        return self.run(self.lib.w4mm_linear_silu_mul, x, w, bias, w.n // 2)

    def wide_silu_mul(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """`wide` over such a weight, the same fused output."""
        return self.run(self.lib.w4mm_linear_wide_silu_mul, x, w, bias, w.n // 2)

    def block_silu_mul(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """`block` over such a weight, the same fused output."""
        return self.run(self.lib.w4mm_linear_block_silu_mul, x, w, bias, w.n // 2)

    def grouped_entry(self) -> ctypes._CFuncPtr:
        """`grouped`'s C entry point, which a decode program calls itself (engine.kernels.program)."""
        return self.lib.w4mm_grouped

    def grouped(
        self, x: torch.Tensor, counts: ctypes.Array, shape: tuple[int, int, int], nibbles: ctypes.Array,
        scales: ctypes.Array, silu_mul: bool,
    ) -> torch.Tensor:  # fmt: skip
        """Layer e's counts[e] consecutive rows of x [rows, K] (bf16, contiguous) through packed weight e (its
        nibbles and scales pointers; all of shape (N, K, G), no bias) in one call → [rows, N] bf16, or
        [rows, N / 2] = silu(gate) * up where the weights are gated MLPs' [gate; up] rows interleaved in blocks of
        32 (N a multiple of 64). The C side trusts its arguments: engine.quant.grouped checks them."""
        return run_grouped(self.grouped_entry(), x, counts, shape, nibbles, scales, silu_mul, "w4mm")

    def dense(self, x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
        """The same from the weight as stored: dequantized to bf16 rows, DENSE_ROWS_MAX weights at a time, in a
        scratch buffer the calling thread's layers share (per thread, as engines of several models may step in
        threads of their own), each chunk through oneDNN's GEMM (F.linear). For prefill sizes."""
        n, k = w.shape
        assert w.group_size % DENSE_STEP == 0
        nib, scale = w.packed.contiguous(), w.scale.float().contiguous()
        zero = w.zero.to(torch.uint8).contiguous()
        rows = max(1, min(n, DENSE_MAX // k))
        scratch = getattr(_scratch, "rows", None)
        if scratch is None or scratch.numel() < rows * k:
            scratch = _scratch.rows = torch.empty(rows * k, dtype=torch.bfloat16)
        x2 = x.to(torch.bfloat16)
        b = bias.to(torch.bfloat16) if bias is not None else None
        out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16) if rows < n else None
        for n0 in range(0, n, rows):
            r = min(rows, n - n0)
            dense = scratch[: r * k].view(r, k)
            self.lib.w4mm_dequantize(r, k, w.group_size, nib[n0].data_ptr(), scale[n0].data_ptr(),
                                     zero[n0].data_ptr(), dense.data_ptr(), torch.get_num_threads())  # fmt: skip
            y = F.linear(x2, dense, b[n0 : n0 + r] if b is not None else None)
            if out is None:
                return y
            out[..., n0 : n0 + r] = y
        assert out is not None
        return out


def run_grouped(
    fn: ctypes._CFuncPtr, x: torch.Tensor, counts: ctypes.Array, shape: tuple[int, int, int], nibbles: ctypes.Array,
    scales: ctypes.Array, silu_mul: bool, name: str,
) -> torch.Tensor:  # fmt: skip
    """Calls a grouped entry point over this layout (w4mm_grouped, w4amx_grouped: W4MM.grouped's arguments)."""
    n, k, g = shape
    y = torch.empty(x.shape[0], n // 2 if silu_mul else n, dtype=torch.bfloat16)
    rc = fn(
        len(counts), counts, n, k, g, x.data_ptr(), nibbles, scales, y.data_ptr(), torch.get_num_threads(),
        int(silu_mul),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError(f"{name}: no memory for the kernel's buffers")
    return y


def w4_entry(
    fn: ctypes._CFuncPtr, w: PackedInt4 | PackedInt4F32, bias: torch.Tensor | None, cols: int,
    dtype: torch.dtype = torch.bfloat16,
) -> CEntry:  # fmt: skip
    """How a decode program calls `fn` (an entry point over this layout, w4mm's or w4amx's, `cols` columns out:
    N, or N / 2 for a fused one; or w4f32's over its own, `dtype` float32) over `w` with rows of `dtype`; `bias`
    in `dtype` (interleaved like the rows for a fused one)."""
    b = bias.to(dtype).contiguous() if bias is not None else None
    bp = b.data_ptr() if b is not None else None

    def emit(builder: ProgramBuilder, k: int, x: int, y: int) -> None:
        builder.w4mm(address(fn), w.n, w.k, w.group_size, x, w.nibbles.data_ptr(), w.scales.data_ptr(), bp, y)

    keep = (w.nibbles, w.scales) if b is None else (w.nibbles, w.scales, b)
    return CEntry(cols, dtype, emit, keep)


class W4MMWide(W4MM):
    """w4mm whose grouped call runs the wide tiles (w4mm_grouped_wide, the same bits): the same library and packed
    copy, a kernel of its own for the grouped choices, which time each kernel's grouped call
    (engine.kernels.op_choice)."""

    def grouped_entry(self) -> ctypes._CFuncPtr:
        return self.lib.w4mm_grouped_wide


def _random_case(
    g: torch.Generator, m: int, n: int, k: int, gs: int, compact: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A self-check's int4 weight (values, scales, asymmetric zero points), bf16 rows x [m, k] and bf16 bias;
    `compact`: scales of bf16 values (the compact layout's)."""
    values = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, k // gs, generator=g) * 0.1 + 0.01
    scale = scale.bfloat16().float() if compact else scale
    zero = torch.randint(0, 16, (n, k // gs), generator=g)
    return values, scale, zero, torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()


def check_int4_kernel(
    name: str, entries: dict[str, Callable[..., torch.Tensor]], shapes: tuple[tuple[int, int, int, int], ...],
    magnitude: float = 1.0, compact: bool = False,
) -> None:  # fmt: skip
    """Each entry point over w4mm's layout (entry(x, packed, bias)) against the reference at (M, N, K, G) shapes,
    asymmetric zero points and a bias, rows of x about `magnitude` in size, the scales packed `compact` or not;
    raises SelfCheckError naming the first that differs."""
    g = torch.Generator().manual_seed(0)
    for m, n, k, gs in shapes:
        values, scale, zero, x, bias = _random_case(g, m, n, k, gs, compact)
        x = (x.float() * magnitude).bfloat16()
        want = Int4Weight(pack_nibbles(values), scale, zero, gs).reference(x, bias.float())
        packed = W4MM.pack(values, scale, zero, gs, compact)
        for entry, fn in entries.items():
            got = fn(x, packed, bias).float()
            if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
                err = (got - want).abs().max().item()
                raise SelfCheckError(f"{name} {entry} self-check failed at {m}x{n}x{k} g{gs}: max error {err:.3g}")


def check_int4_silu_mul(
    name: str, entries: dict[str, Callable[..., torch.Tensor]], shapes: tuple[tuple[int, int, int, int], ...],
    compact: bool = False,
) -> None:  # fmt: skip
    """Fused silu(gate) * up entry points (entry(x, packed, bias), the weight's [gate; up] rows interleaved in
    blocks of 32 before packing) against the unfused bf16 code over the reference projection, at (M, 2I, K, G)."""
    g = torch.Generator().manual_seed(1)
    for m, n, k, gs in shapes:
        values, scale, zero, x, bias = _random_case(g, m, n, k, gs, compact)
        gate, up = Int4Weight(pack_nibbles(values), scale, zero, gs).reference(x, bias.float()).bfloat16().chunk(2, -1)
        want = (F.silu(gate) * up).float()
        i = interleave_halves
        packed = W4MM.pack(i(values), i(scale), i(zero), gs, compact)
        for entry, fn in entries.items():
            got = fn(x, packed, i(bias)).float()
            if got.shape != want.shape or not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
                raise SelfCheckError(f"{name} {entry} fused SiLU self-check failed at {m}x{n}x{k} g{gs}")


def self_check(kernel: W4MM) -> None:
    """Column tails, several groups, more rows than a tile, asymmetric zero points, through every entry point."""
    entries = {"direct": kernel.direct, "wide": kernel.wide, "panel": kernel.panel, "block": kernel.block}
    shapes = ((1, 70, 64, 32), (7, 130, 256, 128), (200, 64, 96, 32), (4, 16, 128, 64))
    check_int4_kernel("w4mm", entries, shapes, compact=kernel.compact)
    fused = {
        "silu-mul": kernel.silu_mul,
        "wide-silu-mul": kernel.wide_silu_mul,
        "block-silu-mul": kernel.block_silu_mul,
    }
    shapes = ((1, 128, 64, 32), (7, 256, 256, 128), (200, 64, 96, 32))
    check_int4_silu_mul("w4mm", fused, shapes, compact=kernel.compact)


_builds = Builds(
    lambda extra: W4MM.build(("-march=native", *extra)),
    "W4A16 layers will use torch's int4 GEMM (slower)",
    self_check,
    bf16mm.supported,  # AVX512-BF16
)
kernel, kernel_without_prefetch = _builds.kernel, _builds.kernel_without_prefetch


@functools.cache
def wide_kernel(compact: bool = False) -> W4MMWide | None:
    """kernel(compact)'s library as W4MMWide (its grouped call through the wide tiles), as kernel() otherwise; one
    for the process, as kernel() is."""
    k = kernel(compact)
    if k is None:
        return None
    wide = W4MMWide(k.lib)
    wide.compact = compact
    if not compact:
        wide.twin = lambda: wide_kernel(True)
    return wide
