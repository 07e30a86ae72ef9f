"""GEMM paths for quantized weights (engine.kernels.gemm's GemmPath, for an Int8Weight / Int4Weight instead of
a dense tensor); the engine times them per shape and batch class with the dense ones (engine.kernels.select).

W8A8: activations quantized per token, then int8 x int8 → int32 products by oneDNN (AMX-INT8 / VNNI where the
CPU has them), torch._int_mm, or on AVX512-VNNI CPUs engine.kernels.i8mm (the whole layer in one call; on AMX
CPUs also engine.kernels.i8amx over the same packed weight), on AVX2 CPUs that compute in float32
engine.kernels.i8avx2 (the same, by VPMADDWD). W4A16:
torch's CPU int4 GEMM (weights unpacked in registers, float math) and, on AVX512-BF16 CPUs,
engine.kernels.w4mm's two entry points (nibbles widened in registers; a group at a time through bf16mm's
tiles), on AMX CPUs engine.kernels.w4amx's two (a group, or a whole column block dequantized, through AMX
tiles), or where the engine computes in float32, engine.kernels.w4f32's two (the same two ideas in float32
FMAs). The reference path (dequantize, then matmul) runs anywhere and is the correctness definition."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from engine.kernels import i8amx, i8avx2, i8mm, w4amx, w4f32, w4fp16, w4mm, w4vnni
from engine.kernels.gemm import Act, CEntry, EntryRun, GemmPath, Run, interleave_halves, packed_once, with_act
from engine.kernels.i8amx import I8AMX
from engine.kernels.i8avx2 import I8AVX2, PackedInt8Rows, i8avx2_entry
from engine.kernels.i8mm import I8MM, PackedInt8, i8_entry
from engine.kernels.w4_builds import PackedLayoutKernel, is_compact
from engine.kernels.w4amx import W4AMX
from engine.kernels.w4f32 import W4F32, PackedInt4F32
from engine.kernels.w4fp16 import W4FP16
from engine.kernels.w4mm import W4MM, PackedInt4, w4_entry
from engine.kernels.w4vnni import W4VNNI
from engine.quant.weights import Int4Weight, Int8Weight, quantize_tokens

log = logging.getLogger(__name__)


def _probe(name: str, fn: object) -> bool:
    try:
        fn()  # type: ignore[operator]
    except (AttributeError, RuntimeError, NotImplementedError) as e:  # private ops: missing or unsupported here
        log.debug("quantized GEMM path %s unavailable (%s)", name, e)
        return False
    return True


_usable: dict[str, bool] = {}  # W8A8 path name → whether it passed its probes in this process


def _best_of_turns(a: Callable[[], object], b: Callable[[], object], rounds: int = 5) -> tuple[float, float]:
    """The fastest of `rounds` calls of each, taking turns, after one warm-up call each (first-call set-up)."""
    a(), b()
    best = [math.inf, math.inf]
    for _ in range(rounds):
        for i, fn in enumerate((a, b)):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best[0], best[1]


def interleaved(w: Int8Weight | Int4Weight) -> Int8Weight | Int4Weight:
    """A gated MLP's [gate; up] rows in blocks of 32 alternating (interleave_halves), the weight's every part:
    what the kernels' fused silu(gate) * up entry points read."""
    if isinstance(w, Int8Weight):
        return Int8Weight(interleave_halves(w.q), interleave_halves(w.scale))
    return Int4Weight(interleave_halves(w.packed), interleave_halves(w.scale), interleave_halves(w.zero), w.group_size)


class QuantReferencePath:
    """Dequantize the whole weight each call, then float32 matmul: slow, exact, everywhere. What
    gemm_path=torch runs for a quantized layer."""

    name = "torch-dequant"
    layout = ""  # runs on the weight as stored: holding it costs nothing (engine.kernels.select)

    def accepts(self, weight: object, act: Act | None) -> bool:
        return isinstance(weight, (Int8Weight, Int4Weight))

    def prepare(self, weight: Int8Weight | Int4Weight, bias: torch.Tensor | None, act: Act | None) -> Run:  # type: ignore[override]
        return with_act(lambda x: weight.reference(x, bias).to(x.dtype), act)


