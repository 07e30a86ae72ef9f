"""The ways a linear layer can run on CPU, each behind one interface, so the engine can time them and keep the
fastest (engine.kernels.select): F.linear, oneDNN's prepacked GEMM (AMX where the CPU has it), and our own
kernels (engine.kernels.bf16mm, engine.kernels.wbf16), including the gated-MLP GEMM whose epilogue applies
silu(gate) * up."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.kernels.cbuild import SelfCheckError
from engine.kernels.program import ProgramBuilder, address

log = logging.getLogger(__name__)

Act = Callable[[torch.Tensor], torch.Tensor]  # a gated MLP's act(gate) * up over [..., 2I] → [..., I]
Run = Callable[[torch.Tensor], torch.Tensor]


class GemmKernel(Protocol):
    """What a compiled GEMM kernel offers (engine.kernels.wbf16, engine.kernels.bf16mm)."""

    def accepts(self, weight: torch.Tensor) -> bool:
        """Whether this weight can go to the kernel without changing results."""
        ...

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] weight → the kernel's own layout."""
        ...

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] → x W^T + b, [..., N]."""
        ...


class GemmPath(Protocol):
    """One way to compute a linear layer: `prepare` packs the weight once and returns the function to call.

    With `act` (a gated MLP's merged [gate | up] projection) the function returns act(x W^T + b). Paths that
    share one packed copy of a weight may say so by a common `layout` attribute (the selection then counts them
    as one layout held in memory; "" for a path that keeps no copy); without it a path is its own layout."""

    name: str

    def accepts(self, weight: torch.Tensor, act: Act | None) -> bool: ...

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None, act: Act | None) -> Run: ...


def with_act(run: Run, act: Act | None) -> Run:
    """`run`, then a gated MLP's act on its output where there is one (a path that does not fuse it)."""
    return run if act is None else WithAct(run, act)


class WithAct:
    """act(run(x)): a GEMM, then the gated MLP's act in torch (a decode program calls the two apart)."""

    __slots__ = ("act", "run")

    def __init__(self, run: Run, act: Act) -> None:
        self.run, self.act = run, act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.run(x))


class TorchPath:
    """F.linear on the plain weight: what transformers runs."""

    name = "torch"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def accepts(self, weight: torch.Tensor, act: Act | None) -> bool:
        return True

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None, act: Act | None) -> Run:
        w = weight.to(self.dtype)  # a bf16-stored weight under float32 math widens (exactly)
        b = bias.to(self.dtype) if bias is not None else None
        return with_act(lambda x: F.linear(x, w, b), act)


class OneDNNPath:
    """oneDNN's GEMM on a weight reordered once into its blocked layout (torch's private mkldnn ops, which
    inductor's freezing also uses); AMX tiles on CPUs that have them."""

    name = "onednn"

    def __init__(self, dtype: torch.dtype, batch_hint: int) -> None:
        self.dtype, self.batch_hint = dtype, batch_hint
        self.available = self._probe()

    def _probe(self) -> bool:
        try:
            w = torch.ones(8, 8, dtype=self.dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8, dtype=self.dtype), packed, None, "none", [], "")
        except (AttributeError, RuntimeError) as e:  # private ops: missing or unsupported on this CPU
            log.debug("oneDNN prepacking unavailable (%s)", e)
            return False
        return True

    def accepts(self, weight: torch.Tensor, act: Act | None) -> bool:
        return self.available

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None, act: Act | None) -> Run:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.dtype), self.batch_hint)
        b = bias.to(self.dtype) if bias is not None else None
        linear, (n, k) = torch.ops.mkldnn._linear_pointwise, weight.shape

        def run(x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // k
            padded = bucket_rows(rows)
            if padded == rows:
                return linear(x, packed, b, "none", [], "")
            xp = x.new_empty(padded, k)  # NOTE: oneDNN compiles a kernel for every new row count (5-15 ms)
            xp[:rows].copy_(x.reshape(rows, k))
            xp[rows:].zero_()
            return linear(xp, packed, b, "none", [], "")[:rows].view(*x.shape[:-1], n)

        return with_act(run, act)


def bucket_rows(rows: int) -> int:
    """Row counts past a decode batch, rounded up to one of four sizes per power of two (at most 25% padding):
    oneDNN's first call at a new shape spends milliseconds compiling, and prefill chunks and MoE experts see a
    new row count at nearly every call."""
    if rows <= 32:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def packed_once(cache: dict[Any, Any], key: object, owner: torch.Tensor, pack: Callable[[], Any]) -> Any:
    """A weight's packed copy from `cache`, made by `pack` on first use and dropped when `owner` (the tensor the
    copy was made from) dies; keyed by ids (a tensor cannot key a WeakKeyDictionary: its == is elementwise). Paths
    over one layout (the builds of a kernel with and without prefetch) take one copy this way."""
    packed = cache.get(key)
    if packed is None:
        packed = cache[key] = pack()
        weakref.finalize(owner, cache.pop, key, None)
    return packed


_PACKED: dict[tuple[str, int], torch.Tensor] = {}  # (layout, the weight's id) → that layout's packed copy


class KernelPath:
    """One of our compiled kernels, for the weights and math it is written for. `layout`: the name of its packed
    copy, shared with the other builds of the same kernel (default: its own name)."""

    def __init__(self, name: str, kernel: GemmKernel, dtype: torch.dtype, layout: str = "") -> None:
        self.name, self.kernel, self.dtype, self.layout = name, kernel, dtype, layout or name

    def accepts(self, weight: torch.Tensor, act: Act | None) -> bool:
        return self.kernel.accepts(weight)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None, act: Act | None) -> Run:
        packed = packed_once(_PACKED, (self.layout, id(weight)), weight, lambda: self.kernel.pack(weight))
        b = bias.to(self.dtype) if bias is not None else None
        return with_act(KernelRun(self.kernel, packed, weight.shape[0], b), act)


