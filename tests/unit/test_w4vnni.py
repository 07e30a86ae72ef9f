"""The W4A16 kernel with int8 dot products (engine.kernels.w4vnni: AVX512-VNNI's VPDPBUSD over w4mm's packed
weight, the same copy), compiled here with gcc: its entry points equal the float32 dequantize-then-matmul reference
at the row counts where its tiles change shape, for rows of any magnitude bf16 holds (each row's groups get their
own power-of-two scale before they are rounded to integers) and for groups with one large value among small ones;
its sums are exact integers, so a row gives the same bits whatever tile or call it falls in; its fused gated-MLP
entry equals the unfused one followed by torch's act; and its paths plug into the engine's measured selection and
its decode programs. Needs AVX512-VNNI and AVX512-BF16: skipped on other CPUs, where w4mm, w4amx and torch's int4
GEMM run W4A16 layers (tests/unit/test_w4mm.py)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import w4mm, w4vnni
from engine.kernels.w4mm import W4MM
from engine.kernels.w4vnni import W4VNNI
from engine.layers.activation import ActAndMul
from engine.quant.paths import W4MMSiluPath, W4VNNIPath, W4VNNISiluPath, quant_paths
from tests.int4_kernels import (
    assert_the_fused_entry_equals_the_unfused_then_torchs_act,
    assert_the_path_checks_and_shares_w4mms_copy,
    assert_the_selection_keeps_the_fastest_entry,
    int4_weight,
)

pytestmark = pytest.mark.skipif(not w4vnni.supported(), reason="this CPU has no AVX512-VNNI with AVX512-BF16")


@pytest.fixture(scope="module")
def kernel() -> W4VNNI:
    k = w4vnni.kernel()
    assert k is not None, "the VNNI W4A16 kernel did not build or failed its self-check (see the warning)"
    return k


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got.float() - want).abs().max() <= 1e-2 * want.abs().max())


@pytest.mark.parametrize(
    ("n", "k", "g", "symmetric"),
    [(96, 256, 128, False), (130, 96, 32, True), (64, 64, 64, False), (70, 512, 256, False), (64, 48, 16, False)],
)
def test_the_entry_point_equals_the_reference(kernel: W4VNNI, n: int, k: int, g: int, symmetric: bool) -> None:
    w = int4_weight(n, k, g, symmetric)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = W4MM.pack(w.values(), w.scale, w.zero, g)
    for rows in (
        1,
        2,
        3,
        4,
        5,
        8,
        9,
        33,
    ):  # each tile shape (1-2 rows over 64 columns, 3-4 over 32, 5-8 over 16), tails
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = kernel.vnni(x, packed, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert _close(got, w.reference(x, bias.float()))


def test_rows_of_any_magnitude_keep_their_precision(kernel: W4VNNI) -> None:
    """Integers hold a fixed range; bf16 rows reach from 1e-38 to 3e38. Each row's group gets its own power-of-two
    scale, so rows of 1e30, 1 and 1e-30 in one call are each as exact as rows of 1 (no bias: it would hide the
    small row in the output's rounding), and a row of zeros gives zeros."""
    w = int4_weight(64, 256, 32, symmetric=False)
    packed = W4MM.pack(w.values(), w.scale, w.zero, 32)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    x = (x * torch.tensor([[1e30], [1.0], [1e-30], [0.0]])).bfloat16()
    got = kernel.vnni(x, packed, None)
    assert torch.isfinite(got.float()).all()
    for r in range(3):
        assert _close(got[r : r + 1], w.reference(x[r : r + 1], None)), r
    assert torch.equal(got[3].float(), torch.zeros(64))


def test_a_group_with_one_outlier_keeps_its_small_values(kernel: W4VNNI) -> None:
    """Activations with an outlier channel (as LLMs' have): a value 1,000 times the rest in every group. The small
    values are rounded to 2^-13 of the outlier, ~8 of their 8 significant bits gone, yet the error stays well under
    the output's bf16 rounding against the sums that include the outlier's product."""
    w = int4_weight(128, 512, 128, symmetric=False)
    packed = W4MM.pack(w.values(), w.scale, w.zero, 128)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    x[:, ::128] = 1000.0
    x = x.bfloat16()
    want = w.reference(x, None)
    err = (kernel.vnni(x, packed, None).float() - want).abs().max()
    assert err <= 4e-3 * want.abs().max()


def test_a_row_gives_the_same_bits_in_any_tile_or_call(kernel: W4VNNI) -> None:
    """Its sums are exact integers until each group's end, so a row's output does not depend on the rows beside
    it: in a tile of 1 to 8 rows, after whole tiles, alone."""
    w = int4_weight(192, 256, 64, symmetric=False)
    packed = W4MM.pack(w.values(), w.scale, w.zero, 64)
    bias = torch.randn(192, generator=torch.Generator().manual_seed(2)).bfloat16()
    for rows in (*range(1, 10), 13, 33):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        y = kernel.vnni(x, packed, bias)
        for r in range(rows):
            assert torch.equal(y[r : r + 1], kernel.vnni(x[r : r + 1], packed, bias)), (rows, r)


def test_no_rows_give_no_rows(kernel: W4VNNI) -> None:
    w = int4_weight(64, 64, 32, symmetric=True)
    packed = W4MM.pack(w.values(), w.scale, w.zero, 32)
    assert kernel.vnni(torch.empty(0, 64, dtype=torch.bfloat16), packed, None).shape == (0, 64)


def test_groups_it_cannot_sum_are_left_to_w4mm(kernel: W4VNNI) -> None:
    assert W4MM.accepts(64, 64, 8) and not W4VNNI.accepts(64, 64, 8)  # whole 16-input vectors a group
    assert not W4VNNI.accepts(64, 16384, 16384)  # int32 sums of a group that long could overflow
    assert not W4VNNIPath(kernel, "vnni").accepts(int4_weight(64, 64, 8, symmetric=True), None)
    assert W4VNNIPath(kernel, "vnni").accepts(int4_weight(64, 64, 16, symmetric=True), None)


def test_the_path_matches_the_reference_as_the_selector_checks_it_and_shares_w4mms_copy(kernel: W4VNNI) -> None:
    assert_the_path_checks_and_shares_w4mms_copy(W4VNNIPath(kernel, "vnni"), "w4mm-vnni")


def test_the_selection_times_it_among_the_bf16_candidates_and_keeps_the_fastest(kernel: W4VNNI) -> None:
    names = [p.name for p in quant_paths(torch.bfloat16)]
    for name in ("w4mm-vnni", "w4mm-vnni-silu-mul", "w4mm-vnni-noprefetch", "w4mm-vnni-silu-mul-noprefetch"):
        assert name in names
    assert names[-1] == "torch-dequant"
    assert_the_selection_keeps_the_fastest_entry(kernel, W4VNNIPath, torch.bfloat16, ("vnni",))


@pytest.mark.parametrize(("n", "k", "g"), [(128, 256, 128), (64, 96, 32), (1024, 128, 64)])
def test_the_fused_gated_mlp_entry_equals_the_unfused_entry_then_torchs_act(
    kernel: W4VNNI, n: int, k: int, g: int
) -> None:
    assert_the_fused_entry_equals_the_unfused_then_torchs_act(kernel.vnni_silu_mul, kernel.vnni, n, k, g)


def test_the_fused_entry_is_a_timed_candidate_over_w4mm_silu_muls_copy(kernel: W4VNNI) -> None:
    k4 = w4mm.kernel()
    assert k4 is not None
    act, w = ActAndMul("silu"), int4_weight(128, 128, 32, symmetric=True)
    ours, avx = W4VNNISiluPath(kernel, "vnni-silu-mul"), W4MMSiluPath(k4, "silu-mul")
    assert ours.layout == avx.layout == "w4mm-silu"
    assert ours.accepts(w, act) and not ours.accepts(w, None)  # only where it replaces a SiLU act
    assert not ours.accepts(int4_weight(128, 64, 8, symmetric=True), act)
