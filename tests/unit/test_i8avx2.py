"""The AVX2 W8A8 kernel (engine.kernels.i8avx2), compiled here with gcc: its activations are quantized exactly as
compressed-tensors defines it, its int32 sums are exact at the int8 extremes (-128 x -128 included), and its
answer equals the reference
(engine.quant.weights.Int8Weight) within float rounding; its fused gated-MLP entries and its grouped (MoE) entry
give the bits of its linear entry. Needs AVX2 (every x86 CPU these tests have run on)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.kernels import i8avx2
from engine.kernels.gemm import interleave_halves
from engine.kernels.i8avx2 import I8AVX2, PackedInt8Rows
from engine.kernels.program import address
from engine.kernels.select import GemmSelector, _matches_reference
from engine.quant.paths import I8AVX2Path, quant_paths
from engine.quant.weights import Int4Weight
from tests.int8_kernels import (
    assert_an_all_zero_row_gives_zero_alone,
    assert_no_rows_give_no_rows,
    assert_products_at_the_int8_extremes_are_exact,
    int8_weight,
)

pytestmark = pytest.mark.skipif(not i8avx2.supported(), reason="this CPU has no AVX2")


@pytest.fixture(scope="module")
def kernel() -> I8AVX2:
    k = i8avx2.kernel()
    assert k is not None, "the AVX2 W8A8 kernel did not build or failed its self-check (see the warning)"
    return k


ENTRIES = ("linear", "panel")  # each weight row widened per row of x; a block widened once for every row


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(("n", "k"), [(96, 256), (130, 96), (5, 33), (64, 4864), (36, 1056)])
def test_it_equals_the_reference(kernel: I8AVX2, entry: str, n: int, k: int) -> None:
    w, bias = int8_weight(n, k), torch.randn(n, generator=torch.Generator().manual_seed(1))
    packed = I8AVX2.pack(w.q, w.scale, bias)
    for rows in (1, 2, 5, 33, 97, 200):  # the panel's 3-row tiles and 96-row passes, with their tails
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want, got = w.reference(x, bias), getattr(kernel, entry)(x, packed)
        assert got.shape == (rows, n) and (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("entry", ENTRIES)
def test_products_at_the_int8_extremes_are_exact(kernel: I8AVX2, entry: str) -> None:
    assert_products_at_the_int8_extremes_are_exact(getattr(kernel, entry), I8AVX2.pack)


@pytest.mark.parametrize("entry", ENTRIES)
def test_no_rows_give_no_rows(kernel: I8AVX2, entry: str) -> None:
    assert_no_rows_give_no_rows(getattr(kernel, entry), I8AVX2.pack)


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_all_zero_row_gives_zero_and_leaves_its_neighbours_alone(kernel: I8AVX2, entry: str) -> None:
    assert_an_all_zero_row_gives_zero_alone(getattr(kernel, entry), I8AVX2.pack)


def test_both_entries_give_the_same_bits(kernel: I8AVX2) -> None:
    """The same exact int32 sums and the same scaling: which one the selection takes per batch class changes no
    answer."""
    w, bias = int8_weight(200, 1100), torch.randn(200)
    packed, x = I8AVX2.pack(w.q, w.scale, bias), torch.randn(40, 1100)
    assert torch.equal(kernel.linear(x, packed), kernel.panel(x, packed))


def test_its_path_is_a_float32_candidate_and_the_selection_keeps_it_when_fastest(kernel: I8AVX2) -> None:
    names = [p.name for p in quant_paths(torch.float32)]
    assert {"i8avx2", "i8avx2-noprefetch", "i8avx2-panel"} <= set(names)  # whether prefetch / a panel pays is measured
    plain = i8avx2.kernel_without_prefetch()
    assert plain is not None and plain.lib is not kernel.lib
    assert "i8avx2" not in [p.name for p in quant_paths(torch.bfloat16)]  # float32 in and out
    w = int8_weight(96, 256)
    int4 = Int4Weight(torch.zeros(96, 128, dtype=torch.uint8), torch.ones(96, 2), torch.ones(96, 2), 128)
    bias = torch.randn(96)
    for path in (I8AVX2Path(kernel), I8AVX2Path(kernel, "i8avx2-panel", "panel")):
        assert path.accepts(w, None) and not path.accepts(int4, None)
        run = path.prepare(w, bias, None)
        for rows in (1, 8, 33):
            assert _matches_reference(run, torch.randn(rows, 256), w, bias, None)
    calls: list[int] = []
    original = kernel.linear

    class Spy(I8AVX2):
        def __init__(self) -> None:
            self.lib = kernel.lib

        def linear(self, *args):  # type: ignore[no-untyped-def]
            calls.append(1)
            return original(*args)

    others = [p for p in quant_paths(torch.float32) if not p.name.startswith("i8avx2")]

    def fast(fn) -> float:  # type: ignore[no-untyped-def]
        calls.clear()
        fn()
        return 1e-6 if calls else 1e-3

    sel = GemmSelector([*others, I8AVX2Path(Spy())], torch.float32, timer=fast)
    assert sel.choose("w8a8 test", [(w, None)], None).per_class == ["i8avx2"] * 5  # type: ignore[list-item]


def test_an_aligned_weight_is_read_where_it_lies_and_a_ragged_one_padded() -> None:
    q = torch.ones(64, 128, dtype=torch.int8)
    assert I8AVX2.pack(q, torch.ones(64)).packed.data_ptr() == q.data_ptr()  # no second copy of the model
    ragged = I8AVX2.pack(torch.ones(5, 33, dtype=torch.int8), torch.ones(5))
    assert (
        ragged.packed.shape == (8, 64) and int(ragged.packed[5:].abs().sum() + ragged.packed[:, 33:].abs().sum()) == 0
    )


def test_each_batch_class_runs_the_entry_that_won_it(kernel: I8AVX2) -> None:
    """Both entries (and both builds) run on one packed copy, and int-mm (the baseline here: oneDNN's int8 GEMM
    saturates without VNNI) on the weight as stored, so none of them counts against the two copies a weight may
    hold. Before, each entry was a copy of its own and int-mm one more: the selection held int-mm and the panel,
    and ran the panel at one row too (2.6x the per-row entry's time there, on a Zen 1, 2026-12-04)."""
    on_avx2 = ("int-mm", "i8avx2", "i8avx2-panel", "i8avx2-noprefetch", "torch-dequant")  # oneDNN's needs VNNI
    sel = GemmSelector([p for p in quant_paths(torch.float32) if p.name in on_avx2], torch.float32)
    assert sel.baseline == "int-mm" and len(sel.paths) == len(on_avx2)
    us = {name: [1e5] * 5 for name in sel.paths}
    us["i8avx2"] = [30.0, 130.0, 500.0, 4600.0, 4600.0]
    us["i8avx2-panel"] = [80.0, 210.0, 480.0, 3450.0, 3450.0]
    us["i8avx2-noprefetch"] = [50.0, 120.0, 520.0, 4100.0, 4100.0]
    assert sel._decide(us).per_class == ["i8avx2", "i8avx2-noprefetch", "i8avx2-panel", "i8avx2-panel", "i8avx2-panel"]
    w = int8_weight(64, 128)
    runs = [I8AVX2Path(kernel, name, entry).prepare(w, None, None) for name, entry in (("a", "linear"), ("b", "panel"))]
    x = torch.randn(4, 128)
    assert torch.equal(runs[0](x), runs[1](x))


FUSED = ("linear_silu_mul", "panel_silu_mul")  # the two entries with silu(gate) * up in the epilogue


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """[gate | up] (the halves as `linear` gives them, not interleaved) → silu(gate) * up, written as the kernel
    writes it."""
    g, u = y.chunk(2, dim=-1)
    return g / (1 + torch.exp(-g)) * u


def fused_weight(n: int, k: int, bias: bool = True, seed: int = 0) -> tuple[PackedInt8Rows, PackedInt8Rows]:
    """A gated MLP's [gate; up] weight (N = 2I rows) packed as it is and interleaved for the fused entries."""
    w = int8_weight(n, k, seed)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)) if bias else None
    i = interleave_halves
    return I8AVX2.pack(w.q, w.scale, b), I8AVX2.pack(i(w.q), i(w.scale), i(b) if b is not None else None)


