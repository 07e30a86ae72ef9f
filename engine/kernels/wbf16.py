"""Linear layers over bf16-stored weights with float32 math, for CPUs that have no bf16 arithmetic.

Most checkpoints ship in bf16. On a CPU without AVX512-BF16/AMX the engine computes in float32, and widening
the weights to fp32 doubles the bytes every decode step streams from memory. A weight whose fp32 values are
all exactly bf16 (true of every weight loaded from a bf16 checkpoint) loses nothing by being kept as bf16 and
widened in registers: the result is what float32 gives, up to summation order. Measured on a 2-core Cascade
Lake (`python -m benchmarks.gemm`, docs/PERFORMANCE.md): 2-3x faster than oneDNN's fp32 GEMM at batch 1,
1.2-1.3x at batch 32; on a 2-core Zen 3 (AVX2) 2-4x at batch 1, 1.0-1.2x at 32.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.kernels.cbuild import BuildError, Once, SelfCheckError, build, cpu_flags
from engine.kernels.gemm import CEntry, SiluMulKernel, gemm_entry, interleave_halves

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("wbf16.c")
BLOCK = 64  # output columns per packed block (NB in wbf16.c)
# From this many rows on, widening the weight once and calling torch's GEMM beats the kernel (prefill sizes).
BLAS_ROWS = 1024

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class WBF16:
    """The compiled kernel: pack a weight once, then run linear layers over it; with a grouped entry point
    (engine.kernels.grouped) for float32 math."""

    k_multiple = 1  # any K
    dtype = torch.float32  # the activations' dtype (engine.kernels.grouped.GroupedKernel)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.wbf16_linear.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int]
        lib.wbf16_pack.argtypes = [_i64, _i64, _ptr, _ptr, _int]
        lib.wbf16_unpack_t.argtypes = [_i64, _i64, _ptr, _ptr, _int]
        lib.wbf16_grouped.argtypes = [_i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _int]
        for f in (lib.wbf16_linear, lib.wbf16_pack, lib.wbf16_unpack_t, lib.wbf16_grouped):
            f.restype = None

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> WBF16:
        return cls(build(SOURCE, flags))

    def accepts(self, weight: torch.Tensor) -> bool:
        """bf16 weights, and float32 ones that hold only bf16 values (lossless either way)."""
        return weight.dtype == torch.bfloat16 or bf16_exact(weight)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] weight (bf16, or fp32 holding bf16 values) → the kernel's blocked bf16 layout (1-D)."""
        w = weight.detach().to(torch.bfloat16).contiguous()
        n, k = w.shape
        packed = torch.empty(-(-n // BLOCK) * BLOCK * k, dtype=torch.bfloat16)
        self.lib.wbf16_pack(n, k, w.data_ptr(), packed.data_ptr(), torch.get_num_threads())
        return packed

    def widen_t(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The packed weight back as fp32 W^T [K, N]."""
        wt = torch.empty(k, n, dtype=torch.float32)
        self.lib.wbf16_unpack_t(n, k, packed.data_ptr(), wt.data_ptr(), torch.get_num_threads())
        return wt

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] fp32 → x W^T + b, [..., N] fp32."""
        k = x.shape[-1]
        x2 = x.reshape(-1, k).contiguous()
        m = x2.shape[0]
        if m >= BLAS_ROWS:
            wt = self.widen_t(packed, n, k)
            y = torch.addmm(bias, x2, wt) if bias is not None else torch.mm(x2, wt)
            return y.view(*x.shape[:-1], n)
        y = torch.empty(m, n, dtype=torch.float32)
        b = bias.data_ptr() if bias is not None else None
        self.lib.wbf16_linear(m, n, k, x2.data_ptr(), packed.data_ptr(), b, y.data_ptr(), torch.get_num_threads())
        return y.view(*x.shape[:-1], n)

    def c_entry(self, n: int, bias: torch.Tensor | None, packed: torch.Tensor) -> CEntry:
        """engine.kernels.gemm.KernelRun.c_entry (a decode program's rows are far below BLAS_ROWS)."""
        b = bias.to(torch.float32).contiguous() if bias is not None else None
        return gemm_entry(self.lib.wbf16_linear, n, n, packed, b, torch.float32)

    def grouped_entry(self) -> object:
        """`grouped`'s C entry point, which a decode program calls itself (engine.kernels.program)."""
        return self.lib.wbf16_grouped

    def grouped(
        self, counts: ctypes.Array, n: int, k: int, x: torch.Tensor, weights: ctypes.Array, y: torch.Tensor,
        silu_mul: bool,
    ) -> None:  # fmt: skip
        """engine.kernels.grouped.GroupedKernel.grouped, float32 rows in and out."""
        self.lib.wbf16_grouped(len(counts), counts, n, k, x.data_ptr(), weights, y.data_ptr(),
                               torch.get_num_threads(), int(silu_mul))  # fmt: skip


class SiluMulWBF16(SiluMulKernel):
    """wbf16.c's fused gated-MLP entry point in float32 math: silu(gate) * up straight out of the projection (no
    [T, 2I] intermediate, no separate SiLU and multiply), SiLU as x / (1 + exp(-x)). At prefill sizes the rows go
    through BLAS as WBF16.linear's do, then the same SiLU in torch."""

    dtype = torch.float32

    def __init__(self, base: WBF16) -> None:
        base.lib.wbf16_linear_silu_mul.argtypes = base.lib.wbf16_linear.argtypes
        base.lib.wbf16_linear_silu_mul.restype = None
        super().__init__(base, base.lib.wbf16_linear_silu_mul)
        self.base: WBF16 = base

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] fp32 → silu(x Wg^T + bg) * (x Wu^T + bu), [..., n / 2] fp32."""
        k = x.shape[-1]
        x2 = x.reshape(-1, k).to(torch.float32).contiguous()
        m = x2.shape[0]
        b = interleave_halves(bias).to(torch.float32).contiguous() if bias is not None else None
        if m >= BLAS_ROWS:
            wt = self.base.widen_t(packed, n, k)
            z = (torch.addmm(b, x2, wt) if b is not None else torch.mm(x2, wt)).view(m, -1, 2, 32)
            gate, up = z[:, :, 0], z[:, :, 1]
            return (gate / (1 + torch.exp(-gate)) * up).reshape(*x.shape[:-1], n // 2)
        y = torch.empty(m, n // 2, dtype=torch.float32)
        bp = b.data_ptr() if b is not None else None
        self.fn(m, n, k, x2.data_ptr(), packed.data_ptr(), bp, y.data_ptr(), torch.get_num_threads())
        return y.view(*x.shape[:-1], n // 2)


def check_silu_mul_f32(kernel: SiluMulWBF16) -> None:
    """The fused entry against float32 torch (projection, SiLU, product) on awkward row counts, with a bias."""
    g = torch.Generator().manual_seed(2)
    for m, n, k in ((1, 64, 33), (7, 128, 64), (13, 192, 5), (67, 128, 33)):  # 67: past a pass of SR rows (wbf16.c)
        w = torch.randn(n, k, generator=g).bfloat16().float()
        x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        gate, up = torch.addmm(b, x, w.t()).chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        got = kernel.linear(x, kernel.pack(w), n, b)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            raise SelfCheckError(f"fused SiLU self-check failed at {m}x{n}x{k}")


def silu_mul_kernel() -> SiluMulWBF16 | None:
    """The fused entry over the process-wide kernel, self-checked once; None where either cannot run."""
    return _silu_once()


def bf16_exact(weight: torch.Tensor) -> bool:
    """True when a float32 tensor holds only bf16 values (its low 16 bits are zero), so bf16 storage is lossless."""
    if weight.dtype != torch.float32 or weight.numel() == 0:
        return False
    return not bool((weight.detach().contiguous().view(torch.int32) & 0xFFFF).any())


def self_check(kernel: WBF16) -> None:
    """Compare against torch on awkward shapes (row tails, a partial column block, bias); raise if it differs."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 70, 33), (7, 130, 64), (13, 64, 5)):
        w = torch.randn(n, k, generator=g).bfloat16().float()
        x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        got, want = kernel.linear(x, kernel.pack(w), n, b), torch.addmm(b, x, w.t())
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            raise SelfCheckError(f"self-check failed at {m}x{n}x{k}: max error {(got - want).abs().max().item():.3g}")


# The process-wide kernel built for this CPU, or None (logged once) where it cannot be built.
kernel = Once(
    WBF16.build, log, "bf16 weights will be widened to float32 (twice the memory, slower decode)", check=self_check
)
_silu_once = Once(
    lambda: SiluMulWBF16(_checked_kernel()),
    log,
    "float32 gated MLPs will run their SiLU apart from the projection",
    check=check_silu_mul_f32,
)


_plain_once = Once(
    lambda: WBF16.build(("-march=native", "-DPF_TILES=1")),
    log,
    "wbf16 is timed with its prefetch of the next block only",
    check=self_check,
)


def kernel_without_prefetch() -> WBF16 | None:
    """The kernel built without its AVX-512 tiles' prefetch of the next block (PF_TILES=1), for the selection to
    time beside kernel(): on a Zen 5 in float32 math it took 0.85-0.95x the time of a gated MLP's or a wide weight's
    GEMM at 8-32 rows streamed from memory, and 1.19x at 8 rows of a 1,024 x 2,816 weight (2026-12-08). None
    without AVX-512, where the flag changes no code (the AVX2 tiles ask for their own block ahead either way)."""
    return _plain_once() if "avx512f" in cpu_flags() else None


def _checked_kernel() -> WBF16:
    k = kernel()
    if k is None:
        raise BuildError("the wbf16 kernel is not available")
    return k
