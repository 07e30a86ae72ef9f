"""bfloat16 linear layers on Intel AMX tiles (engine/kernels/amxmm.c), for the small batches of decode.

A candidate like any other: engine.kernels.select times it against oneDNN (which uses AMX too, and wins at
prefill sizes) per weight shape and batch size, and keeps it only where it is faster.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.kernels.cbuild import BuildError, Once, build
from engine.kernels.gemm import CEntry, SiluMulKernel, check_bf16_gemm, check_silu_mul, gemm_entry, run_bf16

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("amxmm.c")
NB, KB = 32, 32  # columns per packed block; k per tile step (K must be a multiple)

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class AMXMM:
    """The compiled kernel: pack a bf16 weight once, then run bf16 linear layers over it, one or a group at a time
    (engine.kernels.grouped)."""

    k_multiple = KB
    dtype = torch.bfloat16  # math and activations (engine.kernels.grouped.GroupedKernel)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for f in (lib.amxmm_linear, lib.amxmm_linear_silu_mul):
            f.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int]
            f.restype = None
        lib.amxmm_grouped.argtypes = [_i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _int]
        lib.amxmm_grouped.restype = None
        lib.amxmm_pack.argtypes = [_i64, _i64, _ptr, _ptr, _int]
        lib.amxmm_pack.restype = None
        lib.amxmm_init.restype = ctypes.c_int
        if lib.amxmm_init() != 0:
            raise BuildError("the kernel cannot use AMX: Linux refused the tile state (arch_prctl)")

    @classmethod
    def build(cls, extra: tuple[str, ...] = ()) -> AMXMM:
        return cls(build(SOURCE, ("-march=native", "-mamx-tile", "-mamx-bf16", *extra)))

    def accepts(self, weight: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % KB == 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bf16 weight → the kernel's tile layout (1-D)."""
        w = weight.detach().contiguous()
        n, k = w.shape
        packed = torch.empty(-(-n // NB) * NB * k, dtype=torch.bfloat16)
        self.lib.amxmm_pack(n, k, w.data_ptr(), packed.data_ptr(), torch.get_num_threads())
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] bf16 → x W^T + b, [..., N] bf16."""
        return run_bf16(self.lib.amxmm_linear, x, packed, n, bias, n)

    def c_entry(self, n: int, bias: torch.Tensor | None, packed: torch.Tensor) -> CEntry:
        """engine.kernels.gemm.KernelRun.c_entry."""
        b = bias.to(torch.bfloat16).contiguous() if bias is not None else None
        return gemm_entry(self.lib.amxmm_linear, n, n, packed, b, torch.bfloat16)

    def grouped_entry(self) -> object:
        """`grouped`'s C entry point, which a decode program calls itself (engine.kernels.program)."""
        return self.lib.amxmm_grouped

    def grouped(
        self, counts: ctypes.Array, n: int, k: int, x: torch.Tensor, weights: ctypes.Array, y: torch.Tensor,
        silu_mul: bool,
    ) -> None:  # fmt: skip
        """engine.kernels.grouped.GroupedKernel.grouped."""
        self.lib.amxmm_grouped(len(counts), counts, n, k, x.data_ptr(), weights, y.data_ptr(),
                               torch.get_num_threads(), int(silu_mul))  # fmt: skip


class SiluMulAMXMM(SiluMulKernel):
    """amxmm.c's fused gated-MLP entry point (engine.kernels.gemm.SiluMulKernel)."""

    def __init__(self, base: AMXMM) -> None:
        super().__init__(base, base.lib.amxmm_linear_silu_mul)


def supported() -> bool:
    """AMX tiles: the only reason to try building the kernel (whether it is used is measured)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def self_check(kernel: AMXMM) -> None:
    """Awkward shapes: row tails of each kind (under 16, 16-32, past a 32-row block), a column tail."""
    check_bf16_gemm(kernel, ((1, 70, 32), (7, 32, 64), (17, 45, 96), (40, 64, 32), (64, 33, 64)))
    check_silu_mul(SiluMulAMXMM(kernel), ((1, 64, 32), (17, 128, 64), (40, 192, 96)))


_once = Once(AMXMM.build, log, "the AMX GEMM is not a candidate (oneDNN's AMX path still is)", check=self_check)
_once_plain = Once(
    lambda: AMXMM.build(("-DPF=0",)), log, "the AMX GEMM without prefetch is not a candidate", check=self_check
)


def kernel() -> AMXMM | None:
    """The process-wide kernel for this CPU; None without AMX, or (logged once) where it can't be built."""
    return _once() if supported() else None


def kernel_without_prefetch() -> AMXMM | None:
    """The kernel built with no software prefetch (PF=0), as kernel() otherwise."""
    return _once_plain() if supported() else None
