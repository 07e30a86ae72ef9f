"""The float32 W4A16 kernel (engine.kernels.w4f32), compiled here with gcc for this CPU and once with its portable
code: its packed layout holds exactly the weight's nibbles and scales, both entry points equal the float32
dequantize-then-matmul reference, and its GEMM paths plug into the engine's measured selection for float32 math.
Runs on every CPU (AVX2 intrinsics where present, plain C elsewhere)."""

from __future__ import annotations

import platform

import pytest
import torch

from engine.kernels import w4f32
from engine.kernels.cbuild import cpu_flags
from engine.kernels.select import _matches_reference
from engine.kernels.w4f32 import W4F32
from engine.layers.activation import ActAndMul
from engine.quant.paths import W4F32Path, quant_paths
from engine.quant.weights import Int8Weight
from tests.int4_kernels import assert_the_selection_keeps_the_fastest_entry, int4_weight, packed_copies


@pytest.fixture(scope="module", params=["default", "ymm"])
def kernel(request: pytest.FixtureRequest) -> W4F32:
    """The engine's build (16-wide tiles on an AVX-512 CPU), and the 8-wide AVX2 tiles built by hand (the engine
    builds and times them on AVX-512 CPUs only; elsewhere they are the default build's code)."""
    if request.param == "ymm":
        k = W4F32.build(("-march=native", "-DW4F32_YMM"))
        w4f32.self_check(k)
        return k
    k = w4f32.kernel()
    assert k is not None, "the float32 W4A16 kernel did not build or failed its self-check (see the warning)"
    return k


