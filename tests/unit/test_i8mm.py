"""The W8A8 kernel (engine.kernels.i8mm), compiled here with gcc: its packed layout holds exactly the weight, its
activations are quantized exactly as compressed-tensors defines it, its int32 sums are exact at the int8
extremes, and its answer equals the reference (engine.quant.weights.Int8Weight) within float rounding. Needs
AVX512-VNNI: skipped on other CPUs, where oneDNN or torch._int_mm run W8A8 layers (test_quant_paths.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import bf16mm, i8mm
from engine.kernels.i8mm import I8MM
from engine.kernels.select import GemmSelector, _matches_reference
from engine.layers.activation import ActAndMul
from engine.quant.paths import I8MMPath, I8MMSiluPath, quant_paths
from engine.quant.weights import Int4Weight
from tests.int8_kernels import (
    assert_an_all_zero_row_gives_zero_alone,
    assert_no_rows_give_no_rows,
    assert_products_at_the_int8_extremes_are_exact,
    int8_weight,
)

pytestmark = pytest.mark.skipif(not i8mm.supported(), reason="this CPU has no AVX512-VNNI")


@pytest.fixture(scope="module", params=["prefetch", "no prefetch"])
def kernel(request: pytest.FixtureRequest) -> I8MM:
    k = i8mm.kernel() if request.param == "prefetch" else i8mm.kernel_without_prefetch()
    assert k is not None, "the W8A8 kernel did not build or failed its self-check (see the warning)"
    return k


def test_the_packed_layout_holds_each_weight_where_the_kernel_reads_it() -> None:
    w = int8_weight(70, 37)
    p = I8MM.pack(w.q, w.scale)
    blocks, k4 = 2, 40
    cells = p.packed.view(blocks, k4 // 4, 64, 4)
    for n, k in ((0, 0), (5, 3), (63, 36), (64, 1), (69, 35)):
        assert int(cells[n // 64, k // 4, n % 64, k % 4]) == int(w.q[n, k])
    assert cells[:, 9, :, 1:].abs().sum() == 0 and cells[1, :, 6:].abs().sum() == 0  # K and column padding
    assert torch.equal(p.colsum[:70], w.q.sum(1, dtype=torch.int32)) and p.colsum[70:].abs().sum() == 0
    assert torch.equal(p.scale[:70], w.scale) and p.scale[70:].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(96, 256), (130, 33), (64, 5), (7, 1024)])
def test_it_equals_the_reference(kernel: I8MM, dtype: torch.dtype, n: int, k: int) -> None:
    w = int8_weight(n, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    packed = I8MM.pack(w.q, w.scale, bias)
    for rows in (1, 5, 6, 7, 33, 200):  # tiles of 6, and more than 192 (one pass)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        want = w.reference(x, bias)
        got = kernel.linear(x, packed)
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the output
        assert (got.float() - want).abs().max() <= tol * want.abs().max()


@pytest.mark.skipif(not bf16mm.supported(), reason="the fused entry is built with AVX512-BF16 only")
@pytest.mark.parametrize(("n", "k"), [(128, 256), (192, 33)])
def test_the_fused_silu_entry_equals_the_unfused_entry_then_the_torch_code(kernel: I8MM, n: int, k: int) -> None:
    w = int8_weight(n, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    act = ActAndMul("silu")
    path = I8MMSiluPath(kernel)
    assert path.accepts(w, act) and not path.accepts(w, None) and not path.accepts(int8_weight(96, k), act)
    assert path.layout != I8MMPath.layout  # its copy has the rows interleaved
    run, plain = path.prepare(w, bias, act), I8MMPath(kernel).prepare(w, bias, None)
    for rows in (1, 5, 7, 33, 200):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        gate, up = plain(x).chunk(2, dim=-1)  # the projection in bf16, then SiLU and product in bf16
        want = (F.silu(gate) * up).float()
        got = run(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n // 2)
        assert torch.allclose(got.float(), want, rtol=1 / 128, atol=1e-3 * want.abs().max().item())
    assert {"i8mm-silu-mul", "i8mm-silu-mul-noprefetch"} <= {p.name for p in quant_paths(torch.bfloat16)}
    # in float32 math the path of that name runs the entry over float32 rows (the test below)
    assert all(p.float32 for p in quant_paths(torch.float32) if isinstance(p, I8MMSiluPath))


@pytest.mark.parametrize(("n", "k"), [(128, 256), (192, 33)])
def test_the_float32_fused_silu_entry_equals_the_unfused_entry_then_the_float32_torch_code(
    kernel: I8MM, n: int, k: int
) -> None:
    """Float32 math on any AVX512-VNNI CPU (no AVX512-BF16 needed): i8mm_linear_silu_mul_f32 gives silu(gate) * up
    of the plain entry's float32 sums, in float32 (silu.h's vector exp against torch's: float rounding apart)."""
    w = int8_weight(n, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    act = ActAndMul("silu")
    path = I8MMSiluPath(kernel, float32=True)
    assert path.available and path.accepts(w, act) and not path.accepts(w, None)
    run, plain = path.prepare(w, bias, act), I8MMPath(kernel).prepare(w, bias, None)
    for rows in (1, 5, 7, 33, 200):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        gate, up = plain(x).chunk(2, dim=-1)  # float32 sums
        want = F.silu(gate) * up
        got = run(x)
        assert got.dtype == torch.float32 and got.shape == (rows, n // 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert {"i8mm-silu-mul", "i8mm-silu-mul-noprefetch"} <= {p.name for p in quant_paths(torch.float32)}


def test_products_at_the_int8_extremes_are_exact(kernel: I8MM) -> None:
    assert_products_at_the_int8_extremes_are_exact(kernel.linear, I8MM.pack)


def test_no_rows_give_no_rows(kernel: I8MM) -> None:
    assert_no_rows_give_no_rows(kernel.linear, I8MM.pack)


def test_an_all_zero_row_gives_zero_and_leaves_its_neighbours_alone(kernel: I8MM) -> None:
    assert_an_all_zero_row_gives_zero_alone(kernel.linear, I8MM.pack)


def test_its_path_is_a_candidate_for_either_math_and_the_selection_keeps_it_when_fastest(kernel: I8MM) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert "i8mm" in [p.name for p in quant_paths(dtype)]
    path = I8MMPath(kernel)
    w = int8_weight(96, 256)
    int4 = Int4Weight(torch.zeros(96, 128, dtype=torch.uint8), torch.ones(96, 2), torch.ones(96, 2), 128)
    assert path.accepts(w, None) and not path.accepts(int4, None)
    bias = torch.randn(96)
    run = path.prepare(w, bias, None)
    for rows in (1, 8, 33):
        for dtype in (torch.float32, torch.bfloat16):
            assert _matches_reference(run, torch.randn(rows, 256).to(dtype), w, bias, None)
    calls: list[int] = []
    original = kernel.linear

    class Spy(I8MM):
        def __init__(self) -> None:
            self.lib = kernel.lib

        def linear(self, *args):  # type: ignore[no-untyped-def]
            calls.append(1)
            return original(*args)

    others = [p for p in quant_paths(torch.bfloat16) if p.name != "i8mm"]

    def i8mm_fast(fn) -> float:  # type: ignore[no-untyped-def]
        calls.clear()
        fn()
        return 1e-6 if calls else 1e-3

    sel = GemmSelector([*others, I8MMPath(Spy())], torch.bfloat16, timer=i8mm_fast)
    assert sel.choose("w8a8 test", [(w, None)], None).per_class == ["i8mm"] * 5  # type: ignore[list-item]
