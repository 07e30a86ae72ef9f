"""Decode steps through a program (engine.kernels.program) or through the layers, whichever measured faster.

A program runs the same kernels with the same arguments as the layers do, so the two give the same bits; which
is faster is measured here, per decode batch class, on the steps the engine serves: the first steps of a class
alternate between the two ways and the faster median wins (logged once). `mode` forces one way for debugging
and tests ("program" still falls back to the layers where no program can be built).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.config import DECODE_PROGRAM_MODES
from engine.context import AttentionContext, get_context
from engine.kernels import program
from engine.kernels.decode_attn import DECODE_ROWS
from engine.kernels.program import Program
from engine.kernels.select import CLASSES, row_class

if TYPE_CHECKING:
    from engine.kernels.kernel_set import CpuKernels

log = logging.getLogger(__name__)

TRIALS = 6  # timed steps of each way per class, after one untimed step each


class _Choice:
    def __init__(self, program: Program | str) -> None:
        self.program = program if isinstance(program, Program) else None
        self.use: bool | None = None if self.program is not None else False  # None: still measuring
        self.times: tuple[list[float], list[float]] = ([], [])  # seconds a step: (layers, program)


class DecodePrograms:
    def __init__(self, build: Callable[[int], Program | str], mode: str = "auto") -> None:
        """`build(rows)`: the program for decode steps of that many rows' class, or why there is none."""
        assert mode in DECODE_PROGRAM_MODES
        self.build, self.mode = build, mode
        self._choices: dict[int, _Choice] = {}

    def forward(
        self, decoder: nn.Module, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """`decoder(input_ids, cos, sin)` → [T, hidden], through a program where one is chosen for this step."""
        ctx = get_context()
        rows = input_ids.shape[0]
        if self.mode == "layers" or not programmable(ctx, rows):
            return decoder(input_ids, cos, sin)
        cls = row_class(rows)
        choice = self._choices.get(cls)
        if choice is None:
            built = self.build(rows)
            choice = self._choices[cls] = _Choice(built)
            if isinstance(built, str):
                log.info("decode steps of %s rows run through the layers: %s", CLASSES[cls], built)
        if choice.program is None or choice.use is False:
            return decoder(input_ids, cos, sin)
        if choice.use or self.mode == "program":
            return _run(choice.program, decoder, input_ids, cos, sin, ctx)
        way = (len(choice.times[0]) + len(choice.times[1])) % 2
        start = time.perf_counter()
        out = _run(choice.program, decoder, input_ids, cos, sin, ctx) if way else decoder(input_ids, cos, sin)
        choice.times[way].append(time.perf_counter() - start)
        if len(choice.times[1]) > TRIALS:
            layers, program = (statistics.median(t[1:]) for t in choice.times)
            choice.use = program < layers
            log.info(
                "decode steps of %s rows: one program call %.2f ms, the layers %.2f ms: %s",
                CLASSES[cls], program * 1e3, layers * 1e3, "the program" if choice.use else "the layers",
            )  # fmt: skip
        return out


def make_programs(model: nn.Module, build: Callable[..., Program | str], kernels: CpuKernels) -> DecodePrograms | None:
    """The model's decode programs (`build(model, rows)`), where the kernels they call are bound; the executor is
    compiled now, not at the first request's decode step."""
    usable = kernels.rms_norm is not None and program.library() is not None
    return DecodePrograms(partial(build, model), kernels.decode_program) if usable else None


def programs_may_run(model: nn.Module) -> bool:
    """Whether a model's decode steps may run as programs: it has them, not forced off, one rank, bf16 or float32
    math (as the builders check)."""
    programs = getattr(model, "programs", None)
    return isinstance(programs, DecodePrograms) and programs_possible(model, programs.mode)


def programs_possible(model: nn.Module, mode: str) -> bool:
    """Whether decode programs may be built for `model` once its kernels are bound (engine.kernels.op_choice then
    binds what a program calls): a family that builds them (it has a `programs` attribute), `mode` (EngineConfig's
    decode_program) not forcing the layers, the executor built, one rank, bf16 or float32 math."""
    if not hasattr(model, "programs") or mode == "layers" or program.library() is None:
        return False
    group, dtype = getattr(model, "group", None), model.model.norm.weight.dtype  # type: ignore[union-attr]
    return getattr(group, "size", 1) == 1 and dtype in (torch.bfloat16, torch.float32)


def programmable(ctx: AttentionContext, rows: int) -> bool:
    """Whether a step of `rows` rows may run as a program: every row attends as a decode row (decodes, and prompt
    chunks short enough to attend in place), at most the largest decode class. Such a step computes every row's
    final state, whichever way it runs (ModelRunner keeps all its rows), so both ways give the same bits."""
    decode_only = not ctx.prefills and ctx.decode_context_lens is not None and ctx.num_decodes == rows
    return decode_only and 0 < rows <= DECODE_ROWS[-1]


def _run(
    program: Program,
    decoder: nn.Module,
    input_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ctx: AttentionContext,
) -> torch.Tensor:
    rows = input_ids.shape[0]
    x = decoder.embed_tokens(input_ids).to(program.output.dtype).contiguous()  # as DecoderModel.forward
    c, s = cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous()
    tables, lens, slots = ctx.decode_block_tables, ctx.decode_context_lens, ctx.slot_mapping
    assert tables is not None and lens is not None
    tables, lens, slots = tables.contiguous(), lens.contiguous(), slots.contiguous()
    assert tables.dtype == lens.dtype == slots.dtype == torch.int64
    program((rows, tables.data_ptr(), tables.shape[1], lens.data_ptr(), slots.data_ptr(), c.data_ptr(),
             s.data_ptr(), torch.get_num_threads(), x.data_ptr()))  # fmt: skip
    return program.output[:rows].clone()  # the buffer is the next step's