class _W8A8Path:
    """Shared by the int8 paths: per-token quantization in, per-token x per-channel scaling out."""

    name = ""
    SLOW = 50.0  # an int8 GEMM slower than this many float32 matmuls of its shape is broken here (_check_speed)

    def __init__(self) -> None:
        known = _usable.get(self.name)
        if known is None:  # probed once a process: the speed check takes up to a second where the path is slow
            w = Int8Weight(torch.ones(8, 16, dtype=torch.int8), torch.ones(8))
            known = _usable[self.name] = (
                _probe(self.name, lambda: self.prepare(w, None, None)(torch.ones(2, 16)))
                and _probe(self.name, self._check_exact)
                and _probe(self.name, self._check_speed)
            )
        self.available = known

    def _check_exact(self) -> None:
        """Raise unless the int32 products are exact at the int8 extremes. WHY: on a CPU without VNNI (a Zen 3, AVX2,
        2026-12-02) oneDNN's int8 GEMM adds u8 x s8 pairs into int16 with saturation (vpmaddubsw), and products
        near 127 x 127 came out wrong; the selection's reference check would drop it per shape, but a path that
        is wrong on this CPU is not a candidate at all."""
        g = torch.Generator().manual_seed(0)
        q = torch.randint(-127, 128, (32, 64), generator=g, dtype=torch.int8)
        q[:, :16] = 127  # pairs of extremes: 2 x 255 x 127 overflows an int16
        xq = torch.randint(-127, 128, (4, 64), generator=g, dtype=torch.int8)
        xq[:, :16] = torch.tensor([127, -127], dtype=torch.int8).repeat(8)
        got = self.products(Int8Weight(q, torch.ones(32)))(xq).double()
        if not torch.allclose(got, xq.double() @ q.double().t(), rtol=0, atol=0.5):
            raise RuntimeError("its int8 products are not exact on this CPU (they saturate)")

    def _check_speed(self) -> None:
        """Raise if one int8 GEMM takes more than SLOW times float32 matmul's on the same shape. WHY: on a Zen 4
        (2026-12-01/02) oneDNN's int8 GEMM ran a reference implementation, ~2,000x a float32 matmul here, and
        timing it among the candidates made a model's first start take many minutes for a path that could never
        win. The two take turns, so load from elsewhere slows both alike."""
        g = torch.Generator().manual_seed(0)
        wq, x = torch.randint(-127, 128, (512, 512), generator=g, dtype=torch.int8), torch.randn(64, 512, generator=g)
        run, wf = self.prepare(Int8Weight(wq, torch.ones(512)), None, None), wq.float()
        ours, float_mm = _best_of_turns(lambda: run(x), lambda: torch.nn.functional.linear(x, wf))
        if ours > self.SLOW * float_mm:
            raise RuntimeError(f"its int8 GEMM took {ours / float_mm:.0f}x float32 matmul's time on this CPU")

    def accepts(self, weight: object, act: Act | None) -> bool:
        return self.available and isinstance(weight, Int8Weight)

    def products(self, weight: Int8Weight) -> Run:
        """int8 [M, K] → float32 [M, N]: Σ xq · wq, times the weight's channel scale where the op applies it."""
        raise NotImplementedError

    scaled = False  # whether products() already applies the weight's scale

    def prepare(self, weight: Int8Weight, bias: torch.Tensor | None, act: Act | None) -> Run:  # type: ignore[override]
        mm, wscale = self.products(weight), weight.scale
        b = bias.float() if bias is not None else None

        def run(x: torch.Tensor) -> torch.Tensor:
            xq, xs = quantize_tokens(x.reshape(-1, x.shape[-1]))
            y = mm(xq).mul_(xs) if self.scaled else mm(xq).float().mul_(xs).mul_(wscale)
            if b is not None:
                y.add_(b)
            return y.to(x.dtype).view(*x.shape[:-1], -1)

        return with_act(run, act)


class OneDNNInt8Path(_W8A8Path):
    """oneDNN's quantized linear on a prepacked int8 weight (what inductor's x86 int8 path uses)."""

    name = "onednn-int8"
    scaled = True

    def products(self, weight: Int8Weight) -> Run:
        packed = torch.ops.onednn.qlinear_prepack(weight.q, None)
        scale, zeros = weight.scale.float(), torch.zeros(weight.q.shape[0], dtype=torch.int64)
        op = torch.ops.onednn.qlinear_pointwise
        return lambda xq: op(xq, 1.0, 0, packed, scale, zeros, None, 1.0, 0, torch.float32, "none", [], "")


