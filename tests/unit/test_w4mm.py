"""The W4A16 kernel (engine.kernels.w4mm), compiled here with gcc: its packed layout holds exactly the weight's
nibbles and scales, every entry point equals the float32 dequantize-then-matmul reference within bf16 rounding,
and its GEMM paths plug into the engine's measured selection. Needs AVX512-BF16: skipped on other CPUs, where
torch's int4 GEMM runs W4A16 layers (tests/unit/test_quant_paths.py)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import bf16mm, w4mm
from engine.kernels.gemm import interleave_halves
from engine.kernels.select import _matches_reference
from engine.kernels.w4mm import W4MM
from engine.layers.activation import ActAndMul
from engine.quant.paths import W4MM_ENTRIES, W4MMPath, W4MMSiluPath, interleaved, quant_paths
from engine.quant.weights import Int8Weight
from tests.int4_kernels import assert_the_selection_keeps_the_fastest_entry, int4_weight, packed_copies

pytestmark = pytest.mark.skipif(not bf16mm.supported(), reason="this CPU has no AVX512-BF16")


@pytest.fixture(scope="module")
def kernel() -> W4MM:
    k = w4mm.kernel()
    assert k is not None, "the W4A16 kernel did not build or failed its self-check (see the warning)"
    return k


def test_the_packed_layout_holds_each_nibble_and_scale_where_the_kernel_reads_it() -> None:
    w = int4_weight(70, 64, 32, symmetric=False)
    p = W4MM.pack(w.values(), w.scale, w.zero, 32)
    blocks = 2  # 70 columns: one whole block and a padded one
    nib = p.nibbles.view(blocks, 64 // 4, 4, 32)
    v = w.values()
    for col, k in ((0, 0), (1, 1), (17, 2), (63, 3), (64, 62), (69, 61)):
        b, c, j = col // 64, col % 64 // 16, col % 16
        byte = int(nib[b, k // 4, c, 2 * j + k % 2])
        assert (byte >> 4 if k % 4 >= 2 else byte & 15) == int(v[col, k])
    sc = p.scales.view(blocks, 2, 2, 64)  # [block, group, (s, s * (128 + z)), column]
    assert sc[1, 1, 0, 5] == w.scale[69, 1]
    assert torch.isclose(sc[0, 0, 1, 3], w.scale[3, 0] * (128 + w.zero[3, 0].float()))
    # the 58 padding columns: zero nibbles and zero scales, so they add nothing
    assert sc[1, :, :, 6:].abs().sum() == 0 and nib[1, :, 0, 12:].sum() == 0 and nib[1, :, 1:].sum() == 0


@pytest.mark.parametrize("entry", W4MM_ENTRIES)
@pytest.mark.parametrize(
    ("n", "k", "g", "symmetric"),
    # g 20: a group's input sums are taken 16 lanes at a time and the rest one by one
    [(96, 256, 128, False), (130, 96, 32, True), (64, 64, 64, False), (8, 32, 8, False), (64, 80, 20, True)],
)
def test_every_entry_point_equals_the_reference(
    kernel: W4MM, entry: str, n: int, k: int, g: int, symmetric: bool
) -> None:
    w = int4_weight(n, k, g, symmetric)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = W4MM.pack(w.values(), w.scale, w.zero, g)
    # direct's tiles of 3, 6 and 16 rows; wide's of 8 and two halves (9, 15); 6 (panel, block); past 192 (a pass)
    for rows in (1, 2, 3, 4, 7, 8, 9, 15, 33, 200):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        want = w.reference(x, bias.float())
        got = getattr(kernel, entry)(x, packed, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("wide", [False, True])
def test_the_direct_kernel_gives_a_row_the_same_bits_whatever_tile_it_falls_in(
    kernel: W4MM, fused: bool, wide: bool
) -> None:
    # direct: 1-3 rows run as one 64-column tile, 4-6 as two 32-column ones, 16 as four 16-column tall ones; wide:
    # 6-8-row tiles of 32 columns (fewer rows: direct's), two even ones at the end. Every row count up to two full
    # tiles and a tail, then tall tiles with each kind of tail, each row against the same row computed alone by
    # direct's entry (and the fused gated MLP's, which shares the tiles): the wide tiles sum the same products in
    # the same order
    w = int4_weight(192, 256, 64, symmetric=False)
    i = interleave_halves
    packed = (
        W4MM.pack(i(w.values()), i(w.scale), i(w.zero), 64) if fused else W4MM.pack(w.values(), w.scale, w.zero, 64)
    )
    bias = torch.randn(192, generator=torch.Generator().manual_seed(2)).bfloat16()
    alone = kernel.silu_mul if fused else kernel.direct
    run = (kernel.wide_silu_mul if fused else kernel.wide) if wide else alone
    for rows in (*range(1, 14), 16, 17, 19, 22, 23, 32, 33, 38):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        y = run(x, packed, bias)
        for r in range(rows):
            assert torch.equal(y[r : r + 1], alone(x[r : r + 1], packed, bias)), (rows, r)


@pytest.mark.parametrize("entry", W4MM_ENTRIES)
def test_the_paths_match_the_reference_as_the_selector_checks_it(kernel: W4MM, entry: str) -> None:
    path = W4MMPath(kernel, entry)
    w = int4_weight(96, 256, 64, symmetric=False)
    assert path.accepts(w, None)
    assert not path.accepts(Int8Weight(torch.zeros(96, 256, dtype=torch.int8), torch.ones(96)), None)
    assert not path.accepts(torch.zeros(96, 256), None)
    run = path.prepare(w, None, None)
    for rows in (1, 8, 33):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert _matches_reference(run, x, w, None, None), entry
    x3 = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert run(x3).shape == (2, 3, 96)
    act = ActAndMul("silu")
    # the act goes after the path's own GEMM (its closeness to the reference is checked above): compared with the
    # reference directly, `block`'s bf16-rounded weight missed a fixed tolerance for about one random x in four
    assert torch.equal(path.prepare(w, None, act)(x3), act(run(x3)))


@pytest.mark.parametrize(
    ("entry", "unfused"), [("silu-mul", "direct"), ("wide-silu-mul", "wide"), ("block-silu-mul", "block")]
)
@pytest.mark.parametrize(("n", "k", "g", "symmetric"), [(128, 256, 128, False), (192, 96, 32, True)])
def test_the_fused_silu_entries_equal_their_unfused_entry_then_the_torch_code(
    kernel: W4MM, entry: str, unfused: str, n: int, k: int, g: int, symmetric: bool
) -> None:
    w = int4_weight(n, k, g, symmetric)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).bfloat16()
    run = W4MMSiluPath(kernel, entry).prepare(w, bias, ActAndMul("silu"))
    plain = W4MMPath(kernel, unfused).prepare(w, bias, None)
    for rows in (1, 3, 7, 33, 200):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        gate, up = plain(x).chunk(2, dim=-1)  # the projection rounded to bf16, then SiLU and product in bf16
        want = (F.silu(gate) * up).float()
        got = run(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n // 2)
        # the same roundings: a bf16 step apart at most, where exp's last bit lands on the other side of one
        assert torch.allclose(got.float(), want, rtol=1 / 128, atol=1e-3 * want.abs().max().item()), entry
    assert run(torch.randn(2, 5, k).bfloat16()).shape == (2, 5, n // 2)


def test_the_fused_silu_path_takes_only_gated_mlps_and_packs_its_own_interleaved_copy(kernel: W4MM) -> None:
    path, act = W4MMSiluPath(kernel, "silu-mul"), ActAndMul("silu")
    w = int4_weight(128, 64, 32, symmetric=True)
    assert path.accepts(w, act) and not path.accepts(w, None) and not path.accepts(w, ActAndMul("gelu"))
    assert not path.accepts(int4_weight(96, 64, 32, symmetric=True), act)  # not whole 32-row gate/up halves
    assert path.layout != W4MMPath(kernel, "direct").layout  # rows interleaved: not the plain entries' copy
    run = path.prepare(w, None, act)
    (packed,) = [c.cell_contents for c in run.call.__closure__ or () if isinstance(c.cell_contents, w4mm.PackedInt4)]
    i = interleaved(w)
    assert torch.equal(packed.nibbles, W4MM.pack(i.values(), i.scale, i.zero, 32).nibbles)
    names = [p.name for p in quant_paths(torch.bfloat16)]
    assert {"w4mm-silu-mul", "w4mm-wide-silu-mul", "w4mm-block-silu-mul", "w4mm-silu-mul-noprefetch"} <= set(names)


@pytest.mark.parametrize("entry", W4MM_ENTRIES)
def test_no_rows_give_no_rows(kernel: W4MM, entry: str) -> None:
    w = int4_weight(64, 64, 32, symmetric=True)
    packed = W4MM.pack(w.values(), w.scale, w.zero, 32)
    assert getattr(kernel, entry)(torch.empty(0, 64, dtype=torch.bfloat16), packed, None).shape == (0, 64)


def test_a_group_size_that_does_not_divide_the_inputs_is_refused(kernel: W4MM) -> None:
    assert not W4MM.accepts(64, 96, 64)  # 96 inputs are not whole groups of 64
    assert not W4MM.accepts(64, 12, 6)  # a group is whole steps of 4 inputs


def test_every_entry_point_shares_one_packed_copy(kernel: W4MM) -> None:
    w = int4_weight(64, 128, 32, symmetric=True)
    runs = [W4MMPath(kernel, e).prepare(w, None, None) for e in W4MM_ENTRIES]
    cells = [packed_copies(r, w4mm.PackedInt4) for r in runs]
    assert cells[0] and all(c == cells[0] for c in cells)


def test_the_selection_times_them_among_the_bf16_candidates_and_keeps_the_fastest(kernel: W4MM) -> None:
    names = [p.name for p in quant_paths(torch.bfloat16)]
    assert {"w4mm", "w4mm-wide", "w4mm-panel", "w4mm-block"} <= set(names) and names[-1] == "torch-dequant"
    assert {"w4mm-noprefetch", "w4mm-panel-noprefetch", "w4mm-block-noprefetch"} <= set(names)  # prefetch timed too
    assert "w4mm" not in [p.name for p in quant_paths(torch.float32)]  # bf16 math only
    assert_the_selection_keeps_the_fastest_entry(kernel, W4MMPath, torch.bfloat16, W4MM_ENTRIES)


@pytest.mark.parametrize(("n", "k", "g", "symmetric"), [(96, 256, 128, False), (130, 96, 32, True)])
def test_the_dense_path_equals_the_reference_from_the_weight_as_stored(
    kernel: W4MM, n: int, k: int, g: int, symmetric: bool
) -> None:
    """w4mm_dequantize writes (q - z) * s as the reference computes it, rounded once to bf16; oneDNN's GEMM over
    those rows then differs from the float32 reference by bf16 roundings only."""
    w = int4_weight(n, k, g, symmetric)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
    for rows in (1, 33, 600):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got, want = kernel.dense(x, w, bias), w.reference(x, bias.float())
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()
    eye = torch.eye(k).bfloat16()  # the rows themselves: exactly the reference's weight, rounded to bf16
    assert torch.equal(kernel.dense(eye, w, None).t(), w.float().bfloat16())


def test_a_layer_past_the_scratch_size_goes_in_row_chunks(kernel: W4MM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized LM head (151936 x 896) would otherwise hold a 272 MB scratch: chunks of DENSE_MAX weights,
    the last one short, each with its share of the bias."""
    w = int4_weight(130, 256, 64, symmetric=False)
    bias = torch.randn(130, generator=torch.Generator().manual_seed(3)).bfloat16()
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    whole = kernel.dense(x, w, bias)
    monkeypatch.setattr(w4mm, "DENSE_MAX", 40 * 256)  # 40 rows at a time: 40, 40, 40, 10
    monkeypatch.setattr(w4mm._scratch, "rows", torch.empty(0, dtype=torch.bfloat16))
    chunked = kernel.dense(x, w, bias)
    assert chunked.shape == (2, 5, 130)  # oneDNN may sum a narrower GEMM in another order: bf16 roundings apart
    assert (chunked.float() - whole.float()).abs().max() <= 1e-2 * whole.float().abs().max()
    assert w4mm._scratch.rows.numel() == 40 * 256


def test_the_dense_path_keeps_no_copy_and_its_scratch_is_per_thread(kernel: W4MM) -> None:
    """Engines of several models may step in threads of their own: one thread's layers never write the rows
    another thread's GEMM is reading."""
    path = next(p for p in quant_paths(torch.bfloat16) if p.name == "w4mm-dense")
    assert path.layout == "" and path.accepts(int4_weight(64, 64, 32, symmetric=True), None)  # type: ignore[attr-defined]
    assert not path.accepts(int4_weight(64, 64, 16, symmetric=True), None)  # whole 32-input steps only
    big, small = int4_weight(256, 512, 128, symmetric=False, seed=1), int4_weight(64, 128, 32, symmetric=True)
    kernel.dense(torch.randn(4, 128).bfloat16(), small, None)
    mine = w4mm._scratch.rows
    seen: list[torch.Tensor] = []

    def other() -> None:
        kernel.dense(torch.randn(4, 512).bfloat16(), big, None)
        seen.append(w4mm._scratch.rows)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen[0].numel() >= 256 * 512 and seen[0].data_ptr() != mine.data_ptr()
    assert w4mm._scratch.rows is mine  # this thread's rows: not replaced, not grown
