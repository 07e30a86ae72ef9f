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
from engine.kernels.gemm import SiluMulKernel, check_bf16_gemm, check_silu_mul, interleave_halves, run_bf16

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("amxmm.c")
NB, KB = 32, 32  # columns per packed block; k per tile step (K must be a multiple)

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class AMXMM:
    """The compiled kernel: pack a bf16 weight once, then run bf16 linear layers over it."""

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


class GroupedLinear:
    """Several bf16 linear layers of one shape (no bias) over consecutive row groups of one input, in one
    parallel region (amxmm_grouped): group g's rows go through weight g. For many small GEMMs in a row, where a
    call each paid a parallel region and a Python round trip: a MoE layer's experts, MLA's per-head W_UK / W_UV.
    With `silu_mul` the weights are gated MLPs' merged [gate; up] projections and the result silu(gate) * up."""

    def __init__(self, kernel: AMXMM, weights: list[torch.Tensor], silu_mul: bool = False) -> None:
        self.kernel, self.silu_mul = kernel, silu_mul
        self.n, self.k = weights[0].shape
        self.packed = [kernel.pack(interleave_halves(w) if silu_mul else w) for w in weights]
        self._ptrs = (_ptr * len(weights))(*(t.data_ptr() for t in self.packed))

    @staticmethod
    def accepts(weights: list[torch.Tensor], silu_mul: bool = False) -> bool:
        """bf16 weights of one shape, K in whole tiles (and whole gate/up block pairs for silu_mul)."""
        if not weights:
            return False
        n, k = weights[0].shape
        same = all(w.dtype == torch.bfloat16 and w.dim() == 2 and w.shape == (n, k) for w in weights)
        return same and k % KB == 0 and (not silu_mul or n % 64 == 0)

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [rows, K] bf16, group-major (counts[g] rows for group g, in order) → [rows, N] (N / 2 with silu_mul)."""
        # NOTE: the C side trusts these: a wrong count reads past the weights' pointers or the rows of x
        if len(counts) != len(self.packed) or sum(counts) != x.shape[0] or x.shape[-1] != self.k:
            raise ValueError(
                f"{len(counts)} groups of {sum(counts)} rows for {len(self.packed)} weights, x {tuple(x.shape)}"
            )
        x = x.to(torch.bfloat16).contiguous()
        y = torch.empty(x.shape[0], self.n // 2 if self.silu_mul else self.n, dtype=torch.bfloat16)
        c = (ctypes.c_int64 * len(counts))(*counts)
        self.kernel.lib.amxmm_grouped(
            len(counts), c, self.n, self.k, x.data_ptr(), self._ptrs, y.data_ptr(), torch.get_num_threads(),
            int(self.silu_mul),
        )  # fmt: skip
        return y


class GroupedExperts:
    """A mixture-of-experts layer's routed experts (SiLU gated MLPs, no bias) in two calls a step instead of two
    per expert: every expert's gate/up projection with the fused SiLU, then every expert's down projection, each
    one GroupedLinear call over all experts' column blocks."""

    def __init__(self, kernel: AMXMM, gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> None:
        """gate_up: each expert's [2I, H] merged weight ([gate; up]); down: each expert's [H, I]."""
        self.gate_up = GroupedLinear(kernel, gate_up, silu_mul=True)
        self.down = GroupedLinear(kernel, down)

    @staticmethod
    def accepts(gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> bool:
        """Both projections GroupedLinear's, one expert each, and they chain: [2I, H] then [H, I]."""
        if not gate_up or len(gate_up) != len(down) or gate_up[0].dim() != 2 or down[0].dim() != 2:
            return False
        (n, k), (h, i) = gate_up[0].shape, down[0].shape
        chained = n == 2 * i and h == k
        return chained and GroupedLinear.accepts(gate_up, silu_mul=True) and GroupedLinear.accepts(down)

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [rows, H] bf16, expert-major (counts[e] rows for expert e, in order) → the experts' outputs, [rows, H]."""
        return self.down(self.gate_up(x, counts), counts)


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