class IntMMPath(_W8A8Path):
    """torch._int_mm: int8 x int8 → int32."""

    name = "int-mm"
    layout = ""  # the weight as stored, transposed as a view

    def products(self, weight: Int8Weight) -> Run:
        wt = weight.q.t()
        return lambda xq: torch._int_mm(xq, wt)


class I8MMPath:
    """engine.kernels.i8mm (or, over the same packed copy, engine.kernels.i8amx on AMX CPUs): per-token
    quantization, int32 sums and both scales in one call, bf16 or float32 in and out. Every build of either runs
    on one packed copy of a weight (`layout`), kept while its int8 values live."""

    layout = "i8mm"

    def __init__(self, kernel: I8MM | I8AMX, name: str = "i8mm") -> None:
        self.kernel, self.name, self.available = kernel, name, True
        self._packed: dict[tuple[int, int], PackedInt8] = _PACKED_INT8

    def accepts(self, weight: object, act: Act | None) -> bool:
        return isinstance(weight, Int8Weight) and (not isinstance(self.kernel, I8AMX) or I8AMX.accepts(weight.shape[1]))

    def prepare(self, weight: Int8Weight, bias: torch.Tensor | None, act: Act | None) -> Run:  # type: ignore[override]
        packed = packed_once(
            self._packed, (id(weight.q), id(bias)), weight.q, lambda: I8MM.pack(weight.q, weight.scale, bias)
        )
        kernel, fn = self.kernel, self.kernel.c_fn("linear")
        entry = i8_entry(fn, packed, silu=False) if fn is not None else None
        return with_act(EntryRun(lambda x: kernel.linear(x, packed), entry), act)


_PACKED_INT8: dict[tuple[int, int], PackedInt8] = {}  # (int8 values' id, bias' id) → the packed copy (bias in it)


class I8MMSiluPath:
    """A gated MLP's [gate; up] projection through engine.kernels.i8mm's fused entry (or i8amx's, on AMX tiles over
    the same copy): silu(gate) * up comes out of the epilogue (bf16 math), as w4mm-silu-mul's does for W4A16. Only
    for SiLU MLPs, whose act it replaces; its packed copy has the rows interleaved (a layout of its own)."""

    layout = "i8mm-silu"

    def __init__(self, kernel: I8MM | I8AMX, name: str = "i8mm-silu-mul", float32: bool = False) -> None:
        """float32: the float32-rows entry (i8mm's alone: float32 math on AVX512-VNNI CPUs, with or without bf16)."""
        self.kernel, self.name, self.float32 = kernel, name, float32
        self.available = isinstance(kernel, I8MM) if float32 else kernel.has_silu_mul

    def accepts(self, weight: object, act: Act | None) -> bool:
        silu = getattr(act, "is_silu_and_mul", False)
        if not (self.available and silu and isinstance(weight, Int8Weight) and weight.shape[0] % 64 == 0):
            return False
        return not isinstance(self.kernel, I8AMX) or I8AMX.accepts(weight.shape[1])

    def prepare(self, weight: Int8Weight, bias: torch.Tensor | None, act: Act | None) -> Run:  # type: ignore[override]
        def pack() -> PackedInt8:
            w = interleaved(weight)
            return I8MM.pack(w.q, w.scale, interleave_halves(bias) if bias is not None else None)  # type: ignore[union-attr]

        packed = packed_once(_PACKED_INT8_SILU, (id(weight.q), id(bias)), weight.q, pack)
        kernel = self.kernel
        if self.float32:
            fn32 = kernel.c_fn("linear_silu_mul_f32")
            entry32 = i8_entry(fn32, packed, True, torch.float32) if fn32 is not None else None
            return EntryRun(lambda x: kernel.linear_silu_mul_f32(x, packed).to(x.dtype), entry32)  # type: ignore[union-attr]
        fn = kernel.c_fn("linear_silu_mul")
        entry = i8_entry(fn, packed, silu=True) if fn is not None else None
        return EntryRun(lambda x: kernel.linear_silu_mul(x, packed).to(x.dtype), entry)


