"""What the tests of our int4 kernels (w4mm for bf16 math, w4f32 for float32, and w4fp16 / w4vnni over w4mm's packed
weight) share: a random weight, the check that the measured selection keeps whichever of a kernel's entry points
times fastest, and the checks every kernel over w4mm's copy passes (its path, its fused gated-MLP entry)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels import w4mm
from engine.kernels.gemm import interleave_halves
from engine.kernels.select import GemmSelector, _matches_reference
from engine.kernels.w4mm import PackedInt4
from engine.quant.paths import W4MMPath, interleaved, quant_paths
from engine.quant.weights import Int4Weight, pack_nibbles


def int4_weight(n: int, k: int, g: int, symmetric: bool, seed: int = 0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), generator=gen)
    zero = torch.full((n, k // g), 8) if symmetric else torch.randint(0, 16, (n, k // g), generator=gen)
    scale = torch.rand(n, k // g, generator=gen) * 0.05 + 1e-3
    return Int4Weight(pack_nibbles(values), scale, zero.to(torch.uint8), g)


def bf16_scaled(n: int, k: int, g: int, symmetric: bool, seed: int = 0) -> Int4Weight:
    """int4_weight with scales of bf16 values, as a bf16 checkpoint's are (the compact scales' layout takes them)."""
    w = int4_weight(n, k, g, symmetric, seed)
    return Int4Weight(w.packed, w.scale.bfloat16().float(), w.zero, g)


def layout_builds(module: Any) -> tuple[Any, Any]:
    """A W4A16 kernel module's builds for the float scales and the compact ones (w4_builds), both required to
    build and pass their self-checks."""
    plain, compact = module.kernel(), module.kernel(compact=True)
    assert plain is not None and compact is not None, f"a {module.__name__} build failed its self-check (see the log)"
    assert not plain.compact and compact.compact
    return plain, compact


def packed_copies(run: Any, kind: type) -> set[int]:
    """The ids of the packed copies (instances of `kind`: any kernel's, int8 ones too) a prepared run's call closes
    over: paths over one layout must share one copy of a weight."""
    return {id(c.cell_contents) for c in run.call.__closure__ or () if isinstance(c.cell_contents, kind)}


class _Spy:
    """A kernel whose entry points say when they ran."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.calls = kernel, []

    def __getattr__(self, method: str) -> Any:
        def call(*args):  # type: ignore[no-untyped-def]
            self.calls.append(method)
            return getattr(self.kernel, method)(*args)

        return call


def assert_the_selection_keeps_the_fastest_entry(
    kernel: Any, path_class: type, dtype: torch.dtype, entries: tuple[str, ...] = ("direct", "panel")
) -> None:
    """Among the other quantized candidates for `dtype`, a timer that makes one entry point fast gets it chosen
    for every batch class."""
    spy = _Spy(kernel)
    ours = [path_class(spy, e) for e in entries]
    paths = [p for p in quant_paths(dtype) if not p.name.startswith(path_class.prefix)] + ours

    def fast(entry: str):  # type: ignore[no-untyped-def]
        def timer(fn) -> float:  # type: ignore[no-untyped-def]
            spy.calls.clear()
            fn()
            return 1e-6 if spy.calls == [entry.replace("-", "_")] else 1e-3

        return timer

    w = int4_weight(96, 256, 64, symmetric=False)
    for entry, path in zip(entries, ours, strict=True):
        choice = GemmSelector(paths, dtype, timer=fast(entry)).choose(entry, [(w, None)], None)  # type: ignore[list-item]
        assert choice.per_class == [path.name] * 5


def assert_the_path_checks_and_shares_w4mms_copy(path: Any, name: str) -> None:
    """A kernel's path over w4mm's packed weight (w4fp16's, w4vnni's): its name and layout, the selector's
    reference check at decode and batch rows, any leading shape, the very packed copy w4mm's direct path holds,
    and an entry a decode program calls."""
    assert path.name == name and path.layout == "w4mm"
    w = int4_weight(96, 256, 64, symmetric=False)
    run = path.prepare(w, None, None)
    for rows in (1, 8, 33):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert _matches_reference(run, x, w, None, None)
    assert run(torch.randn(2, 3, 256).bfloat16()).shape == (2, 3, 96)
    k4 = w4mm.kernel()
    assert k4 is not None  # every CPU these kernels build on has AVX512-BF16
    runs = [path.prepare(w, None, None), W4MMPath(k4, "direct").prepare(w, None, None)]
    cells = [packed_copies(r, PackedInt4) for r in runs]
    assert cells[0] and cells[0] == cells[1]
    entry = path._entry(path.kernel, W4MMPath.pack(w), None, 1)
    assert entry is not None and entry.cols == 96 and entry.dtype == torch.bfloat16  # a decode program calls it


def assert_the_fused_entry_equals_the_unfused_then_torchs_act(
    fused: Any, plain: Any, n: int, k: int, g: int, rows_tried: tuple[int, ...] = (1, 2, 3, 4, 33)
) -> None:  # fmt: skip
    """silu(gate) * up out of an epilogue (`fused`, over the [gate; up] rows interleaved in blocks of 32: the copy
    w4mm-silu-mul packs) against the unfused entry (`plain`) over the plain copy, then torch's bf16 SiLU and
    product."""
    w = int4_weight(n, k, g, symmetric=False)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).bfloat16()
    packed, packed_fused = W4MMPath.pack(w), W4MMPath.pack(interleaved(w))
    for rows in rows_tried:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = fused(x, packed_fused, interleave_halves(bias))
        gate, up = plain(x, packed, bias).chunk(2, dim=-1)
        want = F.silu(gate) * up
        assert got.shape == (rows, n // 2) and got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), want.float(), rtol=1 / 64, atol=1e-3 * want.float().abs().max().item())
