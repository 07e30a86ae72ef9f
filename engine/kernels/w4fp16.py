"""W4A16 linear layers with AVX512-FP16 products (engine/kernels/w4fp16.c), over w4mm's packed weight, for decode
batches on CPUs with AVX512-FP16 (Intel Xeons since Sapphire Rapids), where one row through w4mm is bound by
VDPBF16PS. Each row is scaled by a power of two and rounded to fp16, the products summed 32 inputs at a time in
fp16 and then in float. Two entry points: `fp16` (plain) and `fp16_silu_mul` (a gated MLP's fused SiLU, over
w4mm-silu-mul's interleaved copy). The engine checks them against the reference and times them with w4mm's and
w4amx's entry points per shape and batch class (engine.quant.paths).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.kernels.cbuild import build, cpu_flags
from engine.kernels.w4_builds import Builds
from engine.kernels.w4mm import W4MM, BF16Int4Kernel, PackedInt4, check_int4_kernel, check_int4_silu_mul

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("w4fp16.c")
SPAN = 32  # the group size is whole 32-input fp16 spans

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class W4FP16(BF16Int4Kernel):
    """The compiled kernel: bf16 linear layers over a weight W4MM.pack made."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for f in (lib.w4fp16_linear, lib.w4fp16_linear_silu_mul):
            f.argtypes = [_i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            f.restype = _int

    @classmethod
    def build(cls, extra: tuple[str, ...] = ()) -> W4FP16:
        return cls(build(SOURCE, ("-march=native", *extra)))

    @staticmethod
    def accepts(n: int, k: int, group_size: int) -> bool:
        return W4MM.accepts(n, k, group_size) and group_size % SPAN == 0

    def c_fn(self, entry: str) -> ctypes._CFuncPtr | None:
        """W4MM.c_fn for this kernel's entry methods (`fp16`, `fp16_silu_mul`)."""
        names = {"fp16": "w4fp16_linear", "fp16_silu_mul": "w4fp16_linear_silu_mul"}
        return getattr(self.lib, names[entry]) if entry in names else None

    def fp16(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] → x W^T + b, [..., N] bf16."""
        return self.run(self.lib.w4fp16_linear, x, w, bias)

    def fp16_silu_mul(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """`fp16` over a gated MLP's [gate; up] weight packed with its rows interleaved in blocks of 32
        (interleave_halves; N % 64 == 0) → silu(gate) * up, [..., N / 2]."""
        return self.run(self.lib.w4fp16_linear_silu_mul, x, w, bias, w.n // 2)


def self_check(kernel: W4FP16) -> None:
    """Row tails of a 3-row tile, column tails, several groups, rows of very large and very small values (each
    row's power-of-two scale)."""
    check_int4_kernel(
        "w4fp16", {"fp16": kernel.fp16}, ((1, 70, 64, 32), (7, 130, 256, 128), (5, 16, 128, 64)), compact=kernel.compact
    )
    check_int4_silu_mul(
        "w4fp16",
        {"fp16-silu-mul": kernel.fp16_silu_mul},
        ((1, 128, 64, 32), (4, 256, 256, 128)),
        compact=kernel.compact,
    )
    for magnitude in (3e4, 1e-4):  # bf16's range, not fp16's: the scale keeps both exact enough
        check_int4_kernel("w4fp16", {"fp16": kernel.fp16}, ((2, 64, 128, 32),), magnitude, compact=kernel.compact)


def supported() -> bool:
    """AVX512-FP16 in the CPU's flags: the only reason to try building the kernel (whether it is used is
    measured)."""
    return "avx512_fp16" in cpu_flags()


_builds = Builds(W4FP16.build, "W4A16 layers will not use fp16 products (w4mm still runs them)", self_check, supported)
kernel, kernel_without_prefetch = _builds.kernel, _builds.kernel_without_prefetch