_PACKED_INT8_SILU: dict[tuple[int, int], PackedInt8] = {}  # as _PACKED_INT8, rows interleaved


class I8AVX2Path:
    """engine.kernels.i8avx2: per-token quantization, VPMADDWD int32 sums and both scales in one call, float32
    in and out; entry `linear` (each weight row widened as it is read, for every row) or `panel` (a block widened
    once for all the rows). Every entry and build runs on one packed copy of a weight (`layout`; the weight as
    stored where its shape needs no padding), kept while its int8 values live."""

    layout = "i8avx2"

    def __init__(self, kernel: I8AVX2, name: str = "i8avx2", entry: str = "linear") -> None:
        self.kernel, self.name, self.entry, self.available = kernel, name, entry, True

    def accepts(self, weight: object, act: Act | None) -> bool:
        return isinstance(weight, Int8Weight)

    def prepare(self, weight: Int8Weight, bias: torch.Tensor | None, act: Act | None) -> Run:  # type: ignore[override]
        packed = packed_once(
            _PACKED_ROWS, (id(weight.q), id(bias)), weight.q, lambda: I8AVX2.pack(weight.q, weight.scale, bias)
        )
        fn = getattr(self.kernel, self.entry)
        entry = i8avx2_entry(self.kernel.c_fn(self.entry), packed)
        return with_act(EntryRun(lambda x: fn(x, packed).to(x.dtype), entry), act)


_PACKED_ROWS: dict[tuple[int, int], PackedInt8Rows] = {}  # as _PACKED_INT8, for i8avx2's layout


class I8AVX2SiluPath:
    """A gated MLP's [gate; up] projection through i8avx2's fused entry points (`linear` or `panel`, each with
    silu(gate) * up in float32 out of its epilogue): no [T, 2I] projection in memory and no stop of a decode
    program for the act. Only for SiLU MLPs, whose act it replaces; its packed copy has the rows interleaved (a
    layout of its own)."""

    layout = "i8avx2-silu"

    def __init__(self, kernel: I8AVX2, name: str = "i8avx2-silu-mul", entry: str = "linear") -> None:
        self.kernel, self.name, self.entry, self.available = kernel, name, f"{entry}_silu_mul", True

    def accepts(self, weight: object, act: Act | None) -> bool:
        silu = getattr(act, "is_silu_and_mul", False)
        return silu and isinstance(weight, Int8Weight) and weight.shape[0] % 64 == 0

    def prepare(self, weight: Int8Weight, bias: torch.Tensor | None, act: Act | None) -> Run:  # type: ignore[override]
        def pack() -> PackedInt8Rows:
            w = interleaved(weight)
            return I8AVX2.pack(w.q, w.scale, interleave_halves(bias) if bias is not None else None)

        packed = packed_once(_PACKED_ROWS_SILU, (id(weight.q), id(bias)), weight.q, pack)
        fn = getattr(self.kernel, self.entry)
        entry = i8avx2_entry(self.kernel.c_fn(self.entry), packed, silu=True)
        return EntryRun(lambda x: fn(x, packed).to(x.dtype), entry)


_PACKED_ROWS_SILU: dict[tuple[int, int], PackedInt8Rows] = {}  # i8avx2-silu's interleaved copies


class Int4PackPath:
    """torch's CPU int4 GEMM (_weight_int4pack_mm_for_cpu): w = (q - 8) · scale + zero per group, so our zero
    point z becomes the float offset (8 - z) · scale."""

    name = "int4pack"
    GROUPS = (32, 64, 128, 256)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        w = Int4Weight(torch.zeros(16, 16, dtype=torch.uint8), torch.ones(16, 1), torch.full((16, 1), 8), 32)
        self.available = _probe(self.name, lambda: self.prepare(w, None, None)(torch.ones(2, 32, dtype=dtype)))

    def accepts(self, weight: object, act: Act | None) -> bool:
        fits = isinstance(weight, Int4Weight) and weight.group_size in self.GROUPS and weight.shape[0] % 16 == 0
        return self.available and fits  # the op packs 16 output channels at a time

    def prepare(self, weight: Int4Weight, bias: torch.Tensor | None, act: Act | None) -> Run:  # type: ignore[override]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.values(), 1)
        offset = (8 - weight.zero.float()) * weight.scale
        scales_zeros = torch.stack((weight.scale, offset), dim=-1).transpose(0, 1).contiguous().to(self.dtype)
        g, n, b = weight.group_size, weight.shape[0], bias.to(self.dtype) if bias is not None else None
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu

        def run(x: torch.Tensor) -> torch.Tensor:
            y = mm(x.reshape(-1, x.shape[-1]), packed, g, scales_zeros)
            if b is not None:
                y = y + b
            return y.view(*x.shape[:-1], n)

        return with_act(run, act)


