"""W4A16 linear layers by int8 dot products (engine/kernels/w4vnni.c: AVX512-VNNI's VPDPBUSD), over w4mm's packed
weight, for decode batches on CPUs with AVX512-VNNI and AVX512-BF16 (Zen 4 and later, Xeons since Cooper Lake),
where one row through w4mm is bound by widening the nibbles to bf16. Each row's group is scaled by a power of
two and rounded to a 14-bit integer, split into two signed bytes, and every column's products with the nibbles
are summed exactly in int32, then scaled in float. Entry points: `vnni` (plain), `vnni_silu_mul` (a gated MLP's
fused SiLU, over w4mm-silu-mul's interleaved copy) and `grouped` (a MoE layer's experts in one call). The engine
checks them against the reference and times them with w4mm's and w4amx's per shape and batch class
(engine.quant.paths, engine.kernels.op_choice).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.kernels.cbuild import build, cpu_flags
from engine.kernels.w4_builds import Builds
from engine.kernels.w4mm import (
    W4MM,
    BF16Int4Kernel,
    PackedInt4,
    check_int4_kernel,
    check_int4_silu_mul,
    run_grouped,
)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("w4vnni.c")
SPAN, MAX_GROUP = 16, 8192  # groups of whole 16-input vectors; past 8,192 inputs a group's int32 sums may overflow

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class W4VNNI(BF16Int4Kernel):
    """The compiled kernel: bf16 linear layers over a weight W4MM.pack made."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for f in (lib.w4vnni_linear, lib.w4vnni_linear_silu_mul):
            f.argtypes = [_i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            f.restype = _int
        lib.w4vnni_grouped.argtypes = [_i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int, _int]
        lib.w4vnni_grouped.restype = _int

    @classmethod
    def build(cls, extra: tuple[str, ...] = ()) -> W4VNNI:
        return cls(build(SOURCE, ("-march=native", *extra)))

    @staticmethod
    def accepts(n: int, k: int, group_size: int) -> bool:
        return W4MM.accepts(n, k, group_size) and group_size % SPAN == 0 and group_size <= MAX_GROUP

    def c_fn(self, entry: str) -> ctypes._CFuncPtr | None:
        """W4MM.c_fn for this kernel's entry methods (`vnni`, `vnni_silu_mul`)."""
        names = {"vnni": "w4vnni_linear", "vnni_silu_mul": "w4vnni_linear_silu_mul"}
        return getattr(self.lib, names[entry]) if entry in names else None

    def vnni(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] → x W^T + b, [..., N] bf16."""
        return self.run(self.lib.w4vnni_linear, x, w, bias)

    def vnni_silu_mul(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """`vnni` over a gated MLP's [gate; up] weight packed with its rows interleaved in blocks of 32
        (interleave_halves; N % 64 == 0) → silu(gate) * up, [..., N / 2]."""
        return self.run(self.lib.w4vnni_linear_silu_mul, x, w, bias, w.n // 2)

    def grouped_entry(self) -> object:
        """`grouped`'s C entry point, which a decode program calls itself (engine.kernels.program)."""
        return self.lib.w4vnni_grouped

    def grouped(
        self, x: torch.Tensor, counts: ctypes.Array, shape: tuple[int, int, int], nibbles: ctypes.Array,
        scales: ctypes.Array, silu_mul: bool,
    ) -> torch.Tensor:  # fmt: skip
        """W4MM.grouped's call (its arguments) through this kernel's products."""
        return run_grouped(self.lib.w4vnni_grouped, x, counts, shape, nibbles, scales, silu_mul, "w4vnni")


def self_check(kernel: W4VNNI) -> None:
    """Row tails of a 4-row tile, column tails, several groups, rows of very large and very small values (each
    group's power-of-two scale)."""
    check_int4_kernel(
        "w4vnni", {"vnni": kernel.vnni}, ((1, 70, 64, 32), (7, 130, 256, 128), (5, 16, 128, 64)), compact=kernel.compact
    )
    check_int4_silu_mul(
        "w4vnni",
        {"vnni-silu-mul": kernel.vnni_silu_mul},
        ((1, 128, 64, 32), (4, 256, 256, 128)),
        compact=kernel.compact,
    )
    for magnitude in (3e4, 1e-30, 1e30):  # each group's power-of-two scale keeps bf16's whole range
        check_int4_kernel("w4vnni", {"vnni": kernel.vnni}, ((2, 64, 128, 32),), magnitude, compact=kernel.compact)


def supported() -> bool:
    """AVX512-VNNI and AVX512-BF16 in the CPU's flags: the only reason to try building the kernel (whether it is
    used is measured)."""
    return {"avx512_vnni", "avx512_bf16"} <= cpu_flags()


_builds = Builds(
    W4VNNI.build, "W4A16 layers will not use int8 dot products (w4mm still runs them)", self_check, supported
)
kernel, kernel_without_prefetch = _builds.kernel, _builds.kernel_without_prefetch