def test_the_packed_layout_holds_each_nibble_and_scale_where_the_kernel_reads_it() -> None:
    w = int4_weight(40, 64, 32, symmetric=False)
    p = W4F32.pack(w.packed, w.scale, w.zero, 32)
    blocks = 2  # 40 columns: one whole block of 32 and a padded one
    words = p.nibbles.view(blocks, 64 // 8, 32)
    v = w.values()
    for col, k in ((0, 0), (1, 1), (17, 2), (31, 63), (32, 62), (39, 61), (5, 7), (6, 56)):
        word = int(words[col // 32, k // 8, col % 32]) & 0xFFFFFFFF
        assert (word >> 4 * (k % 8)) & 15 == int(v[col, k])
    sc = p.scales.view(blocks, 2, 2, 32)  # [block, group, (s, s * z), column]
    assert sc[1, 1, 0, 5] == w.scale[37, 1]
    assert torch.isclose(sc[0, 0, 1, 3], w.scale[3, 0] * w.zero[3, 0].float())
    # the 24 padding columns: zero nibbles and zero scales, so they add nothing
    assert sc[1, :, :, 8:].abs().sum() == 0 and words[1, :, 8:].abs().sum() == 0


@pytest.mark.parametrize("entry", ["direct", "panel"])
@pytest.mark.parametrize(
    ("n", "k", "g", "symmetric"), [(96, 256, 128, False), (130, 96, 32, True), (64, 64, 64, False), (8, 32, 8, False)]
)
def test_both_entry_points_equal_the_reference(
    kernel: W4F32, entry: str, n: int, k: int, g: int, symmetric: bool
) -> None:
    w = int4_weight(n, k, g, symmetric)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    packed = W4F32.pack(w.packed, w.scale, w.zero, g)
    # tiles of 1-2 rows (direct) and 6 (panel); more than 64 rows (a direct pass) and 96 (a panel pass)
    for rows in (1, 2, 3, 4, 7, 33, 65, 200):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = w.reference(x, bias)
        got = getattr(kernel, entry)(x, packed, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("ymm", [False, True])
def test_the_panels_prefetch_changes_no_bits(ymm: bool) -> None:
    """The panel asks for the next group's words (past the last block: beyond the weight, which a prefetch may);
    built without it (-DPANEL_PF=0) it gives the same bits, plain and fused, through every block and group."""
    flags = ("-march=native", *(("-DW4F32_YMM",) if ymm else ()))
    with_pf, without = W4F32.build(flags), W4F32.build((*flags, "-DPANEL_PF=0"))
    w = int4_weight(192, 384, 64, symmetric=False)
    packed = W4F32.pack(w.packed, w.scale, w.zero, 64)
    for rows in (3, 12, 40):
        x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(rows))
        for entry in ("panel", "panel_silu_mul"):
            a, b = getattr(with_pf, entry)(x, packed, None), getattr(without, entry)(x, packed, None)
            assert torch.equal(a, b)
        want = w.reference(x, None)
        assert (with_pf.panel(x, packed, None) - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds the portable code by -march=x86-64")
def test_the_portable_code_passes_the_same_check() -> None:
    """What a CPU without AVX2 (or another ISA) runs: built without the intrinsics, self-checked, and compared."""
    plain = W4F32.build(("-march=x86-64",))
    w4f32.self_check(plain)
    w = int4_weight(70, 128, 32, symmetric=False)
    x = torch.randn(3, 128)
    assert torch.allclose(plain.direct(x, W4F32.pack(w.packed, w.scale, w.zero, 32), None), w.reference(x, None),
                          rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("entry", ["direct", "panel"])
def test_the_paths_match_the_reference_as_the_selector_checks_it(kernel: W4F32, entry: str) -> None:
    path = W4F32Path(kernel, entry)
    w = int4_weight(96, 256, 64, symmetric=False)
    assert path.accepts(w, None)
    assert not path.accepts(Int8Weight(torch.zeros(96, 256, dtype=torch.int8), torch.ones(96)), None)
    assert not path.accepts(torch.zeros(96, 256), None)
    run = path.prepare(w, None, None)
    for rows in (1, 8, 33):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        assert _matches_reference(run, x, w, None, None), entry
    x3 = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(3))
    assert run(x3).shape == (2, 3, 96)
    act = ActAndMul("silu")
    gated = path.prepare(w, None, act)(x3)
    assert torch.allclose(gated, act(w.reference(x3, None)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("entry", ["direct", "panel"])
def test_no_rows_give_no_rows(kernel: W4F32, entry: str) -> None:
    w = int4_weight(64, 64, 32, symmetric=True)
    packed = W4F32.pack(w.packed, w.scale, w.zero, 32)
    assert getattr(kernel, entry)(torch.empty(0, 64), packed, None).shape == (0, 64)


def test_a_group_size_that_does_not_divide_the_inputs_is_refused() -> None:
    assert not W4F32.accepts(64, 96, 64)  # 96 inputs are not whole groups of 64
    assert not W4F32.accepts(64, 12, 3)  # a group is whole pairs of inputs


def test_both_entry_points_share_one_packed_copy(kernel: W4F32) -> None:
    w = int4_weight(64, 128, 32, symmetric=True)
    runs = [W4F32Path(kernel, e).prepare(w, None, None) for e in ("direct", "panel")]
    cells = [packed_copies(r, w4f32.PackedInt4F32) for r in runs]
    assert cells[0] and cells[0] == cells[1]


def test_the_selection_times_them_among_the_float32_candidates_and_keeps_the_fastest(kernel: W4F32) -> None:
    names = [p.name for p in quant_paths(torch.float32)]
    assert "w4f32" in names and "w4f32-panel" in names and names[-1] == "torch-dequant"
    # the 8-wide tiles are candidates of their own only where the default build runs 16-wide ones
    ymm = {"w4f32-ymm", "w4f32-panel-ymm", "w4f32-silu-mul-ymm", "w4f32-panel-silu-mul-ymm"}
    assert (ymm <= set(names)) == ("avx512f" in cpu_flags()) and (ymm & set(names) in (set(), ymm))
    assert "w4f32" not in [p.name for p in quant_paths(torch.bfloat16)]  # float32 math only
    assert_the_selection_keeps_the_fastest_entry(kernel, W4F32Path, torch.float32)
