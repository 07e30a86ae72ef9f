"""bfloat16 linear layers for CPUs with AVX512-BF16 (engine/kernels/bf16mm.c).

Same arithmetic as oneDNN's bf16 GEMM on these CPUs (VDPBF16PS: bf16 products, fp32 sums, one rounding to
bf16 at the end), with less overhead at decode's small batches. Measured on a 2-core Zen 4
(`python -m benchmarks.gemm`, docs/PERFORMANCE.md), hot in cache: 1.3-1.7x oneDNN's prepacked bf16 at batch 1,
1.0-1.1x at batch 32, even at 4,096 rows; in the model, where weights stream from memory, more. A gated MLP's
[gate | up] projection can return silu(gate) * up directly (SiluMulBF16MM): no [T, 2I] intermediate and no
separate SiLU and multiply passes (1.17x at 4,096 rows).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.kernels.cbuild import Once, build
from engine.kernels.gemm import CEntry, SiluMulKernel, check_bf16_gemm, gemm_entry, run_bf16

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bf16mm.c")
BLOCK = 64  # output columns per packed block (NB in bf16mm.c)

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class BF16MM:
    """The compiled kernel: pack a bf16 weight once, then run bf16 linear layers over it, one or a group at a time
    (engine.kernels.grouped)."""

    k_multiple = 1  # an odd K's last pair is padded
    dtype = torch.bfloat16  # math and activations (engine.kernels.grouped.GroupedKernel)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.bf16mm_linear.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int]
        lib.bf16mm_pack.argtypes = [_i64, _i64, _ptr, _ptr, _int]
        lib.bf16mm_grouped.argtypes = [_i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _int]
        for f in (lib.bf16mm_linear, lib.bf16mm_pack, lib.bf16mm_grouped):
            f.restype = None

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> BF16MM:
        return cls(build(SOURCE, flags))

    def accepts(self, weight: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bf16 weight → the kernel's blocked layout (1-D)."""
        w = weight.detach().contiguous()
        n, k = w.shape
        packed = torch.empty(-(-n // BLOCK) * BLOCK * (k + k % 2), dtype=torch.bfloat16)
        self.lib.bf16mm_pack(n, k, w.data_ptr(), packed.data_ptr(), torch.get_num_threads())
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] bf16 → x W^T + b, [..., N] bf16."""
        return run_bf16(self.lib.bf16mm_linear, x, packed, n, bias, n)

    def c_entry(self, n: int, bias: torch.Tensor | None, packed: torch.Tensor) -> CEntry:
        """engine.kernels.gemm.KernelRun.c_entry."""
        b = bias.to(torch.bfloat16).contiguous() if bias is not None else None
        return gemm_entry(self.lib.bf16mm_linear, n, n, packed, b, torch.bfloat16)

    def grouped_entry(self) -> object:
        """`grouped`'s C entry point, which a decode program calls itself (engine.kernels.program)."""
        return self.lib.bf16mm_grouped

    def grouped(
        self, counts: ctypes.Array, n: int, k: int, x: torch.Tensor, weights: ctypes.Array, y: torch.Tensor,
        silu_mul: bool,
    ) -> None:  # fmt: skip
        """engine.kernels.grouped.GroupedKernel.grouped."""
        self.lib.bf16mm_grouped(len(counts), counts, n, k, x.data_ptr(), weights, y.data_ptr(),
                                torch.get_num_threads(), int(silu_mul))  # fmt: skip


class SiluMulBF16MM(SiluMulKernel):
    """bf16mm.c's fused gated-MLP entry point (engine.kernels.gemm.SiluMulKernel)."""

    def __init__(self, base: BF16MM) -> None:
        base.lib.bf16mm_linear_silu_mul.argtypes = base.lib.bf16mm_linear.argtypes
        base.lib.bf16mm_linear_silu_mul.restype = None
        super().__init__(base, base.lib.bf16mm_linear_silu_mul)


def supported() -> bool:
    """AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later): the instruction the kernel is made of."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


def self_check(kernel: BF16MM) -> None:
    """Awkward shapes: odd K, row and column tails, more rows than one pass takes."""
    check_bf16_gemm(kernel, ((1, 70, 33), (7, 130, 64), (13, 64, 5), (200, 65, 9)))


_once = Once(BF16MM.build, log, "bfloat16 linear layers will use oneDNN (slower at small batches)", check=self_check)
# the same kernel without its software prefetch of the next weight block (tuned on one CPU): timed beside it
_once_plain = Once(
    lambda: BF16MM.build(("-march=native", "-DPF_TILES=1", "-DPF_AHEAD=0")),
    log,
    "bfloat16 linear layers are not timed without software prefetch",
    check=self_check,
)


# the same tiles in float32 FMAs over the same packed weights (FMA32 in bf16mm_block.h): timed beside it
_once_fma = Once(
    lambda: BF16MM.build(("-march=native", "-DFMA32")),
    log,
    "bfloat16 linear layers are not timed with float32 FMAs",
    check=self_check,
)


def kernel() -> BF16MM | None:
    """The process-wide kernel for this CPU; None without AVX512-BF16, or (logged once) where it can't be built."""
    return _once() if supported() else None


def kernel_without_prefetch() -> BF16MM | None:
    """The kernel built with no software prefetch (PF_TILES=1, PF_AHEAD=0), as kernel() otherwise."""
    return _once_plain() if supported() else None


def kernel_fma32() -> BF16MM | None:
    """The kernel whose tiles widen the weights and multiply in float32 FMAs (FMA32), as kernel() otherwise."""
    return _once_fma() if supported() else None
