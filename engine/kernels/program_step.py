"""A GEMM path's calls made the way a decode program makes them, for the selection to time (engine.kernels.select).

In a decode program (engine.models.llama_program) a path with a C entry point is one op of the program's loop,
with no Python around it, while a path without one (oneDNN, torch's int4 GEMM) stops the program for a Python call
that copies its result into the program's buffer. Timed from Python, each path pays Python's cost per call, so a
path with no C entry could win a decode class by less than what the stop costs it in the program: Qwen2-0.5B's
W4A16 O projection at one row went to torch's int4 GEMM by 7% (55 against 59 us, a 2-core AMX Xeon), and every
decode step then stopped its program 24 times. Timed here as one-op programs (or a program that stops for the
path), the paths compete on what a program's step spends on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.kernels import program
from engine.kernels.gemm import Act, EntryRun, KernelRun, Run, WithAct
from engine.kernels.program import ProgramBuilder


def program_step(
    runs: Sequence[Run], x: torch.Tensor, outputs: dict[tuple[int, int], torch.Tensor]
) -> Callable[[], None] | None:
    """A call of every prepared run over `x` (the selector's samples of one shape) as one program, each run as a
    decode program makes it: its C entry, or a stop for the Python call (and a gated MLP's act in torch after a
    C entry that does not fuse it). `outputs`: the buffers the runs write, by shape, shared with the caller's
    other programs (nothing reads them; a buffer per path and sample took hundreds of MB at 128 rows). None
    where the program executor did not build."""
    lib = program.library()
    if lib is None:
        return None
    x = x.contiguous()
    rows, k = x.shape

    def output(cols: int) -> torch.Tensor:
        if (rows, cols) not in outputs:
            outputs[rows, cols] = torch.empty(rows, cols, dtype=x.dtype)
        return outputs[rows, cols]

    b = ProgramBuilder()
    b.keep.append(x)
    out = x
    for run in runs:
        inner, act = (run.run, run.act) if isinstance(run, WithAct) else (run, None)
        entry = inner.c_entry() if isinstance(inner, KernelRun | EntryRun) else None
        entry = entry.of(x.dtype) if entry is not None else None
        if entry is None:
            out = output(run(x).shape[-1])
            b.python(_hook(run, x, out))
            continue
        out = output(entry.cols)
        entry.emit(b, k, x.data_ptr(), out.data_ptr())
        b.keep += [*entry.keep, out]
        if act is not None:
            done = output(run(x).shape[-1])
            b.python(_act_hook(act, out, done))
            out = done
    built = b.build(lib, out)
    values = program.timing_step(rows, x.data_ptr())
    return lambda: built(values)


def _hook(run: Run, x: torch.Tensor, out: torch.Tensor) -> Callable[[int], object]:
    return lambda rows: out[:rows].copy_(run(x[:rows]))


def _act_hook(act: Act, y: torch.Tensor, out: torch.Tensor) -> Callable[[int], object]:
    return lambda rows: out[:rows].copy_(act(y[:rows]))
