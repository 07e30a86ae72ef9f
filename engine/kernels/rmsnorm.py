"""Fused residual add + RMSNorm for CPU (engine/kernels/rmsnorm.c), with `rms_norm`, the torch code it replaces.

At decode's few rows the eager version is ~9 torch ops whose dispatch dwarfs the arithmetic: 0.16 ms a call
for 32 x 896 on a 2-core Zen 4, 49 calls a step for a 24-layer model. The kernel does it in one pass with the
same roundings."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.kernels.cbuild import BuildError, Once, build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rmsnorm.c")
_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) in eager torch: the definition, as transformers computes it."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


class RMSNormKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for f in (lib.rmsnorm_f32, lib.rmsnorm_bf16):
            f.argtypes = [_i64, _i64, _ptr, _ptr, _ptr, _f32, _ptr, _ptr, _int]
            f.restype = None
        self._fn = {torch.float32: lib.rmsnorm_f32, torch.bfloat16: lib.rmsnorm_bf16}

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> RMSNormKernel:
        return cls(build(SOURCE, flags))

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in self._fn

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dim = x.shape[-1]
        x2 = x.contiguous()
        r2 = residual.contiguous() if residual is not None else None
        out = torch.empty_like(x2)
        total = torch.empty_like(x2) if r2 is not None else x2
        self._fn[x.dtype](
            x2.numel() // dim if dim else 0, dim, x2.data_ptr(), r2.data_ptr() if r2 is not None else None,
            weight.contiguous().data_ptr(), eps, out.data_ptr(), total.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out, total


def self_check(kernel: RMSNormKernel) -> None:
    """Compare with `rms_norm` on both dtypes, with and without a residual, vector tails and many rows."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, dim in ((1, 37), (3, 64), (70, 200)):
            x, r = (torch.randn(rows, dim, generator=g).to(dtype) for _ in range(2))
            w = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
            for res in (None, r):
                got, want = kernel(x, res, w, 1e-6), rms_norm(x, res, w, 1e-6)
                for a, b in zip(got, want, strict=True):
                    if not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-5):
                        raise BuildError(f"self-check failed for {dtype} {rows}x{dim}")


def _build_checked() -> RMSNormKernel:
    k = RMSNormKernel.build()
    self_check(k)
    return k


# The process-wide kernel built for this CPU, or None (logged once) where it cannot be built.
kernel = Once(_build_checked, log, "RMSNorm will run as separate torch ops (slower at small batches)")