class FusedSiluPath:
    """A kernel's gated-MLP GEMM (bf16mm's, amxmm's): silu(gate) * up comes out of the epilogue (no [T, 2I]
    intermediate). Only for SiLU MLPs, whose act it replaces. `layout` as KernelPath's."""

    def __init__(self, kernel: GemmKernel, name: str = "bf16mm-silu", layout: str = "") -> None:
        self.kernel, self.name, self.layout = kernel, name, layout or name

    def accepts(self, weight: torch.Tensor, act: Act | None) -> bool:
        return getattr(act, "is_silu_and_mul", False) and self.kernel.accepts(weight)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None, act: Act | None) -> Run:
        packed = packed_once(_PACKED, (self.layout, id(weight)), weight, lambda: self.kernel.pack(weight))
        return KernelRun(self.kernel, packed, weight.shape[0], bias)


@dataclass(frozen=True, slots=True)
class CEntry:
    """How a decode program (engine.kernels.program) makes a prepared GEMM's call itself: `emit(builder, K, x, y)`
    adds the kernel's own C call, rows of `dtype` in and `cols` columns of it out; `keep`: what it points to;
    `retyped`: where the same C function also takes rows of another type (i8mm's linear entry: bf16 or float32),
    the entry for that type, or None."""

    cols: int
    dtype: torch.dtype
    emit: Callable[[ProgramBuilder, int, int, int], None]
    keep: tuple[torch.Tensor, ...] = ()
    retyped: Callable[[torch.dtype], CEntry | None] | None = None

    def of(self, dtype: torch.dtype) -> CEntry | None:
        """This entry over rows of `dtype`, or None where it takes none."""
        if dtype == self.dtype:
            return self
        return self.retyped(dtype) if self.retyped is not None else None


def gemm_entry(
    fn: Any, n: int, cols: int, packed: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> CEntry:
    """The entry of a kernel that takes run_bf16's arguments (M, N, K, x, packed, bias, y, threads)."""
    b = bias.data_ptr() if bias is not None else None

    def emit(builder: ProgramBuilder, k: int, x: int, y: int) -> None:
        builder.gemm(address(fn), n, k, x, packed.data_ptr(), b, y)

    return CEntry(cols, dtype, emit, (packed,) if bias is None else (packed, bias))


class EntryRun:
    """A prepared call of any path, with the C entry a decode program makes instead (None: it has none)."""

    __slots__ = ("call", "entry")

    def __init__(self, call: Run, entry: CEntry | None) -> None:
        self.call, self.entry = call, entry

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x)

    def c_entry(self) -> CEntry | None:
        return self.entry


