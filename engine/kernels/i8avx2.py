"""W8A8 linear layers for CPUs with AVX2 but no VNNI (engine/kernels/i8avx2.c): int8 weights with a float scale
per output channel, float32 activations quantized to int8 per row inside the call exactly as compressed-tensors
defines it (engine.quant.weights.quantize_tokens), exact int32 sums by VPMADDWD over int16-widened bytes. Two
entry points: `linear` widens each weight row as it reads it, for every row of x (decode); `panel` widens a
16-column block once per 512 inputs into a buffer shared by every row (batches).

Without VNNI, oneDNN's int8 GEMM saturates on this kind of CPU and torch._int_mm was 4x slower than the float
model (a Zen 3, 2026-12-04). The engine times this kernel against them per shape and batch class
(engine.quant.paths).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels.cbuild import Once, SelfCheckError, build, cpu_flags
from engine.kernels.gemm import CEntry
from engine.kernels.program import ProgramBuilder, address
from engine.quant.weights import Int8Weight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("i8avx2.c")
NC, KC = 4, 32  # columns a tile, inputs a step (NC in i8avx2.c; K is padded to whole steps)

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@dataclass(slots=True)
class PackedInt8Rows:
    """A weight in the kernel's layout ([N4, K32] int8, zero-padded) with its scales and bias (float32 [N4];
    None without)."""

    packed: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    n: int
    k: int


class I8AVX2:
    """The compiled kernel: pack an int8 weight once, then run W8A8 linear layers over it (float32)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for fn in (lib.i8avx2_linear, lib.i8avx2_linear_panel):
            fn.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            fn.restype = _int

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> I8AVX2:
        return cls(build(SOURCE, flags))

    def c_fn(self, entry: str) -> ctypes._CFuncPtr:
        """The C function a decode program calls for an entry method (`linear`, `panel`): the same call with
        i8mm_linear's arguments (the program's signature for W8A8)."""
        return getattr(self.lib, f"i8avx2_program_{entry}")

    @staticmethod
    def pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> PackedInt8Rows:
        """q: int8 [N, K]; scale: float [N]; bias: [N] or None → the kernel's layout."""
        n, k = q.shape
        pn, pk = -(-n // NC) * NC - n, -(-k // KC) * KC - k
        # zero weights where padded; an aligned weight is read where it lies (no second copy of the model)
        packed = F.pad(q, (0, pk, 0, pn)) if pk or pn else q.contiguous()
        b = F.pad(bias.float(), (0, pn)).contiguous() if bias is not None else None
        return PackedInt8Rows(packed, F.pad(scale.float(), (0, pn)).contiguous(), b, n, k)

    def linear(self, x: torch.Tensor, w: PackedInt8Rows) -> torch.Tensor:
        """x [..., K] → x W^T + b, [..., N] float32 (the weight widened per row of x)."""
        return self._call(self.lib.i8avx2_linear, x, w)

    def panel(self, x: torch.Tensor, w: PackedInt8Rows) -> torch.Tensor:
        """The same, each block of the weight widened once for every row of x."""
        return self._call(self.lib.i8avx2_linear_panel, x, w)

    @staticmethod
    def _call(fn: ctypes._CFuncPtr, x: torch.Tensor, w: PackedInt8Rows) -> torch.Tensor:
        x2 = x.reshape(-1, w.k).float().contiguous()
        y = torch.empty(x2.shape[0], w.n, dtype=torch.float32)
        rc = fn(
            x2.shape[0], w.n, w.k, x2.data_ptr(), w.packed.data_ptr(), w.scale.data_ptr(),
            w.bias.data_ptr() if w.bias is not None else None, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("i8avx2: no memory for the quantized rows or a widened panel")
        return y.view(*x.shape[:-1], w.n)


def i8avx2_entry(fn: ctypes._CFuncPtr, w: PackedInt8Rows) -> CEntry:
    """How a decode program calls `fn` (I8AVX2.c_fn) over `w` with float32 rows: N columns out."""
    bias = w.bias.data_ptr() if w.bias is not None else None

    def emit(builder: ProgramBuilder, k: int, x: int, y: int) -> None:
        builder.i8mm(address(fn), w.n, w.k, x, w.packed.data_ptr(), None, w.scale.data_ptr(), bias, y, False)

    keep = tuple(t for t in (w.packed, w.scale, w.bias) if t is not None)
    return CEntry(w.n, torch.float32, emit, keep)


def self_check(kernel: I8AVX2) -> None:
    """Both entry points: column and K tails, row tails of the panel's tiles and passes, more than one panel chunk
    of inputs, the products at their extremes (-128 against -128)."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 70, 33), (7, 130, 64), (33, 64, 9), (3, 16, 256), (98, 20, 1100)):
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        q[:, : k // 2] = 127
        q[::2, : k // 2] = -128
        scale = torch.rand(n, generator=g) * 0.02 + 1e-3
        bias = torch.randn(n, generator=g)
        x = torch.randn(m, k, generator=g)
        x[:, : k // 2] = -1.0  # every row's largest magnitude is negative: it quantizes to -128
        want = Int8Weight(q, scale).reference(x, bias)
        packed = I8AVX2.pack(q, scale, bias)
        for entry in (kernel.linear, kernel.panel):
            got = entry(x, packed)
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()):
                err = (got - want).abs().max().item()
                raise SelfCheckError(f"i8avx2 {entry.__name__} self-check failed at {m}x{n}x{k}: max error {err:.3g}")


def supported() -> bool:
    """AVX2 (VPMADDWD and VPMOVSXBW on 256 bits)."""
    return "avx2" in cpu_flags()


_once = Once(I8AVX2.build, log, "W8A8 layers will use torch._int_mm (slower)", check=self_check)
# the same kernel without its software prefetch (PF_TILES was set on one Zen 3): timed beside it, never forced
_once_plain = Once(
    lambda: I8AVX2.build(("-march=native", "-DPF_TILES=0")),
    log,
    "W8A8 layers are not timed without software prefetch",
    check=self_check,
)


def kernel() -> I8AVX2 | None:
    """The process-wide kernel; None without AVX2, or (logged once) where it can't be built."""
    return _once() if supported() else None


def kernel_without_prefetch() -> I8AVX2 | None:
    """The kernel built with no prefetch ahead (PF_TILES=0: it asks for the tile it reads), as kernel() otherwise."""
    return _once_plain() if supported() else None