class _Int4KernelPath:
    """One entry point of an int4 kernel of ours (`direct`, `panel`, `amx-dequant`: the kernel's method, a dash
    for its underscore). A weight gets one packed copy, whichever entry points run it (a weight may hold several:
    select.py), kept while its nibbles live; keyed by their id (a tensor cannot key a WeakKeyDictionary: its == is
    elementwise)."""

    prefix = ""
    copy = ""  # the packed copy's name where it is not the kernel's own (default: prefix)
    bias_dtype = torch.float32

    def __init__(self, kernel: W4MM | W4AMX | W4FP16 | W4VNNI | W4F32, entry: str, variant: str = "") -> None:
        """variant: a suffix naming a build of the kernel ("-noprefetch": timed beside the default build)."""
        self.kernel, self.entry = kernel, entry
        self.name = (self.prefix if entry == "direct" else f"{self.prefix}-{entry}") + variant
        self.layout = self.copy or self.prefix  # every entry point and build runs on the one packed copy (GemmPath)
        self.available = True
        self._packed: dict[tuple[int, bool], object] = _PACKED.setdefault(self.layout, {})

    @staticmethod
    def fits(weight: Int4Weight) -> bool:
        raise NotImplementedError

    @staticmethod
    def pack(weight: Int4Weight, compact: bool = False) -> object:
        raise NotImplementedError

    def accepts(self, weight: object, act: Act | None) -> bool:
        return isinstance(weight, Int4Weight) and self.fits(weight)

    def _build_for(self, weight: Int4Weight) -> W4MM | W4AMX | W4FP16 | W4VNNI | W4F32:
        """The kernel's build for `weight`: over w4mm's layout, its compact-scales twin where the weight's scales are
        bf16 values (PackedLayoutKernel.for_scales: the same bits from fewer bytes)."""
        k = self.kernel
        return k.for_scales(weight.scale) if isinstance(k, PackedLayoutKernel) else k  # type: ignore[return-value]

    def _packed_for(
        self, weight: Int4Weight, compact: bool, rows: Callable[[Int4Weight], Int4Weight] | None = None
    ) -> object:
        """The weight's packed copy in this path's layout (its rows rearranged by `rows` first, where given), one
        per scales' layout."""
        key = (id(weight.packed), compact)
        return packed_once(
            self._packed, key, weight.packed, lambda: self.pack(rows(weight) if rows else weight, compact)
        )

    def prepare(self, weight: Int4Weight, bias: torch.Tensor | None, act: Act | None) -> Run:  # type: ignore[override]
        kernel = self._build_for(weight)
        packed = self._packed_for(weight, is_compact(kernel))
        fn = getattr(kernel, self.entry.replace("-", "_"))
        b = bias.to(self.bias_dtype) if bias is not None else None
        return with_act(EntryRun(lambda x: fn(x, packed, b).to(x.dtype), self._entry(kernel, packed, b, 1)), act)

    def _entry(self, kernel: object, packed: object, bias: torch.Tensor | None, per_row: int) -> CEntry | None:
        """The decode program's call of this entry point of `kernel` (w4mm's, w4amx's, w4fp16's and w4vnni's
        entries over bf16 rows; w4f32's over float32 rows), `per_row` weight rows to an output column (2 for a
        fused gated MLP)."""
        if isinstance(kernel, W4F32) and isinstance(packed, PackedInt4F32):
            kernel.check_layout(packed)
            fn, dtype = kernel.c_fn(self.entry), torch.float32
        elif isinstance(kernel, W4MM | W4AMX | W4FP16 | W4VNNI) and isinstance(packed, PackedInt4):
            kernel.check_layout(packed)
            fn, dtype = kernel.c_fn(self.entry.replace("-", "_")), torch.bfloat16
        else:
            return None
        return w4_entry(fn, packed, bias, packed.n // per_row, dtype) if fn is not None else None


_PACKED: dict[str, dict[tuple[int, bool], object]] = {}  # per kernel: (weight nibbles' id, compact) → packed copy


W4MM_ENTRIES = ("direct", "wide", "panel", "block")


class W4MMPath(_Int4KernelPath):
    """engine.kernels.w4mm for bf16 math: `direct` (nibbles widened in registers; `wide` the same in 6-8-row tiles),
    `panel` (a group at a time widened into a buffer and run through bf16mm's tiles) or `block` (a 64-column block
    dequantized to bf16 whole, then bf16mm's tiles over all of K)."""

    prefix, bias_dtype = "w4mm", torch.bfloat16

    @staticmethod
    def fits(weight: Int4Weight) -> bool:
        return W4MM.accepts(*weight.shape, weight.group_size)

    @staticmethod
    def pack(weight: Int4Weight, compact: bool = False) -> PackedInt4:
        p = weight.packed  # its nibbles as uint8 (values() is int32: 4 bytes a weight, gigabytes for a big head)
        values = torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)
        return W4MM.pack(values, weight.scale, weight.zero, weight.group_size, compact)