@pytest.mark.parametrize("entry", FUSED)
@pytest.mark.parametrize(("n", "k"), [(128, 256), (256, 96), (64, 4864), (192, 33)])
def test_the_fused_entries_equal_linear_then_silu_mul(kernel: I8AVX2, entry: str, n: int, k: int) -> None:
    plain, fused = fused_weight(n, k)
    for rows in (1, 2, 5, 33, 97, 200):  # the row chunks and the panel's tiles and passes, with their tails
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want, got = silu_mul(kernel.linear(x, plain)), getattr(kernel, entry)(x, fused)
        assert got.shape == (rows, n // 2) and (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_both_fused_entries_give_the_same_bits(kernel: I8AVX2) -> None:
    """As the unfused pair: which one a batch class takes changes no answer."""
    _, fused = fused_weight(256, 1100)
    for rows in (1, 7, 100):
        x = torch.randn(rows, 1100)
        assert torch.equal(kernel.linear_silu_mul(x, fused), kernel.panel_silu_mul(x, fused))


@pytest.mark.parametrize("entry", FUSED)
def test_fused_entries_take_any_leading_shape_and_no_rows(kernel: I8AVX2, entry: str) -> None:
    _, fused = fused_weight(64, 40, bias=False)
    x = torch.randn(2, 3, 40)
    got = getattr(kernel, entry)(x, fused)
    assert got.shape == (2, 3, 32) and torch.equal(got.reshape(6, 32), getattr(kernel, entry)(x.reshape(6, 40), fused))
    assert getattr(kernel, entry)(torch.empty(0, 40), fused).shape == (0, 32)


def test_the_program_signatures_are_the_entries(kernel: I8AVX2) -> None:
    """What a decode program calls (program.c's i8_fn and i8_silu_fn) gives the methods' bits, colsum ignored."""
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    i8_fn = ctypes.CFUNCTYPE(c_int, i64, i64, i64, ptr, c_int, ptr, ptr, ptr, ptr, ptr, c_int)
    i8_silu_fn = ctypes.CFUNCTYPE(c_int, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, c_int)
    plain, fused = fused_weight(128, 96)
    x = torch.randn(3, 96)
    for entry in ("linear", "panel", "linear_silu_mul", "panel_silu_mul"):
        silu = entry.endswith("silu_mul")
        w, y = (fused, torch.empty(3, 64)) if silu else (plain, torch.empty(3, 128))
        assert w.bias is not None
        args = (w.packed.data_ptr(), None, w.scale.data_ptr(), w.bias.data_ptr(), y.data_ptr(), 2)  # no colsum
        fn = kernel.c_fn(entry)
        rc = (
            i8_silu_fn(address(fn))(3, w.n, w.k, x.data_ptr(), *args)
            if silu
            else i8_fn(address(fn))(3, w.n, w.k, x.data_ptr(), 0, *args)
        )
        assert rc == 0 and torch.equal(y, getattr(kernel, entry)(x, w)), entry


def grouped_weights(packed: list[PackedInt8Rows]) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array]:
    """I8MM.grouped's pointer arrays: packed weights, column sums (none here: NULLs), scales."""
    arr = ctypes.c_void_p * len(packed)
    return arr(*[p.packed.data_ptr() for p in packed]), arr(), arr(*[p.scale.data_ptr() for p in packed])