class KernelRun:
    """A prepared call of a compiled kernel: x → kernel.linear(x, packed, n, bias). A decode program
    (engine.kernels.program) reads its parts to call the kernel's entry point itself."""

    __slots__ = ("bias", "kernel", "n", "packed")

    def __init__(self, kernel: GemmKernel, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> None:
        self.kernel, self.packed, self.n, self.bias = kernel, packed, n, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.linear(x, self.packed, self.n, self.bias)

    def c_entry(self) -> CEntry | None:
        """The kernel's C entry for this call (CEntry), where it has one."""
        entry = getattr(self.kernel, "c_entry", None)
        return entry(self.n, self.bias, self.packed) if entry is not None else None


def check_bf16_gemm(kernel: GemmKernel, shapes: tuple[tuple[int, int, int], ...]) -> None:
    """A bf16 kernel against float32 math rounded to bf16 on (m, n, k) `shapes`, with a bias; SelfCheckError
    if it differs by more than bf16 rounding."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in shapes:
        w, x, b = (torch.randn(*s, generator=g).bfloat16() for s in ((n, k), (m, k), (n,)))
        got = kernel.linear(x, kernel.pack(w), n, b).float()
        want = torch.addmm(b.float(), x.float(), w.float().t())
        if not torch.allclose(got, want, rtol=1e-2, atol=1e-2):
            raise SelfCheckError(f"self-check failed at {m}x{n}x{k}: max error {(got - want).abs().max().item():.3g}")


def check_silu_mul(kernel: GemmKernel, shapes: tuple[tuple[int, int, int], ...]) -> None:
    """A fused silu(gate) * up kernel against the unfused bf16 torch code (the projection rounded to bf16, then
    SiLU and the product in bf16) on (m, 2I, k) `shapes`, with a bias; SelfCheckError past bf16 rounding."""
    g = torch.Generator().manual_seed(1)
    for m, n, k in shapes:
        w, x, b = (torch.randn(*s, generator=g).bfloat16() for s in ((n, k), (m, k), (n,)))
        gate, up = torch.addmm(b.float(), x.float(), w.float().t()).bfloat16().chunk(2, dim=-1)
        want = (F.silu(gate) * up).float()
        got = kernel.linear(x, kernel.pack(w), n, b).float()
        if got.shape != want.shape or not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
            raise SelfCheckError(f"fused SiLU self-check failed at {m}x{n}x{k}")


def run_bf16(
    fn: Callable[..., None], x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None, out_cols: int
) -> torch.Tensor:
    """One of a bf16 kernel's entry points (bf16mm.c, amxmm.c: M, N, K, x, packed, bias, y, threads) over
    x [..., K] → [..., out_cols] bf16."""
    k = x.shape[-1]
    # NOTE: each torch call here costs about a microsecond, a GEMM call of decode a few tens: at a 30-layer
    # model's 120 calls a step, the conversions are only made where they change something
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.dtype != torch.bfloat16 or not x2.is_contiguous():
        x2 = x2.to(torch.bfloat16).contiguous()
    y = torch.empty(x2.shape[0], out_cols, dtype=torch.bfloat16)
    b = bias
    if b is not None and (b.dtype != torch.bfloat16 or not b.is_contiguous()):
        b = b.to(torch.bfloat16).contiguous()  # held until the call returns
    fn(
        x2.shape[0], n, k, x2.data_ptr(), packed.data_ptr(), b.data_ptr() if b is not None else None,
        y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return y if x.dim() == 2 else y.view(*x.shape[:-1], out_cols)


def interleave_halves(t: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows (2I, ...) → blocks of 32 alternating: gate 0-31, up 0-31, gate 32-63, up 32-63, ..."""
    i = t.shape[0] // 2
    return t.reshape(2, i // 32, 32, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


class SiluMulKernel:
    """A gated MLP's merged [gate | up] projection through a bf16 kernel's fused entry point `fn`, whose result
    is silu(gate) * up, [..., I], with the roundings of the unfused bf16 torch code. The weight's rows are
    interleaved in blocks of 32 (interleave_halves), so I must be a multiple of 32."""

    dtype = torch.bfloat16  # the activations' (a float32 kernel's subclass says so)

    def __init__(self, base: GemmKernel, fn: Callable[..., None]) -> None:
        self.base, self.fn = base, fn

    def accepts(self, weight: torch.Tensor) -> bool:
        return self.base.accepts(weight) and weight.shape[0] % 64 == 0  # whole 32-row gate/up halves

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return self.base.pack(interleave_halves(weight))

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] → silu(x Wg^T + bg) * (x Wu^T + bu), [..., n / 2]."""
        b = interleave_halves(bias) if bias is not None else None
        return run_bf16(self.fn, x, packed, n, b, n // 2)

    def c_entry(self, n: int, bias: torch.Tensor | None, packed: torch.Tensor) -> CEntry:
        """KernelRun.c_entry: the fused entry point, n / 2 columns out, the bias interleaved as its rows are."""
        b = interleave_halves(bias).to(self.dtype).contiguous() if bias is not None else None
        return gemm_entry(self.fn, n, n // 2, packed, b, self.dtype)
