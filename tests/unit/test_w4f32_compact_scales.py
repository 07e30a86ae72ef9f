"""w4f32's compact scales (w4f32.c, -DSCALE16; engine.kernels.w4_builds): where a weight's scales are bf16 values,
its copy holds them as bf16 beside a byte of z, and every entry point, fused and grouped, gives the float layout's
bits; the paths and the grouped choice take that build by themselves. w4f32 builds on any CPU (portable C where
there is no AVX2)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import w4_builds, w4f32
from engine.kernels.op_choice import _quant_grouped_builds
from engine.kernels.w4f32 import W4F32, PackedInt4F32
from engine.layers.activation import ActAndMul
from engine.quant.grouped import GroupedQuantLinear
from engine.quant.paths import W4F32Path, W4F32SiluPath
from tests.int4_kernels import bf16_scaled, int4_weight, layout_builds


@pytest.fixture(scope="module")
def builds() -> tuple[W4F32, W4F32]:
    return layout_builds(w4f32)


def test_the_compact_copy_holds_each_scale_and_zero_where_the_kernel_reads_them() -> None:
    w = bf16_scaled(40, 64, 32, symmetric=False)
    p = W4F32.pack(w.packed, w.scale, w.zero, 32, compact=True)
    plain = W4F32.pack(w.packed, w.scale, w.zero, 32)
    assert p.compact and torch.equal(p.nibbles, plain.nibbles) and p.scales.numel() == 2 * 2 * 96
    groups = p.scales.view(2, 2, 96)  # [block, group, (32 bf16 s | 32 bytes z)]
    s, z = groups[..., :64].contiguous().view(torch.bfloat16).float(), groups[..., 64:]
    for col, g in ((0, 0), (7, 1), (31, 1), (32, 0), (39, 1)):
        assert s[col // 32, g, col % 32] == w.scale[col, g] and int(z[col // 32, g, col % 32]) == int(w.zero[col, g])


@pytest.mark.parametrize("entry", ["direct", "panel"])
@pytest.mark.parametrize(("n", "k", "g", "symmetric"), [(70, 256, 128, False), (64, 96, 32, True), (33, 48, 16, False)])
def test_every_entry_point_gives_the_float_layouts_bits(
    builds: tuple[W4F32, W4F32], entry: str, n: int, k: int, g: int, symmetric: bool
) -> None:
    plain, compact = builds
    w = bf16_scaled(n, k, g, symmetric)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    pf, pc = W4F32Path.pack(w), W4F32Path.pack(w, compact=True)
    for rows in (1, 2, 3, 7, 40):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(getattr(compact, entry)(x, pc, bias), getattr(plain, entry)(x, pf, bias))


@pytest.mark.parametrize("entry", ["silu_mul", "panel_silu_mul"])
def test_the_fused_entries_give_the_float_layouts_bits(builds: tuple[W4F32, W4F32], entry: str) -> None:
    plain, compact = builds
    w = bf16_scaled(128, 64, 32, symmetric=False)
    pf, pc = W4F32SiluPath.pack(w), W4F32SiluPath.pack(w, compact=True)
    for rows in (1, 5, 33):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(getattr(compact, entry)(x, pc, None), getattr(plain, entry)(x, pf, None))


def test_a_build_refuses_the_other_layouts_copy(builds: tuple[W4F32, W4F32]) -> None:
    plain, compact = builds
    w = bf16_scaled(32, 32, 16, symmetric=True)
    with pytest.raises(ValueError, match="compact"):
        plain.direct(torch.randn(1, 32), W4F32Path.pack(w, compact=True), None)
    with pytest.raises(ValueError, match="float"):
        compact.direct(torch.randn(1, 32), W4F32Path.pack(w), None)


def test_the_grouped_call_gives_the_float_layouts_bits_and_the_choice_offers_the_matching_build(
    builds: tuple[W4F32, W4F32],
) -> None:
    plain, compact = builds
    weights = [bf16_scaled(128, 64, 32, symmetric=False, seed=e) for e in range(3)]
    counts = [1, 0, 4]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for silu in (False, True):
        got = GroupedQuantLinear(compact, weights, silu_mul=silu)(x, counts)
        assert torch.equal(got, GroupedQuantLinear(plain, weights, silu_mul=silu)(x, counts))
    assert _quant_grouped_builds(weights[0], torch.float32)["grouped w4f32"] is compact
    inexact = int4_weight(128, 64, 32, symmetric=False)
    assert _quant_grouped_builds(inexact, torch.float32)["grouped w4f32"] is plain
    assert not GroupedQuantLinear.accepts(compact, [inexact])


def test_its_paths_pack_bf16_scales_compact(builds: tuple[W4F32, W4F32]) -> None:
    plain, _ = builds
    x = torch.randn(3, 128)
    for w, compact in ((bf16_scaled(64, 128, 32, False), True), (int4_weight(64, 128, 32, False), False)):
        for path in (W4F32Path(plain, "direct"), W4F32SiluPath(plain, "silu-mul")):
            silu = isinstance(path, W4F32SiluPath)
            run = path.prepare(w, None, ActAndMul("silu") if silu else None)
            cells = [c.cell_contents for c in run.call.__closure__ or ()]  # type: ignore[union-attr]
            (packed,) = [c for c in cells if isinstance(c, PackedInt4F32)]
            assert packed.compact == compact and run.entry is not None  # type: ignore[attr-defined]
            assert run(x).shape == (3, 32 if silu else 64)


def test_the_scales_answer_is_kept_while_the_tensor_lives_and_leaves_with_it() -> None:
    bf16, other = torch.tensor([0.5, 0.25]), torch.tensor([0.1, 0.3])
    assert w4_builds.compact_scales(bf16) and not w4_builds.compact_scales(other)
    assert w4_builds._COMPACT[id(bf16)][1] and not w4_builds._COMPACT[id(other)][1]
    assert w4_builds.compact_scales(bf16) and not w4_builds.compact_scales(other)  # the kept answers
    key = id(other)
    del other
    assert key not in w4_builds._COMPACT  # no answer outlives its tensor (a new one at that address asks again)
