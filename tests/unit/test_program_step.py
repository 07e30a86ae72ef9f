"""engine.kernels.program_step and the selection's use of it: the GEMMs that decode programs call are timed at decode
classes as a program makes the calls (a C entry as one op, a path without one as a stop for Python), so a path
with no C entry no longer wins a class by less than what its stop costs the program; what such a step computes
is what the runs compute."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.bind import gemm_paths, plan_linears
from engine.kernels.gemm import Act, EntryRun, GemmPath, KernelRun, Run, WithAct
from engine.kernels.program_step import program_step
from engine.kernels.select import PROGRAM_ROWS, ROWS, GemmSelector
from engine.layers.activation import ActAndMul
from engine.layers.linear import Linear

DTYPE = torch.float32  # wbf16's C entry (float32 rows over bf16 weights) builds on every x86-64 CPU with AVX2


def _c_path() -> GemmPath:
    """A path of this CPU whose prepared runs have a C entry (a decode program calls it)."""
    for p in gemm_paths(DTYPE, 8, True, bf16_weights=True):
        run = p.prepare(torch.randn(64, 32).bfloat16(), None, None)
        if isinstance(run, KernelRun | EntryRun) and run.c_entry() is not None:
            return p
    pytest.fail("no GEMM kernel with a C entry built on this CPU (wbf16 needs AVX2 and gcc)")


def _weight(n: int = 64, k: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_a_program_step_computes_what_its_runs_compute(rows: int) -> None:
    c = _c_path()
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
    act = ActAndMul("silu")
    w = _weight()
    cases: list[tuple[Run, int]] = [
        (c.prepare(w, None, None), 64),  # a C entry
        (lambda t: F.linear(t, w.float()), 64),  # no C entry: a stop for Python
        (WithAct(c.prepare(w, None, None), act), 32),  # a C entry, then the act in torch
    ]
    for run, cols in cases:
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        step = program_step([run], x, outputs)
        assert step is not None, "the program executor did not build"
        step()
        assert torch.equal(outputs[rows, cols], run(x))


def test_runs_of_one_shape_share_the_output_buffers() -> None:
    c = _c_path()
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    x = torch.randn(8, 32)
    for _ in range(3):  # three programs over the same shape
        step = program_step([c.prepare(_weight(seed=s), None, None) for s in range(4)], x, outputs)
        assert step is not None
        step()
    assert list(outputs) == [(8, 64)]


class _SpyPath:
    """A real C path whose Python call says when, and with how many rows, it ran while being timed."""

    def __init__(self, inner: GemmPath, timing: list[bool], calls: list[int]) -> None:
        self.name, self.layout, self.inner, self.timing, self.calls = "spy", "spy", inner, timing, calls

    def accepts(self, weight: torch.Tensor, act: Act | None) -> bool:
        return True

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None, act: Act | None) -> Run:
        run = self.inner.prepare(weight, bias, act)
        assert isinstance(run, KernelRun | EntryRun)

        def call(x: torch.Tensor) -> torch.Tensor:
            if self.timing[0]:
                self.calls.append(x.shape[0])
            return run(x)

        return EntryRun(call, run.c_entry())


def _timed_python_rows(programmed: bool) -> list[int]:
    timing, calls = [False], []

    def timer(fn: Callable[[], object]) -> float:
        timing[0] = True
        fn()
        timing[0] = False
        return 1e-4

    selector = GemmSelector([_SpyPath(_c_path(), timing, calls)], DTYPE, timer=timer)  # type: ignore[list-item]
    selector.paths["other"] = selector.paths["spy"]  # two candidates, so the classes are timed
    selector.choose("64x32", [(_weight(), None)], None, None, programmed)
    return calls


def test_decode_classes_of_programmed_layers_are_timed_through_programs() -> None:
    rows = _timed_python_rows(programmed=True)
    assert rows and all(r > PROGRAM_ROWS for r in rows)  # only the prefill class from Python
    assert set(_timed_python_rows(programmed=False)) == set(ROWS)  # every class from Python


class _TwoLayers(nn.Module):
    def __init__(self, programmed: bool) -> None:
        super().__init__()
        self.a, self.b = Linear(32, 64, False), Linear(32, 64, False)
        for lin in (self.a, self.b):
            lin.weight.data = _weight()
        self.programmed = programmed

    def programmed_linears(self) -> list[nn.Module]:
        return [self.a] if self.programmed else []


def test_programmed_layers_are_keyed_apart_from_the_same_shape_run_from_python() -> None:
    seen: list[tuple[str, bool]] = []

    class Recording(GemmSelector):
        def choose(self, shape, samples, act, max_rows=None, programmed=False):  # type: ignore[no-untyped-def]
            seen.append((shape, programmed))
            return super().choose(shape, samples, act, max_rows, programmed)

    paths = gemm_paths(DTYPE, 8, True, bf16_weights=True)
    plan_linears(_TwoLayers(True), Recording(paths, DTYPE, timer=lambda fn: (fn(), 1e-4)[1]))
    assert sorted(seen) == [("64x32 bfloat16", False), ("64x32 bfloat16 program", True)]
    seen.clear()
    plan_linears(_TwoLayers(False), Recording(paths, DTYPE, timer=lambda fn: (fn(), 1e-4)[1]))
    assert seen == [("64x32 bfloat16", False)]