class _SiluEntries(_Int4KernelPath):
    """A gated MLP's [gate; up] projection through a kernel's fused entry points: silu(gate) * up comes out of the
    epilogue, so the [T, 2I] projection never goes to memory and a decode program needs no stop for the act. Only
    for SiLU MLPs, whose act it replaces; its packed copy has the rows interleaved in blocks of 32 (a layout of its
    own, `copy`)."""

    def accepts(self, weight: object, act: Act | None) -> bool:
        silu = getattr(act, "is_silu_and_mul", False)
        return silu and isinstance(weight, Int4Weight) and weight.shape[0] % 64 == 0 and self.fits(weight)

    def prepare(self, weight: Int4Weight, bias: torch.Tensor | None, act: Act | None) -> Run:  # type: ignore[override]
        kernel = self._build_for(weight)
        packed = self._packed_for(weight, is_compact(kernel), interleaved)
        fn = getattr(kernel, self.entry.replace("-", "_"))
        b = interleave_halves(bias.to(self.bias_dtype)) if bias is not None else None
        return EntryRun(lambda x: fn(x, packed, b).to(x.dtype), self._entry(kernel, packed, b, 2))


class W4MMSiluPath(_SiluEntries, W4MMPath):
    """w4mm's fused gated-MLP entry points (`silu-mul`: direct; `wide-silu-mul`; `block-silu-mul`), as bf16mm-silu's
    for bf16 weights."""

    copy = "w4mm-silu"


W4MM_SILU_ENTRIES = ("silu-mul", "wide-silu-mul", "block-silu-mul")


class W4AMXPath(W4MMPath):
    """engine.kernels.w4amx over w4mm's packed weight (the same copy): entry `amx` (a group at a time widened into
    tiles, its sums scaled) or `amx-dequant` (a block dequantized to bf16 whole), AMX's bf16 products for every
    row."""

    @staticmethod
    def fits(weight: Int4Weight) -> bool:
        return W4AMX.accepts(*weight.shape, weight.group_size)


class W4AMXSiluPath(W4MMSiluPath):
    """w4amx's fused gated-MLP entries (`amx-silu-mul`, `amx-dequant-silu-mul`) over w4mm-silu-mul's interleaved
    copy: AMX's bf16 products, and silu(gate) * up out of the epilogue."""

    @staticmethod
    def fits(weight: Int4Weight) -> bool:
        return W4AMX.accepts(*weight.shape, weight.group_size)


W4AMX_SILU_ENTRIES = ("amx-silu-mul", "amx-dequant-silu-mul")


class W4FP16Path(W4MMPath):
    """engine.kernels.w4fp16 over w4mm's packed weight (the same copy): entry `fp16`, AVX512-FP16 products of
    each row scaled by a power of two, summed 32 inputs at a time in fp16 and then in float."""

    @staticmethod
    def fits(weight: Int4Weight) -> bool:
        return W4FP16.accepts(*weight.shape, weight.group_size)


