"""W8A8 linear layers on Intel AMX-INT8 tiles (engine/kernels/i8amx.c), over i8mm's packed weight (the same copy):
activations quantized per row inside the call exactly as compressed-tensors defines it, int32 sums by TDPBUSD.
For batches and prefill on AMX CPUs, where i8mm's VNNI loops trail the bf16 model's AMX tiles; the engine times it
with i8mm, oneDNN's int8 GEMM and torch._int_mm per shape and batch class (engine.quant.paths).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.kernels import amxmm
from engine.kernels.cbuild import BuildError, Once, build, cpu_flags
from engine.kernels.i8mm import I8MM, PackedInt8, check_int8_kernel, check_int8_silu_mul

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("i8amx.c")
KB = 64  # K is whole 64-input tile steps

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class I8AMX:
    """The compiled kernel: W8A8 linear layers over a weight I8MM.pack made."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.i8amx_linear.argtypes = [_i64, _i64, _i64, _ptr, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
        lib.i8amx_linear.restype = _int
        # as i8mm's fused entry (engine.quant.paths.I8MMSiluPath), over its copy; built where the CPU has AVX512-BF16
        self.has_silu_mul = hasattr(lib, "i8amx_linear_silu_mul")
        if self.has_silu_mul:
            lib.i8amx_linear_silu_mul.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            lib.i8amx_linear_silu_mul.restype = _int
        self.has_grouped = hasattr(lib, "i8amx_grouped")  # the same (bf16 rows in and out)
        if self.has_grouped:
            lib.i8amx_grouped.argtypes = [_i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _int]
            lib.i8amx_grouped.restype = _int
        lib.i8amx_init.restype = _int
        if lib.i8amx_init() != 0:
            raise BuildError("the kernel cannot use AMX: Linux refused the tile state (arch_prctl)")

    @classmethod
    def build(cls, extra: tuple[str, ...] = ()) -> I8AMX:
        return cls(build(SOURCE, ("-march=native", "-mamx-tile", "-mamx-int8", *extra)))

    @staticmethod
    def accepts(k: int) -> bool:
        return k % KB == 0

    def c_fn(self, entry: str) -> ctypes._CFuncPtr | None:
        """I8MM.c_fn on AMX tiles."""
        if entry == "linear":
            return self.lib.i8amx_linear
        return self.lib.i8amx_linear_silu_mul if entry == "linear_silu_mul" and self.has_silu_mul else None

    def linear(self, x: torch.Tensor, w: PackedInt8) -> torch.Tensor:
        """x [..., K] (bf16 or float32) → x W^T + b, [..., N] of x's dtype."""
        return I8MM.run(self.lib.i8amx_linear, x, w, "i8amx")

    def linear_silu_mul(self, x: torch.Tensor, w: PackedInt8) -> torch.Tensor:
        """I8MM.linear_silu_mul on AMX tiles, over the same interleaved copy: the same bits."""
        return I8MM.run_silu_mul(self.lib.i8amx_linear_silu_mul, x, w, "i8amx")

    def grouped_entry(self) -> object:
        """`grouped`'s C entry point, which a decode program calls itself (engine.kernels.program)."""
        return self.lib.i8amx_grouped

    def grouped(
        self, x: torch.Tensor, counts: ctypes.Array, shape: tuple[int, int], weights: tuple[ctypes.Array, ...],
        silu_mul: bool,
    ) -> torch.Tensor:  # fmt: skip
        """I8MM.grouped on AMX tiles, over the same packed copies (K a multiple of 64: accepts)."""
        return I8MM.run_grouped(self.lib.i8amx_grouped, x, counts, shape, weights, silu_mul, "i8amx")


def supported() -> bool:
    """AMX-INT8 tiles (and VNNI, which every AMX CPU has: the quantized rows' layout is i8mm's)."""
    return amxmm.supported() and {"amx_int8", "avx512_vnni"} <= cpu_flags()


def self_check(kernel: I8AMX) -> None:
    """Row tails under 16, 16-32 and past 32, a column tail, several k-steps, both input types."""
    check_int8_kernel("i8amx", kernel.linear, ((1, 70, 64), (17, 130, 128), (40, 64, 192), (13, 16, 256)))
    if kernel.has_silu_mul:
        check_int8_silu_mul(kernel, ((1, 128, 64), (17, 256, 128), (40, 64, 192)), "i8amx")


_once = Once(I8AMX.build, log, "W8A8 layers will not run on AMX tiles (i8mm still can)", check=self_check)
_once_plain = Once(
    lambda: I8AMX.build(("-DPF=0",)), log, "i8amx is not timed without software prefetch", check=self_check
)


def kernel() -> I8AMX | None:
    """The process-wide kernel; None without AMX-INT8, or (logged once) where it can't be built."""
    return _once() if supported() else None


def kernel_without_prefetch() -> I8AMX | None:
    """The kernel built with no software prefetch of the weights (PF=0), as kernel() otherwise."""
    return _once_plain() if supported() else None
