"""The W8A8 kernel on AMX-INT8 tiles (engine.kernels.i8amx), compiled here with gcc: over i8mm's packed weight (the
same copy) its answer equals the reference (engine.quant.weights.Int8Weight) within float rounding at the row
counts where its tiles change shape, its activations are quantized exactly as compressed-tensors defines it (ties
to even included), its int32 sums are exact at the int8 extremes, and its path plugs into the measured selection;
its fused gated-MLP entry gives i8mm's fused bits. Needs AMX-INT8: skipped on other CPUs, where i8mm, oneDNN or
torch._int_mm run W8A8 layers (test_i8mm.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import i8amx, i8mm
from engine.kernels.gemm import interleave_halves
from engine.kernels.i8amx import I8AMX
from engine.kernels.i8mm import I8MM, PackedInt8
from engine.kernels.select import _matches_reference
from engine.layers.activation import ActAndMul
from engine.quant.paths import I8MMPath, I8MMSiluPath, quant_paths
from engine.quant.weights import Int8Weight, quantize_tokens
from tests.int4_kernels import packed_copies
from tests.int8_kernels import (
    assert_an_all_zero_row_gives_zero_alone,
    assert_no_rows_give_no_rows,
    assert_products_at_the_int8_extremes_are_exact,
    int8_weight,
)

pytestmark = pytest.mark.skipif(not i8amx.supported(), reason="this CPU has no AMX-INT8")


@pytest.fixture(scope="module", params=["prefetch", "no prefetch"])
def kernel(request: pytest.FixtureRequest) -> I8AMX:
    k = i8amx.kernel() if request.param == "prefetch" else i8amx.kernel_without_prefetch()
    assert k is not None, "the AMX W8A8 kernel did not build or failed its self-check (see the warning)"
    return k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(96, 256), (130, 64), (64, 576), (7, 1024)])
def test_it_equals_the_reference(kernel: I8AMX, dtype: torch.dtype, n: int, k: int) -> None:
    w = int8_weight(n, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    packed = I8MM.pack(w.q, w.scale, bias)
    for rows in (1, 15, 16, 17, 32, 33, 200):  # one 16-row slice, two, and past a 32-row block
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        want = w.reference(x, bias)
        got = kernel.linear(x, packed)
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the output
        assert (got.float() - want).abs().max() <= tol * want.abs().max()


def test_the_rows_quantize_exactly_as_the_reference_ties_to_even_included() -> None:
    """i8_rows.h quantizes 16 values at a time: a row whose largest magnitude is 127.5 has a scale of exactly 1, so
    values k + 0.5 are ties, which round to even as torch.round does. Both kernels over i8mm's layout."""
    k = 64
    x = torch.arange(-32, 32, dtype=torch.float32).repeat(3, 1) + 0.5
    x[:, 0] = -127.5  # the scale: 1
    x[1] = x[1] * 0.37  # and a row of inexact quotients
    x[2, 5] = 0.0
    xq, xs = quantize_tokens(x)
    eye = Int8Weight(torch.eye(k, dtype=torch.int8), torch.ones(k))  # y = dequantized x itself
    kernels = [i8amx.kernel(), i8mm.kernel()]
    for kern in kernels:
        assert kern is not None
        got = kern.linear(x, I8MM.pack(eye.q, eye.scale))
        assert torch.equal(got, xq.float() * xs)


def test_products_at_the_int8_extremes_are_exact(kernel: I8AMX) -> None:
    assert_products_at_the_int8_extremes_are_exact(kernel.linear, I8MM.pack)


def test_no_rows_give_no_rows(kernel: I8AMX) -> None:
    assert_no_rows_give_no_rows(kernel.linear, I8MM.pack)


def test_an_all_zero_row_gives_zero_and_leaves_its_neighbours_alone(kernel: I8AMX) -> None:
    assert_an_all_zero_row_gives_zero_alone(kernel.linear, I8MM.pack)