class W4FP16SiluPath(W4MMSiluPath):
    """w4fp16's fused gated-MLP entry (`fp16-silu-mul`) over w4mm-silu-mul's interleaved copy."""

    @staticmethod
    def fits(weight: Int4Weight) -> bool:
        return W4FP16.accepts(*weight.shape, weight.group_size)


class W4VNNIPath(W4MMPath):
    """engine.kernels.w4vnni over w4mm's packed weight (the same copy): entry `vnni`, the nibbles multiplied as bytes
    (VPDPBUSD) with each row's groups rounded to 14-bit integers, summed exactly in int32, then scaled in float."""

    @staticmethod
    def fits(weight: Int4Weight) -> bool:
        return W4VNNI.accepts(*weight.shape, weight.group_size)


class W4VNNISiluPath(W4MMSiluPath):
    """w4vnni's fused gated-MLP entry (`vnni-silu-mul`) over w4mm-silu-mul's interleaved copy."""

    @staticmethod
    def fits(weight: Int4Weight) -> bool:
        return W4VNNI.accepts(*weight.shape, weight.group_size)


class Int4DensePath:
    """engine.kernels.w4mm's `dense`: each call dequantizes the weight as stored into bf16 rows (a scratch buffer,
    not a copy per weight) and runs oneDNN's GEMM over them; for prefill, where that GEMM's blocking outruns the
    kernels that widen nibbles per column block."""

    name = "w4mm-dense"
    layout = ""  # no copy of the weight: holding it costs nothing (engine.kernels.select)

    def __init__(self, kernel: W4MM) -> None:
        self.kernel, self.available = kernel, True

    def accepts(self, weight: object, act: Act | None) -> bool:
        return isinstance(weight, Int4Weight) and weight.group_size % w4mm.DENSE_STEP == 0

    def prepare(self, weight: Int4Weight, bias: torch.Tensor | None, act: Act | None) -> Run:  # type: ignore[override]
        kernel = self.kernel
        return with_act(lambda x: kernel.dense(x, weight, bias).to(x.dtype), act)


class W4F32Path(_Int4KernelPath):
    """engine.kernels.w4f32 for float32 math: `direct` (nibbles widened in registers) or `panel` (a group at a
    time widened into a buffer for every row)."""

    prefix = "w4f32"

    @staticmethod
    def fits(weight: Int4Weight) -> bool:
        return W4F32.accepts(*weight.shape, weight.group_size)

    @staticmethod
    def pack(weight: Int4Weight, compact: bool = False) -> PackedInt4F32:
        return W4F32.pack(weight.packed, weight.scale, weight.zero, weight.group_size, compact)


class W4F32SiluPath(_SiluEntries, W4F32Path):
    """w4f32's fused gated-MLP entry points (`silu-mul`: direct; `panel-silu-mul`): silu(gate) * up in float32."""

    copy = "w4f32-silu"


W4F32_SILU_ENTRIES = ("silu-mul", "panel-silu-mul")


