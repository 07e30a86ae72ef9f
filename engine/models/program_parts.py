"""The pieces decode programs (engine.kernels.program) are built from, shared by the model families' builders
(engine.models.llama_program, engine.models.deepseek_program): a linear layer's GEMM as its plan runs it at a batch
class (its kernel's C entry, or the plan itself called from Python between two C calls), a norm's C entry, and a
gated MLP's two GEMMs with its act."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels import program
from engine.kernels.decode_attn import DECODE_ROWS
from engine.kernels.gemm import Act, CEntry, EntryRun, KernelRun, WithAct
from engine.kernels.pointwise import PointwiseKernels
from engine.kernels.program import INPUT, Program, ProgramBuilder, Step, address
from engine.kernels.select import row_class
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm


@dataclass(frozen=True, slots=True)
class Gemm:
    entry: CEntry  # how the program makes the kernel's call
    act: Act | None  # a gated MLP's act, run in torch after the GEMM (a path that does not fuse it)

    @property
    def cols(self) -> int:
        return self.entry.cols


def _c_gemm(plan: object, cls: int, dtype: torch.dtype) -> Gemm | None:
    """The run a GemmPlan makes at batch class `cls`, where that is a C kernel over `dtype` activations (then,
    perhaps, a gated MLP's act in torch)."""
    runs = getattr(plan, "runs", None)
    if runs is None:
        return None
    run, act = runs[cls], None
    if isinstance(run, WithAct):
        run, act = run.run, run.act
    entry = run.c_entry() if isinstance(run, KernelRun | EntryRun) else None
    entry = entry.of(dtype) if entry is not None else None
    if entry is None:
        return None
    return Gemm(entry, act)


@dataclass(frozen=True, slots=True)
class Hooked:
    """A GEMM whose plan chose a path with no C entry at this class, or transforms its inputs first: the program
    calls the plan from Python."""

    plan: Callable[[torch.Tensor], torch.Tensor]
    cols: int
    act: None = None  # the plan computes the whole output (a gated MLP's plan includes its act)


def part(plan: object, cls: int, dtype: torch.dtype, cols: int) -> Gemm | Hooked | None:
    """The GEMM as the program runs it: its C entry, or the plan itself called between two C calls (`cols`: the
    plan's output columns); None where the layer has no plan (it runs F.linear). A plan that transforms its inputs
    first (`pre`: an online rotation) is always called whole: its kernel alone would skip that."""
    if getattr(plan, "pre", None) is None and (gemm := _c_gemm(plan, cls, dtype)) is not None:
        return gemm
    return Hooked(plan, cols) if callable(plan) and getattr(plan, "runs", None) is not None else None


def emit(b: ProgramBuilder, gemm: Gemm | Hooked, k: int, inp: torch.Tensor, out: torch.Tensor) -> None:
    """out = inp (K columns) through `gemm`: its C call, or its plan from Python between two C calls."""
    if isinstance(gemm, Gemm):
        gemm.entry.emit(b, k, inp.data_ptr(), out.data_ptr())
        b.keep += gemm.entry.keep
    else:
        b.python(_plan_hook(gemm.plan, inp, out))


def _plan_hook(
    plan: Callable[[torch.Tensor], torch.Tensor], inp: torch.Tensor, out: torch.Tensor
) -> Callable[[int], object]:
    return lambda rows: out[:rows].copy_(plan(inp[:rows]))


def norm_entry(norm: RMSNorm, dtype: torch.dtype) -> int | None:
    """The C entry of the norm's kernel where the layer runs it over `dtype` rows, else None (it runs in torch)."""
    k, w = norm.kernel, norm.weight
    fn = k.norm_entry(dtype) if isinstance(k, PointwiseKernels) and w.dtype == dtype and w.is_contiguous() else None
    return address(fn) if fn is not None else None


def act_hook(act: Act, gate_up: torch.Tensor, out: torch.Tensor) -> Callable[[int], object]:
    """The layers' own act over [gate | up] rows, as Python between two C calls."""
    return lambda rows: out[:rows].copy_(act(gate_up[:rows]))


def gated_mlp(
    b: ProgramBuilder, mlp: GatedMLP, cls: int, dtype: torch.dtype, buffer: Callable[[str, int], torch.Tensor],
    inp: torch.Tensor, out: torch.Tensor,
) -> str | None:  # fmt: skip
    """`out` = the gated MLP of `inp` (down(act(gate/up))), through the fused SiLU entry where the plan chose it,
    or the plain GEMM and then the layers' own act in torch between two C calls: the same bits as the layers.
    `buffer(name, cols)`: a [rows, cols] buffer of the program's. None, or why the MLP has no program here."""
    hidden, inter = mlp.gate_up_proj.in_features, mlp.down_proj.in_features
    gate_up = part(mlp.gate_up_act, cls, dtype, inter)
    down = part(mlp.down_proj.plan, cls, dtype, mlp.down_proj.out_features)
    if gate_up is None or down is None:
        return f"the {'gate/up' if gate_up is None else 'down'} GEMM has no C kernel here (the layer runs it in torch)"
    if down.act is not None or down.cols != hidden or gate_up.cols != (inter if gate_up.act is None else 2 * inter):
        return "a gated MLP's shapes are not the plain layout"
    act = buffer("act", inter)
    if gate_up.act is None:  # the fused entry (or the plan) writes silu(gate) * up itself
        emit(b, gate_up, hidden, inp, act)
    else:  # [gate | up], then the layers' own act in torch between two C calls: the same bits as the layers
        gu = buffer("gate_up", gate_up.cols)
        emit(b, gate_up, hidden, inp, gu)
        b.python(act_hook(gate_up.act, gu, act))
    emit(b, down, inter, act, out)
    return None


class Frame:
    """What every decoder program has: the [width, hidden] buffers a layer reads and writes, the residual stream
    through the pre-norms (the first layer reads the step's input, and has no residual before its first norm),
    and buffers the layers share by name (they run one after another, so one stays in cache)."""

    def __init__(self, decoder: nn.Module, width: int, dtype: torch.dtype) -> None:
        self.b, self.width, self.dtype = ProgramBuilder(), width, dtype
        self.hidden = decoder.norm.weight.shape[0]
        self.esize = torch.empty(0, dtype=dtype).element_size()
        self._buffers: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self.norm_out, self.residual, self.x_buf, self.o_buf = (self.buffer(n, self.hidden) for n in "nrxo")
        self.x: int | Step = INPUT  # layer 0 reads the embeddings where the step put them
        self.res: int | Step | None = None  # no residual before the first norm

    def buffer(self, name: str, *cols: int, dtype: torch.dtype | None = None, rows: int | None = None) -> torch.Tensor:
        """The [rows (the class's width), *cols] buffer `name` every layer shares."""
        key = (name, (rows or self.width, *cols), dtype or self.dtype)
        if key not in self._buffers:
            self._buffers[key] = self.b.buffer(*key[1], dtype=key[2])
        return self._buffers[key]

    def pre_norm(self, norm: RMSNorm, fn: int) -> None:
        """norm_out = norm(x + residual); the residual becomes that sum (the first layer's: its input)."""
        self.b.norm(fn, self.hidden, self.x, self.res, norm.weight.data_ptr(), norm.eps, self.norm_out.data_ptr(),
                    self.res)  # fmt: skip
        self.res = self.x if self.res is None else self.res

    def post_norm(self, norm: RMSNorm, fn: int) -> None:
        """norm_out = norm(o + residual) over the attention's output in o_buf; the sum lands in the program's own
        residual buffer (the first layer's came from the step's input)."""
        ptr = self.residual.data_ptr()
        self.b.norm(fn, self.hidden, self.o_buf.data_ptr(), self.res, norm.weight.data_ptr(), norm.eps,
                    self.norm_out.data_ptr(), ptr)  # fmt: skip
        self.res = ptr

    def layer_done(self) -> None:
        """The MLP wrote the layer's output to x_buf: the next layer reads it."""
        self.x = self.x_buf.data_ptr()

    def finish(self, lib: object, norm: RMSNorm, fn: int) -> Program:
        """The final norm, then the program; its output is norm_out."""
        self.b.norm(fn, self.hidden, self.x, self.res, norm.weight.data_ptr(), norm.eps, self.norm_out.data_ptr(),
                    self.residual.data_ptr())  # fmt: skip
        return self.b.build(lib, self.norm_out)  # type: ignore[arg-type]


def start(model: nn.Module, rows: int) -> tuple[object, Frame, int, int] | str:
    """(the executor, a frame, the batch class, the final norm's C entry) for a program of `rows`' class, or why
    none is built."""
    lib = program.library()
    decoder = model.model  # type: ignore[attr-defined]
    dtype, cls = decoder.norm.weight.dtype, row_class(rows)
    if lib is None:
        return "the program executor did not build"
    if dtype not in (torch.bfloat16, torch.float32) or model.group.size != 1 or cls >= len(DECODE_ROWS):  # type: ignore[attr-defined]
        return "programs are built for bf16 or float32 math on one rank, up to 128 rows"
    final = norm_entry(decoder.norm, dtype)
    if final is None:
        return "the final RMSNorm runs in torch"
    return lib, Frame(decoder, DECODE_ROWS[cls], dtype), cls, final