# experts without rows; few rows (the per-row tiles) and 16 or more (the panel), beyond one pass of 96
COUNTS = ([3, 0, 1, 33, 2], [0, 100, 16, 15, 1])


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize(("n", "k"), [(130, 96), (64, 4864), (256, 33)])
def test_grouped_gives_each_experts_linear_bits(kernel: I8AVX2, counts: list[int], n: int, k: int) -> None:
    experts = [int8_weight(n, k, seed=e) for e in range(len(counts))]
    packed = [I8AVX2.pack(w.q, w.scale) for w in experts]
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(3))
    got = kernel.grouped(x, (ctypes.c_int64 * len(counts))(*counts), (n, k), grouped_weights(packed), False)
    want = torch.cat([kernel.linear(rows, p) for rows, p in zip(x.split(counts), packed, strict=True)])
    assert got.shape == (sum(counts), n) and torch.equal(got, want)


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize(("n", "k"), [(128, 96), (192, 1100)])
def test_grouped_with_silu_mul_gives_each_experts_fused_bits(kernel: I8AVX2, counts: list[int], n: int, k: int) -> None:
    packed = [fused_weight(n, k, bias=False, seed=e)[1] for e in range(len(counts))]
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(4))
    got = kernel.grouped(x, (ctypes.c_int64 * len(counts))(*counts), (n, k), grouped_weights(packed), True)
    want = torch.cat([kernel.linear_silu_mul(rows, p) for rows, p in zip(x.split(counts), packed, strict=True)])
    assert got.shape == (sum(counts), n // 2) and torch.equal(got, want)
    ptrs, _, scales = grouped_weights(packed)  # no column-sum array at all (the kernel needs none)
    assert torch.equal(
        kernel.grouped(x, (ctypes.c_int64 * len(counts))(*counts), (n, k), (ptrs, None, scales), True), want
    )


@pytest.mark.parametrize("silu", [False, True])
def test_grouped_without_rows_gives_an_empty_result(kernel: I8AVX2, silu: bool) -> None:
    packed = [fused_weight(64, 96, bias=False, seed=e)[1] for e in range(3)]
    got = kernel.grouped(torch.empty(0, 96), (ctypes.c_int64 * 3)(0, 0, 0), (64, 96), grouped_weights(packed), silu)
    assert got.shape == (0, 32 if silu else 64)
