"""The W4A16 kernel on AMX tiles (engine.kernels.w4amx), compiled here with gcc: both entry points equal the float32
dequantize-then-matmul reference within bf16 rounding over w4mm's packed weight (the same copy), at the row counts
where its tiles change shape, its fused gated-MLP entries equal the unfused ones followed by torch's act, and its
paths plug into the engine's measured selection. Needs AMX: skipped on other CPUs, where w4mm and torch's int4 GEMM
run W4A16 layers (tests/unit/test_w4mm.py)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import amxmm, w4amx, w4mm
from engine.kernels.select import _matches_reference
from engine.kernels.w4amx import W4AMX
from engine.kernels.w4mm import W4MM, PackedInt4
from engine.layers.activation import ActAndMul
from engine.quant.paths import W4AMXPath, W4AMXSiluPath, W4MMPath, W4MMSiluPath, quant_paths
from tests.int4_kernels import (
    assert_the_fused_entry_equals_the_unfused_then_torchs_act,
    assert_the_selection_keeps_the_fastest_entry,
    int4_weight,
    packed_copies,
)

pytestmark = pytest.mark.skipif(not amxmm.supported(), reason="this CPU has no AMX")
ENTRIES = ("amx", "amx-dequant")


@pytest.fixture(scope="module")
def kernel() -> W4AMX:
    k = w4amx.kernel()
    assert k is not None, "the AMX W4A16 kernel did not build or failed its self-check (see the warning)"
    return k


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(
    ("n", "k", "g", "symmetric"),
    [(96, 256, 128, False), (130, 96, 32, True), (64, 64, 64, False), (70, 512, 256, False)],
)
def test_both_entry_points_equal_the_reference(
    kernel: W4AMX, entry: str, n: int, k: int, g: int, symmetric: bool
) -> None:
    w = int4_weight(n, k, g, symmetric)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = W4MM.pack(w.values(), w.scale, w.zero, g)
    fn = getattr(kernel, entry.replace("-", "_"))
    # one tile row, a full 16-row slice, one into the second, 32 and past it, more than a 192-row pass
    for rows in (1, 15, 16, 17, 32, 33, 200):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        want = w.reference(x, bias.float())
        got = fn(x, packed, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("entry", ENTRIES)
def test_the_paths_match_the_reference_as_the_selector_checks_it(kernel: W4AMX, entry: str) -> None:
    path = W4AMXPath(kernel, entry)
    w = int4_weight(96, 256, 64, symmetric=False)
    assert path.accepts(w, None)
    run = path.prepare(w, None, None)
    for rows in (1, 8, 33):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert _matches_reference(run, x, w, None, None), entry
    assert run(torch.randn(2, 3, 256).bfloat16()).shape == (2, 3, 96)


@pytest.mark.parametrize("entry", ENTRIES)
def test_no_rows_give_no_rows(kernel: W4AMX, entry: str) -> None:
    w = int4_weight(64, 64, 32, symmetric=True)
    packed = W4MM.pack(w.values(), w.scale, w.zero, 32)
    out = getattr(kernel, entry.replace("-", "_"))(torch.empty(0, 64, dtype=torch.bfloat16), packed, None)
    assert out.shape == (0, 64)


def test_groups_that_are_not_whole_tile_steps_are_left_to_w4mm(kernel: W4AMX) -> None:
    assert W4MM.accepts(64, 64, 16) and not W4AMX.accepts(64, 64, 16)  # a tile step is 32 inputs
    assert not W4AMXPath(kernel, "amx").accepts(int4_weight(64, 64, 16, symmetric=True), None)
    assert W4AMXPath(kernel, "amx").accepts(int4_weight(64, 64, 32, symmetric=True), None)


def test_the_amx_and_the_avx512_entry_points_share_one_packed_copy(kernel: W4AMX) -> None:
    k4 = w4mm.kernel()
    assert k4 is not None  # every AMX CPU has AVX512-BF16
    w = int4_weight(64, 128, 32, symmetric=True)
    paths = [W4MMPath(k4, "direct"), W4AMXPath(kernel, "amx"), W4AMXPath(kernel, "amx-dequant")]
    runs = [p.prepare(w, None, None) for p in paths]
    cells = [packed_copies(r, PackedInt4) for r in runs]
    assert cells[0] and cells[0] == cells[1] == cells[2]


def test_the_selection_times_them_among_the_bf16_candidates_and_keeps_the_fastest(kernel: W4AMX) -> None:
    names = [p.name for p in quant_paths(torch.bfloat16)]
    for name in ("w4mm-amx", "w4mm-amx-dequant", "w4mm-amx-noprefetch", "w4mm-amx-dequant-noprefetch"):
        assert name in names
    assert names[-1] == "torch-dequant"
    assert_the_selection_keeps_the_fastest_entry(kernel, W4AMXPath, torch.bfloat16, ENTRIES)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(("n", "k", "g"), [(128, 256, 128), (64, 96, 32), (1024, 128, 64)])
def test_the_fused_gated_mlp_entries_equal_the_unfused_entry_then_torchs_act(
    kernel: W4AMX, entry: str, n: int, k: int, g: int
) -> None:
    """silu(gate) * up out of the epilogue, over the [gate; up] rows interleaved in blocks of 32 (the copy
    w4mm-silu-mul packs): the same tile sums as the unfused entry over the plain copy, so torch's bf16 SiLU and
    product over that entry's output give it, to the last bit of SiLU's rounding."""
    run, run_fused = getattr(kernel, entry.replace("-", "_")), getattr(kernel, f"{entry.replace('-', '_')}_silu_mul")
    # one 16-row slice, two, past a 32-row block
    assert_the_fused_entry_equals_the_unfused_then_torchs_act(run_fused, run, n, k, g, (1, 15, 16, 17, 32, 33, 100))


def test_the_fused_entries_are_timed_candidates_over_w4mm_silu_muls_copy(kernel: W4AMX) -> None:
    names = [p.name for p in quant_paths(torch.bfloat16)]
    for name in ("w4mm-amx-silu-mul", "w4mm-amx-dequant-silu-mul", "w4mm-amx-silu-mul-noprefetch"):
        assert name in names
    k4 = w4mm.kernel()
    assert k4 is not None
    act, w = ActAndMul("silu"), int4_weight(128, 128, 32, symmetric=True)
    amx, avx = W4AMXSiluPath(kernel, "amx-silu-mul"), W4MMSiluPath(k4, "silu-mul")
    assert amx.layout == avx.layout == "w4mm-silu"
    assert amx.accepts(w, act) and not amx.accepts(w, None)  # only where it replaces a SiLU act
    assert not amx.accepts(int4_weight(128, 64, 16, symmetric=True), act)  # a tile step is 32 inputs
    runs = [p.prepare(w, None, act) for p in (amx, avx)]
    cells = [packed_copies(r, PackedInt4) for r in runs]
    assert cells[0] and cells[0] == cells[1]
