"""W4A16 linear layers for CPUs that compute in float32 (engine/kernels/w4f32.c): unsigned 4-bit weights with a
float scale and zero point per output channel and group of inputs, float32 activations.

Where the engine computes in float32 (no AVX512-BF16 or AMX: AVX2, AVX-512 without bf16, other ISAs through the
portable C), torch's int4 GEMM was the only fast-path candidate, and on a Zen 3 it ran scalar code (5 ms for one
row of a 4864 x 896 layer). Two entry points over one packed weight: `direct` widens the nibbles in registers,
one or two rows at a time (decode's small batches); `panel` widens one group of a 32-column block at a time into
a buffer and runs FMA tiles over every row (batches, prefill). Each 32-bit word of the packed weight holds one
column's 8 consecutive nibbles (Int4Weight's 4 bytes for them, as they lie), so K and the group size are multiples
of 8. The engine times both, with torch's int4 GEMM and
the reference, per shape and batch class (engine.quant.paths).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernels.cbuild import SelfCheckError, build, cpu_flags
from engine.kernels.w4_builds import Builds, PackedLayoutKernel, compact_scales
from engine.quant.weights import Int4Weight, pack_nibbles

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("w4f32.c")
BLOCK = 32  # output columns per packed block (NB in w4f32.c)
# entry method → its C function (the fused gated-MLP entries take the same arguments, N / 2 columns out)
ENTRIES = {
    "direct": "w4f32_linear",
    "panel": "w4f32_linear_panel",
    "silu-mul": "w4f32_linear_silu_mul",
    "panel-silu-mul": "w4f32_linear_panel_silu_mul",
}

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@dataclass(slots=True)
class PackedInt4F32:
    """A weight in the kernel's layout: words [N/32, K/8, 32] int32 (column j's k = 8o + i at bits 4i of word
    (o, j)), scales [N/32, K/G, 2, 32] float32 (s, then s * z), or `compact`: [N/32, K/G, 96] bytes (32 bf16 s,
    then 32 bytes z), which only the build with -DSCALE16 reads (engine.kernels.w4_builds)."""

    nibbles: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    group_size: int
    compact: bool = False


class W4F32(PackedLayoutKernel):
    """The compiled kernel: pack an int4 weight once, then run float32 linear layers over it."""

    dtype = torch.float32  # the rows it takes and gives (its grouped call's, engine.quant.grouped)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for f in (lib.w4f32_linear, lib.w4f32_linear_panel, lib.w4f32_linear_silu_mul, lib.w4f32_linear_panel_silu_mul):
            f.argtypes = [_i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            f.restype = _int
        lib.w4f32_grouped.argtypes = [_i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int, _int]
        lib.w4f32_grouped.restype = _int

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> W4F32:
        # no multiply-add contracted by the compiler: its choice differed between inlined copies of one helper, and
        # the grouped call must give the bits of the linear entries (the vector FMAs are written out)
        return cls(build(SOURCE, (*flags, "-ffp-contract=off")))

    def c_fn(self, entry: str) -> ctypes._CFuncPtr | None:
        """The C function behind an entry method (`direct`, `panel`, and their fused gated-MLP forms `silu-mul`,
        `panel-silu-mul`), for a decode program (w4mm.w4_entry with float32 rows: w4f32_linear takes w4mm_linear's
        arguments); None for others."""
        return getattr(self.lib, ENTRIES[entry]) if entry in ENTRIES else None

    @staticmethod
    def accepts(n: int, k: int, group_size: int) -> bool:
        return k % group_size == 0 and group_size % 8 == 0

    @staticmethod
    def pack(
        packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, compact: bool = False
    ) -> PackedInt4F32:
        """Int4Weight's nibbles [N, K/2] (even k low) and its scale, zero [N, K/G] → the kernel's layout, columns
        padded to whole blocks with zero weights (the words read little-endian, as x86 and aarch64 do); `compact`:
        the scales as bf16 and z as bytes (the scales must be bf16 values: compact_scales), for the build with
        -DSCALE16."""
        n, k = packed.shape[0], packed.shape[1] * 2
        assert W4F32.accepts(n, k, group_size)
        blocks = -(-n // BLOCK)
        pad = blocks * BLOCK - n
        # Int4Weight's byte (n, p) already holds k = 2p low and 2p + 1 high, so its bytes 4o .. 4o + 3 read as
        # one word are k = 8o .. 8o + 7 at bits 0, 4, .. 28: only the order of the words changes
        p = torch.nn.functional.pad(packed.to(torch.uint8), (0, 0, 0, pad)).contiguous().view(torch.int32)
        nibbles = p.view(blocks, BLOCK, k // 8).transpose(1, 2).contiguous()  # [block, octet, column]
        s = torch.nn.functional.pad(scale.float(), (0, 0, 0, pad))
        if compact:
            assert compact_scales(scale)
            s16 = s.to(torch.bfloat16).view(torch.uint8).view(blocks, BLOCK, -1, 2).permute(0, 2, 1, 3)
            z = torch.nn.functional.pad(zero.to(torch.uint8), (0, 0, 0, pad)).view(blocks, BLOCK, -1).permute(0, 2, 1)
            groups = torch.cat((s16.reshape(blocks, -1, 2 * BLOCK), z), dim=2)  # [block, group, 96 bytes]
            return PackedInt4F32(nibbles.view(-1), groups.contiguous().view(-1), n, k, group_size, True)
        sz = s * torch.nn.functional.pad(zero.float(), (0, 0, 0, pad))
        scales = torch.stack((s, sz), dim=0).view(2, blocks, BLOCK, -1).permute(1, 3, 0, 2).contiguous()
        return PackedInt4F32(nibbles.view(-1), scales.view(-1), n, k, group_size)

    def direct(self, x: torch.Tensor, w: PackedInt4F32, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] → x W^T + b, [..., N] float32, the nibbles widened in registers."""
        return self._run(self.lib.w4f32_linear, x, w, bias)

    def panel(self, x: torch.Tensor, w: PackedInt4F32, bias: torch.Tensor | None) -> torch.Tensor:
        """The same, each group widened once into a buffer for all the rows."""
        return self._run(self.lib.w4f32_linear_panel, x, w, bias)

    def silu_mul(self, x: torch.Tensor, w: PackedInt4F32, bias: torch.Tensor | None) -> torch.Tensor:
        """A gated MLP's [gate; up] projection whose rows (and bias) were interleaved in blocks of 32
        (engine.kernels.gemm.interleave_halves; N a multiple of 64) → silu(gate) * up, [..., N / 2] float32."""
        return self._run(self.lib.w4f32_linear_silu_mul, x, w, bias, w.n // 2)

    def panel_silu_mul(self, x: torch.Tensor, w: PackedInt4F32, bias: torch.Tensor | None) -> torch.Tensor:
        """silu_mul through the panel entry."""
        return self._run(self.lib.w4f32_linear_panel_silu_mul, x, w, bias, w.n // 2)

    def grouped_entry(self) -> ctypes._CFuncPtr:
        """`grouped`'s C entry point, which a decode program calls itself (w4mm_grouped's arguments, float32 rows)."""
        return self.lib.w4f32_grouped

    def grouped(
        self, x: torch.Tensor, counts: ctypes.Array, shape: tuple[int, int, int], nibbles: ctypes.Array,
        scales: ctypes.Array, silu_mul: bool,
    ) -> torch.Tensor:  # fmt: skip
        """W4MM.grouped's call over this layout with float32 rows: layer e's counts[e] consecutive rows of x
        [rows, K] through packed weight e → [rows, N], or [rows, N / 2] = silu(gate) * up for gated MLPs' interleaved
        [gate; up] weights. The C side trusts its arguments: engine.quant.grouped checks them."""
        n, k, g = shape
        x2 = x.float().contiguous()
        y = torch.empty(x2.shape[0], n // 2 if silu_mul else n, dtype=torch.float32)
        rc = self.lib.w4f32_grouped(
            len(counts), counts, n, k, g, x2.data_ptr(), nibbles, scales, y.data_ptr(), torch.get_num_threads(),
            int(silu_mul),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("w4f32: no memory for the kernel's buffers")
        return y

    def _run(
        self, fn: ctypes._CFuncPtr, x: torch.Tensor, w: PackedInt4F32, bias: torch.Tensor | None,
        cols: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        self.check_layout(w)
        cols = w.n if cols is None else cols
        x2 = x.reshape(-1, w.k).float().contiguous()
        y = torch.empty(x2.shape[0], cols, dtype=torch.float32)
        b = bias.float().contiguous() if bias is not None else None  # held until the call returns
        rc = fn(
            x2.shape[0], w.n, w.k, w.group_size, x2.data_ptr(), w.nibbles.data_ptr(), w.scales.data_ptr(),
            b.data_ptr() if b is not None else None, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("w4f32: no memory for the kernel's buffers")
        return y.view(*x.shape[:-1], cols)


def self_check(kernel: W4F32) -> None:
    """Column tails, several groups, more rows than a tile or a pass, asymmetric zero points, both entry points
    (over the compact scales' layout for its build: scales of bf16 values)."""
    g = torch.Generator().manual_seed(0)
    shapes = ((1, 70, 64, 32), (3, 130, 256, 128), (200, 64, 96, 32), (4, 16, 128, 64), (2, 33, 16, 16), (5, 40, 24, 8))
    for m, n, k, gs in shapes:
        values = torch.randint(0, 16, (n, k), generator=g)
        scale = torch.rand(n, k // gs, generator=g) * 0.1 + 0.01
        scale = scale.bfloat16().float() if kernel.compact else scale
        zero = torch.randint(0, 16, (n, k // gs), generator=g)
        x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        weight = Int4Weight(pack_nibbles(values), scale, zero, gs)
        want = weight.reference(x, bias)
        packed = W4F32.pack(weight.packed, scale, zero, gs, kernel.compact)
        for name, fn in (("direct", kernel.direct), ("panel", kernel.panel)):
            got = fn(x, packed, bias)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()):
                err = (got - want).abs().max().item()
                raise SelfCheckError(f"w4f32 {name} self-check failed at {m}x{n}x{k} g{gs}: max error {err:.3g}")
    check_silu_mul(kernel)


def check_silu_mul(kernel: W4F32) -> None:
    """The fused gated-MLP entries against the plain direct entry over the same interleaved weight, then SiLU x up
    in float32 torch: the same sums, so they may differ only by the two libraries' exp."""
    g = torch.Generator().manual_seed(1)
    for m, n, k, gs in ((1, 128, 64, 32), (3, 64, 256, 128), (200, 192, 96, 32)):
        weight = Int4Weight(pack_nibbles(torch.randint(0, 16, (n, k), generator=g)),
                            (torch.rand(n, k // gs, generator=g) * 0.1 + 0.01).bfloat16().float(),
                            torch.randint(0, 16, (n, k // gs), generator=g), gs)  # fmt: skip
        x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        packed = W4F32.pack(weight.packed, weight.scale, weight.zero, gs, kernel.compact)
        y = kernel.direct(x, packed, bias).view(m, n // 64, 2, 32)
        gate, up = y[:, :, 0].reshape(m, -1), y[:, :, 1].reshape(m, -1)
        want = gate / (1 + torch.exp(-gate)) * up
        for name, fn in (("silu-mul", kernel.silu_mul), ("panel-silu-mul", kernel.panel_silu_mul)):
            got = fn(x, packed, bias)
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()):
                err = (got - want).abs().max().item()
                raise SelfCheckError(f"w4f32 {name} self-check failed at {m}x{n}x{k} g{gs}: max error {err:.3g}")


_builds = Builds(
    lambda extra: W4F32.build(("-march=native", *extra)),
    "float32 W4A16 layers will use torch's int4 GEMM (slower)",
    self_check,
    prefetch_variants=False,  # built with its prefetch only
)
kernel = _builds.kernel

# On an AVX-512 CPU the default build runs 16-wide tiles; its 8-wide AVX2 tiles (-DW4F32_YMM) are built too and
# timed beside it (a CPU may run 512-bit FMAs at a lower clock or as two halves). Elsewhere the two are one build.
_ymm_builds = Builds(
    lambda extra: W4F32.build(("-march=native", "-DW4F32_YMM", *extra)),
    "float32 W4A16 layers are not timed with the 8-wide tiles on this AVX-512 CPU",
    self_check,
    lambda: "avx512f" in cpu_flags(),
    prefetch_variants=False,
)
ymm_kernel = _ymm_builds.kernel