def test_inputs_that_are_not_whole_tile_steps_are_left_to_i8mm(kernel: I8AMX) -> None:
    path = I8MMPath(kernel, "i8mm-amx")
    assert path.accepts(int8_weight(64, 128), None)
    assert not path.accepts(int8_weight(64, 96), None)  # a tile step is 64 inputs
    assert I8MMPath(i8mm.kernel(), "i8mm").accepts(int8_weight(64, 96), None)  # type: ignore[arg-type]


def test_its_path_shares_i8mms_packed_copy_and_is_a_timed_candidate(kernel: I8AMX) -> None:
    names = [p.name for p in quant_paths(torch.bfloat16)]
    assert "i8mm-amx" in names and "i8mm-amx-noprefetch" in names and "i8mm" in names
    w, bias = int8_weight(96, 256), torch.randn(96)
    paths = [I8MMPath(kernel, "i8mm-amx"), I8MMPath(i8mm.kernel(), "i8mm")]  # type: ignore[arg-type]
    assert paths[0].layout == paths[1].layout
    runs = [p.prepare(w, bias, None) for p in paths]
    cells = [packed_copies(r, PackedInt8) for r in runs]
    assert cells[0] and cells[0] == cells[1]
    for rows in (1, 8, 33):
        for dtype in (torch.float32, torch.bfloat16):
            assert _matches_reference(runs[0], torch.randn(rows, 256).to(dtype), w, bias, None)


@pytest.mark.parametrize(("n", "k"), [(128, 256), (64, 576), (1024, 128)])
def test_the_fused_gated_mlp_entry_gives_i8mms_bits(kernel: I8AMX, n: int, k: int) -> None:
    """silu(gate) * up over the interleaved [gate; up] copy i8mm's fused entry packs: the same int32 sums and the
    same epilogue, so the same bf16 bits, at the row counts where the tiles change shape."""
    w = int8_weight(n, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    i = interleave_halves
    packed = I8MM.pack(i(w.q), i(w.scale), i(bias))
    vnni = i8mm.kernel()
    assert vnni is not None and vnni.has_silu_mul and kernel.has_silu_mul
    for rows in (1, 15, 16, 17, 32, 33, 100):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = kernel.linear_silu_mul(x, packed)
        assert got.shape == (rows, n // 2) and got.dtype == torch.bfloat16
        assert torch.equal(got, vnni.linear_silu_mul(x, packed))
        gate, up = kernel.linear(x, I8MM.pack(w.q, w.scale, bias)).chunk(2, dim=-1)  # unfused, then torch's act
        assert torch.allclose(got.float(), (F.silu(gate) * up).float(), rtol=1 / 64, atol=1e-2)


def test_the_fused_entry_is_a_timed_candidate_on_the_interleaved_copy(kernel: I8AMX) -> None:
    names = [p.name for p in quant_paths(torch.bfloat16)]
    assert "i8mm-amx-silu-mul" in names and "i8mm-amx-silu-mul-noprefetch" in names
    assert "i8mm-amx-silu-mul" not in [p.name for p in quant_paths(torch.float32)]  # its epilogue rounds to bf16
    act = ActAndMul("silu")
    amx, vnni = I8MMSiluPath(kernel, "i8mm-amx-silu-mul"), I8MMSiluPath(i8mm.kernel())  # type: ignore[arg-type]
    assert amx.layout == vnni.layout == "i8mm-silu"
    assert amx.accepts(int8_weight(128, 128), act) and not amx.accepts(int8_weight(128, 96), act)  # 64-input steps
    assert not amx.accepts(int8_weight(128, 128), None)  # only where it replaces a SiLU act
    w = int8_weight(128, 256)
    x = torch.randn(5, 256).bfloat16()
    assert torch.equal(amx.prepare(w, None, act)(x), vnni.prepare(w, None, act)(x))