def quant_paths(dtype: torch.dtype) -> list[GemmPath]:
    """The quantized candidates on this machine: the fast ones that work here, then the reference."""
    Fast = (
        _W8A8Path
        | Int4PackPath
        | W4MMPath
        | W4F32Path
        | I8MMPath
        | I8MMSiluPath
        | I8AVX2Path
        | I8AVX2SiluPath
        | Int4DensePath
    )
    fast: list[Fast] = [
        OneDNNInt8Path(),
        IntMMPath(),
        Int4PackPath(dtype),
    ]
    if (k8 := i8mm.kernel()) is not None:
        fused = dtype in (torch.bfloat16, torch.float32)  # float32: its entry over float32 rows, SiLU in float32
        f32 = dtype == torch.float32
        fast += [I8MMPath(k8)] + ([I8MMSiluPath(k8, float32=f32)] if fused else [])
        if (plain := i8mm.kernel_without_prefetch()) is not None:  # whether prefetching pays is measured
            fast.append(I8MMPath(plain, "i8mm-noprefetch"))
            if fused:
                fast.append(I8MMSiluPath(plain, "i8mm-silu-mul-noprefetch", f32))
    if (k8x := i8amx.kernel()) is not None:
        fast.append(I8MMPath(k8x, "i8mm-amx"))
        if dtype == torch.bfloat16:
            fast.append(I8MMSiluPath(k8x, "i8mm-amx-silu-mul"))
        if (plain8x := i8amx.kernel_without_prefetch()) is not None:
            fast.append(I8MMPath(plain8x, "i8mm-amx-noprefetch"))
            if dtype == torch.bfloat16:
                fast.append(I8MMSiluPath(plain8x, "i8mm-amx-silu-mul-noprefetch"))
    if dtype == torch.bfloat16 and (k4 := w4mm.kernel()) is not None:
        fast += [W4MMPath(k4, entry) for entry in W4MM_ENTRIES] + [Int4DensePath(k4)]
        fast += [W4MMSiluPath(k4, entry) for entry in W4MM_SILU_ENTRIES]
        if (plain4 := w4mm.kernel_without_prefetch()) is not None:  # its prefetch distance was set on one CPU
            fast += [W4MMPath(plain4, entry, "-noprefetch") for entry in W4MM_ENTRIES]
            fast += [W4MMSiluPath(plain4, entry, "-noprefetch") for entry in W4MM_SILU_ENTRIES]
    if dtype == torch.bfloat16 and (k4a := w4amx.kernel()) is not None:
        fast += [W4AMXPath(k4a, "amx"), W4AMXPath(k4a, "amx-dequant")]
        fast += [W4AMXSiluPath(k4a, entry) for entry in W4AMX_SILU_ENTRIES]
        if (plain4a := w4amx.kernel_without_prefetch()) is not None:
            fast += [W4AMXPath(plain4a, "amx", "-noprefetch"), W4AMXPath(plain4a, "amx-dequant", "-noprefetch")]
            fast += [W4AMXSiluPath(plain4a, entry, "-noprefetch") for entry in W4AMX_SILU_ENTRIES]
    if dtype == torch.bfloat16 and (k4h := w4fp16.kernel()) is not None:
        fast += [W4FP16Path(k4h, "fp16"), W4FP16SiluPath(k4h, "fp16-silu-mul")]
        if (plain4h := w4fp16.kernel_without_prefetch()) is not None:
            fast += [W4FP16Path(plain4h, "fp16", "-noprefetch")]
            fast.append(W4FP16SiluPath(plain4h, "fp16-silu-mul", "-noprefetch"))
    if dtype == torch.bfloat16 and (k4v := w4vnni.kernel()) is not None:
        fast += [W4VNNIPath(k4v, "vnni"), W4VNNISiluPath(k4v, "vnni-silu-mul")]
        if (plain4v := w4vnni.kernel_without_prefetch()) is not None:
            fast += [W4VNNIPath(plain4v, "vnni", "-noprefetch")]
            fast.append(W4VNNISiluPath(plain4v, "vnni-silu-mul", "-noprefetch"))
    if dtype == torch.float32 and (k8a := i8avx2.kernel()) is not None:
        fast += [I8AVX2Path(k8a), I8AVX2Path(k8a, "i8avx2-panel", "panel")]
        fast += [I8AVX2SiluPath(k8a), I8AVX2SiluPath(k8a, "i8avx2-panel-silu-mul", "panel")]
        if (plain8 := i8avx2.kernel_without_prefetch()) is not None:  # its prefetch distance was set on one CPU
            fast.append(I8AVX2Path(plain8, "i8avx2-noprefetch"))
            fast.append(I8AVX2SiluPath(plain8, "i8avx2-silu-mul-noprefetch"))
    if dtype == torch.float32 and (k4f := w4f32.kernel()) is not None:
        fast += [W4F32Path(k4f, "direct"), W4F32Path(k4f, "panel")]
        fast += [W4F32SiluPath(k4f, entry) for entry in W4F32_SILU_ENTRIES]
        if (k4y := w4f32.ymm_kernel()) is not None:  # an AVX-512 CPU: the 8-wide tiles timed beside the 16-wide
            fast += [W4F32Path(k4y, "direct", "-ymm"), W4F32Path(k4y, "panel", "-ymm")]
            fast += [W4F32SiluPath(k4y, entry, "-ymm") for entry in W4F32_SILU_ENTRIES]
    return [*(p for p in fast if p.available), QuantReferencePath()]  # type: ignore[list-item]
