"""W4A16 linear layers on Intel AMX tiles (engine/kernels/w4amx.c), over w4mm's packed weight, for batches and
prefill on AMX CPUs, where w4mm's VDPBF16PS loops trail the tiles the bf16 model runs on. Two entry points:
`amx` widens one group of a 64-column block at a time exactly and scales the tiles' sums per group (fewer
instructions per weight: small batches); `amx_dequant` dequantizes a whole block to bf16 and sums over all of K
in the tiles (nothing per row and group: prefill, small groups). The engine times both with w4mm's entry points
and torch's int4 GEMM per shape and batch class (engine.quant.paths).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.kernels import amxmm
from engine.kernels.cbuild import BuildError, build
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

SOURCE = Path(__file__).with_name("w4amx.c")
KB = 32  # K and the group size are whole 32-input tile steps

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class W4AMX(BF16Int4Kernel):
    """The compiled kernel: bf16 linear layers over a weight W4MM.pack made."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        entries = (lib.w4amx_linear, lib.w4amx_linear_dequant, lib.w4amx_linear_silu_mul)
        for f in (*entries, lib.w4amx_linear_dequant_silu_mul):
            f.argtypes = [_i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            f.restype = _int
        lib.w4amx_grouped.argtypes = [_i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int, _int]
        lib.w4amx_grouped.restype = _int
        lib.w4amx_init.restype = _int
        if lib.w4amx_init() != 0:
            raise BuildError("the kernel cannot use AMX: Linux refused the tile state (arch_prctl)")

    @classmethod
    def build(cls, extra: tuple[str, ...] = ()) -> W4AMX:
        return cls(build(SOURCE, ("-march=native", "-mamx-tile", "-mamx-bf16", *extra)))

    @staticmethod
    def accepts(n: int, k: int, group_size: int) -> bool:
        return W4MM.accepts(n, k, group_size) and group_size % KB == 0

    def c_fn(self, entry: str) -> ctypes._CFuncPtr | None:
        """W4MM.c_fn for w4amx's entry methods (`amx`, `amx_dequant`, `amx_silu_mul`, `amx_dequant_silu_mul`)."""
        names = {"amx": "w4amx_linear", "amx_dequant": "w4amx_linear_dequant", "amx_silu_mul": "w4amx_linear_silu_mul",
                 "amx_dequant_silu_mul": "w4amx_linear_dequant_silu_mul"}  # fmt: skip
        return getattr(self.lib, names[entry]) if entry in names else None

    def amx(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] → x W^T + b, [..., N] bf16; a group at a time widened exactly, its tile sums scaled."""
        return self.run(self.lib.w4amx_linear, x, w, bias)

    def amx_dequant(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """The same, each 64-column block dequantized to bf16 whole and summed over all of K in the tiles."""
        return self.run(self.lib.w4amx_linear_dequant, x, w, bias)

    def amx_silu_mul(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """`amx` over a gated MLP's [gate; up] weight packed with its rows interleaved in blocks of 32
        (interleave_halves; N % 64 == 0) → silu(gate) * up, [..., N / 2], w4mm's fused epilogue."""
        return self.run(self.lib.w4amx_linear_silu_mul, x, w, bias, w.n // 2)

    def amx_dequant_silu_mul(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
        """`amx-dequant` over such a weight, the same fused output."""
        return self.run(self.lib.w4amx_linear_dequant_silu_mul, x, w, bias, w.n // 2)

    def grouped_entry(self) -> object:
        """`grouped`'s C entry point, which a decode program calls itself (engine.kernels.program)."""
        return self.lib.w4amx_grouped

    def grouped(
        self, x: torch.Tensor, counts: ctypes.Array, shape: tuple[int, int, int], nibbles: ctypes.Array,
        scales: ctypes.Array, silu_mul: bool,
    ) -> torch.Tensor:  # fmt: skip
        """W4MM.grouped on AMX tiles (`amx`'s way, a group at a time): a MoE layer's experts in one call."""
        return run_grouped(self.lib.w4amx_grouped, x, counts, shape, nibbles, scales, silu_mul, "w4amx")


def self_check(kernel: W4AMX) -> None:
    """Row tails under 16, 16-32 and past a 32-row step and a pass of rows, column tails, several groups."""
    entries = {"amx": kernel.amx, "amx-dequant": kernel.amx_dequant}
    check_int4_kernel(
        "w4amx",
        entries,
        ((1, 70, 64, 32), (17, 130, 256, 128), (200, 64, 96, 32), (40, 16, 128, 64)),
        compact=kernel.compact,
    )
    fused = {"amx-silu-mul": kernel.amx_silu_mul, "amx-dequant-silu-mul": kernel.amx_dequant_silu_mul}
    check_int4_silu_mul(
        "w4amx", fused, ((1, 128, 64, 32), (17, 256, 256, 128), (40, 64, 96, 32)), compact=kernel.compact
    )


_builds = Builds(W4AMX.build, "W4A16 layers will not run on AMX tiles (w4mm still can)", self_check, amxmm.supported)
kernel, kernel_without_prefetch = _builds.kernel, _builds.kernel_without_prefetch
