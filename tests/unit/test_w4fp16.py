"""The W4A16 kernel with AVX512-FP16 products (engine.kernels.w4fp16), compiled here with gcc: its entry points equal
the float32 dequantize-then-matmul reference over w4mm's packed weight (the same copy) at the row counts where its
tiles change shape and for rows of any magnitude bf16 holds (each row is scaled by a power of two before it is
rounded to fp16), its fused gated-MLP entry equals the unfused one followed by torch's act, and its paths plug into
the engine's measured selection and its decode programs. Needs AVX512-FP16: skipped on other CPUs, where w4mm,
w4amx and torch's int4 GEMM run W4A16 layers (tests/unit/test_w4mm.py)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import w4fp16, w4mm
from engine.kernels.w4fp16 import W4FP16
from engine.kernels.w4mm import W4MM
from engine.layers.activation import ActAndMul
from engine.quant.paths import W4FP16Path, W4FP16SiluPath, W4MMSiluPath, quant_paths
from tests.int4_kernels import (
    assert_the_fused_entry_equals_the_unfused_then_torchs_act,
    assert_the_path_checks_and_shares_w4mms_copy,
    assert_the_selection_keeps_the_fastest_entry,
    int4_weight,
)

pytestmark = pytest.mark.skipif(not w4fp16.supported(), reason="this CPU has no AVX512-FP16")


@pytest.fixture(scope="module")
def kernel() -> W4FP16:
    k = w4fp16.kernel()
    assert k is not None, "the fp16 W4A16 kernel did not build or failed its self-check (see the warning)"
    return k


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got.float() - want).abs().max() <= 1e-2 * want.abs().max())


@pytest.mark.parametrize(
    ("n", "k", "g", "symmetric"),
    [(96, 256, 128, False), (130, 96, 32, True), (64, 64, 64, False), (70, 512, 256, False)],
)
def test_the_entry_point_equals_the_reference(kernel: W4FP16, n: int, k: int, g: int, symmetric: bool) -> None:
    w = int4_weight(n, k, g, symmetric)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = W4MM.pack(w.values(), w.scale, w.zero, g)
    for rows in (1, 2, 3, 4, 7, 33):  # each tile shape (1-3 rows) and tails after whole tiles
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = kernel.fp16(x, packed, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert _close(got, w.reference(x, bias.float()))


def test_rows_of_any_magnitude_keep_their_precision(kernel: W4FP16) -> None:
    """fp16 overflows past 65,504 and loses precision under 6e-5; bf16 rows reach far past both. Each row gets its
    own power-of-two scale, so rows of 3e4 (past fp16's range once summed) and of 1e-6 (subnormal in fp16) in one
    call are each as exact as rows of 1 (no bias: it would hide the small row in the output's rounding), and a row
    of zeros gives zeros."""
    w = int4_weight(64, 256, 32, symmetric=False)
    packed = W4MM.pack(w.values(), w.scale, w.zero, 32)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    x = (x * torch.tensor([[3e4], [1.0], [1e-6], [0.0]])).bfloat16()
    got = kernel.fp16(x, packed, None)
    assert torch.isfinite(got.float()).all()
    for r in range(3):
        assert _close(got[r : r + 1], w.reference(x[r : r + 1], None)), r
    assert torch.equal(got[3].float(), torch.zeros(64))


def test_no_rows_give_no_rows(kernel: W4FP16) -> None:
    w = int4_weight(64, 64, 32, symmetric=True)
    packed = W4MM.pack(w.values(), w.scale, w.zero, 32)
    assert kernel.fp16(torch.empty(0, 64, dtype=torch.bfloat16), packed, None).shape == (0, 64)


def test_groups_that_are_not_whole_fp16_spans_are_left_to_w4mm(kernel: W4FP16) -> None:
    assert W4MM.accepts(64, 64, 16) and not W4FP16.accepts(64, 64, 16)  # a span is 32 inputs
    assert not W4FP16Path(kernel, "fp16").accepts(int4_weight(64, 64, 16, symmetric=True), None)
    assert W4FP16Path(kernel, "fp16").accepts(int4_weight(64, 64, 32, symmetric=True), None)


def test_the_path_matches_the_reference_as_the_selector_checks_it_and_shares_w4mms_copy(kernel: W4FP16) -> None:
    assert_the_path_checks_and_shares_w4mms_copy(W4FP16Path(kernel, "fp16"), "w4mm-fp16")


def test_the_selection_times_it_among_the_bf16_candidates_and_keeps_the_fastest(kernel: W4FP16) -> None:
    names = [p.name for p in quant_paths(torch.bfloat16)]
    for name in ("w4mm-fp16", "w4mm-fp16-silu-mul", "w4mm-fp16-noprefetch", "w4mm-fp16-silu-mul-noprefetch"):
        assert name in names
    assert names[-1] == "torch-dequant"
    assert_the_selection_keeps_the_fastest_entry(kernel, W4FP16Path, torch.bfloat16, ("fp16",))


@pytest.mark.parametrize(("n", "k", "g"), [(128, 256, 128), (64, 96, 32), (1024, 128, 64)])
def test_the_fused_gated_mlp_entry_equals_the_unfused_entry_then_torchs_act(
    kernel: W4FP16, n: int, k: int, g: int
) -> None:
    assert_the_fused_entry_equals_the_unfused_then_torchs_act(kernel.fp16_silu_mul, kernel.fp16, n, k, g)


def test_the_fused_entry_is_a_timed_candidate_over_w4mm_silu_muls_copy(kernel: W4FP16) -> None:
    k4 = w4mm.kernel()
    assert k4 is not None
    act, w = ActAndMul("silu"), int4_weight(128, 128, 32, symmetric=True)
    ours, avx = W4FP16SiluPath(kernel, "fp16-silu-mul"), W4MMSiluPath(k4, "silu-mul")
    assert ours.layout == avx.layout == "w4mm-silu"
    assert ours.accepts(w, act) and not ours.accepts(w, None)  # only where it replaces a SiLU act
    assert not ours.accepts(int4_weight(128, 64, 16, symmetric=True), act)
