"""The compact scales' layout of the kernels over w4mm's packed weight (w4mm_common.h, -DSCALE16): where a weight's
scales are bf16 values (what a bf16 checkpoint stores), its copy holds them as bf16 beside a byte of 128 + z, 37.5%
of the float layout's bytes, and every entry point gives the float layout's very bits. The paths and the grouped
calls take that build by themselves; a build never runs over the other layout's copy. Needs AVX512-BF16."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.kernels import amxmm, bf16mm, w4amx, w4fp16, w4mm, w4vnni
from engine.kernels.op_choice import _quant_grouped_builds
from engine.kernels.w4_builds import compact_scales
from engine.kernels.w4mm import W4MM
from engine.layers.activation import ActAndMul
from engine.quant.grouped import GroupedQuantLinear
from engine.quant.paths import W4MMPath, W4MMSiluPath, W4VNNIPath
from tests.int4_kernels import bf16_scaled, int4_weight, layout_builds, packed_copies

pytestmark = pytest.mark.skipif(not bf16mm.supported(), reason="this CPU has no AVX512-BF16")


@pytest.fixture(scope="module")
def builds() -> tuple[W4MM, W4MM]:
    return layout_builds(w4mm)


def test_the_compact_copy_holds_each_scale_and_zero_where_the_kernel_reads_them() -> None:
    w = bf16_scaled(70, 64, 32, symmetric=False)
    p = W4MM.pack(w.values(), w.scale, w.zero, 32, compact=True)
    assert p.compact and p.scales.dtype == torch.uint8 and p.scales.numel() == 2 * 2 * 192  # 2 blocks x 2 groups
    groups = p.scales.view(2, 2, 192)  # [block, group, (64 bf16 s | 64 bytes 128 + z)]
    s = groups[..., :128].contiguous().view(torch.bfloat16).float()
    z = groups[..., 128:]
    for col, g in ((0, 0), (5, 1), (63, 1), (64, 0), (69, 1)):
        b, c = col // 64, col % 64
        assert s[b, g, c] == w.scale[col, g] and int(z[b, g, c]) == 128 + int(w.zero[col, g])
    plain = W4MM.pack(w.values(), w.scale, w.zero, 32)
    assert torch.equal(plain.nibbles, p.nibbles)  # only the scales differ
    assert p.scales.numel() * 8 == plain.scales.numel() * 4 * 3  # 192 of 512 bytes a group


def test_scales_that_are_not_bf16_values_are_not_compact() -> None:
    w = int4_weight(64, 64, 32, symmetric=True)
    assert not compact_scales(w.scale) and compact_scales(w.scale.bfloat16().float())
    with pytest.raises(AssertionError):
        W4MM.pack(w.values(), w.scale, w.zero, 32, compact=True)


@pytest.mark.parametrize("entry", ["direct", "wide", "panel", "block"])
@pytest.mark.parametrize(
    ("n", "k", "g", "symmetric"), [(130, 256, 128, False), (96, 96, 32, True), (64, 80, 20, False)]
)
def test_every_entry_point_gives_the_float_layouts_bits(
    builds: tuple[W4MM, W4MM], entry: str, n: int, k: int, g: int, symmetric: bool
) -> None:
    plain, compact = builds
    w = bf16_scaled(n, k, g, symmetric)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
    pf = W4MM.pack(w.values(), w.scale, w.zero, g)
    pc = W4MM.pack(w.values(), w.scale, w.zero, g, compact=True)
    for rows in (1, 3, 7, 17, 40):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert torch.equal(getattr(compact, entry)(x, pc, bias), getattr(plain, entry)(x, pf, bias))


@pytest.mark.parametrize("entry", ["silu_mul", "wide_silu_mul", "block_silu_mul"])
def test_the_fused_entries_give_the_float_layouts_bits(builds: tuple[W4MM, W4MM], entry: str) -> None:
    plain, compact = builds
    w = bf16_scaled(256, 128, 32, symmetric=False)
    pf, pc = W4MMSiluPath.pack(w), W4MMSiluPath.pack(w, compact=True)
    for rows in (1, 9, 33):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert torch.equal(getattr(compact, entry)(x, pc, None), getattr(plain, entry)(x, pf, None))


def test_a_build_refuses_the_other_layouts_copy(builds: tuple[W4MM, W4MM]) -> None:
    plain, compact = builds
    w = bf16_scaled(64, 64, 32, symmetric=True)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(ValueError, match="compact"):
        plain.direct(x, W4MMPath.pack(w, compact=True), None)
    with pytest.raises(ValueError, match="float"):
        compact.direct(x, W4MMPath.pack(w), None)


@pytest.mark.parametrize("wide", [False, True])
def test_the_grouped_calls_give_the_float_layouts_bits_and_take_only_bf16_scales(wide: bool) -> None:
    weights = [bf16_scaled(128, 96, 32, symmetric=False, seed=e) for e in range(4)]
    pick = w4mm.wide_kernel if wide else w4mm.kernel
    plain, compact = pick(), pick(True)  # type: ignore[operator]
    assert plain is not None and compact is not None and compact.compact
    counts = [2, 0, 1, 5]
    x = torch.randn(sum(counts), 96, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(GroupedQuantLinear(compact, weights)(x, counts), GroupedQuantLinear(plain, weights)(x, counts))
    float_scaled = [int4_weight(128, 96, 32, symmetric=False, seed=e) for e in range(4)]
    assert GroupedQuantLinear.accepts(plain, float_scaled) and not GroupedQuantLinear.accepts(compact, float_scaled)


def test_the_grouped_choices_offer_each_build_for_the_weights_scales() -> None:
    bf16_builds = _quant_grouped_builds(bf16_scaled(128, 96, 32, symmetric=True), torch.bfloat16)
    float_builds = _quant_grouped_builds(int4_weight(128, 96, 32, symmetric=True), torch.bfloat16)
    assert bf16_builds.keys() == float_builds.keys() and "grouped w4mm" in bf16_builds
    assert all(k.compact for k in bf16_builds.values())  # type: ignore[union-attr]
    assert not any(k.compact for k in float_builds.values())  # type: ignore[union-attr]


def test_a_path_packs_bf16_scales_compact_and_float_ones_as_they_are(builds: tuple[W4MM, W4MM]) -> None:
    plain, _ = builds
    exact, inexact = bf16_scaled(96, 128, 32, symmetric=False), int4_weight(96, 128, 32, symmetric=False)
    x = torch.randn(3, 128).bfloat16()
    for path in (W4MMPath(plain, "direct"), W4MMPath(plain, "panel")):
        for w, compact in ((exact, True), (inexact, False)):
            run = path.prepare(w, None, None)
            (packed,) = [
                c.cell_contents for c in run.call.__closure__ or () if isinstance(c.cell_contents, w4mm.PackedInt4)
            ]  # type: ignore[union-attr]
            assert packed.compact == compact
            want = w.reference(x, None)
            assert torch.allclose(run(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
            entry = run.entry  # type: ignore[attr-defined]
            assert entry is not None and entry.cols == 96  # a decode program calls the same build
    a, b = (W4MMPath(plain, e).prepare(exact, None, None) for e in ("direct", "wide"))
    assert packed_copies(a, w4mm.PackedInt4) == packed_copies(b, w4mm.PackedInt4)  # one copy for both entries
    fused = W4MMSiluPath(plain, "silu-mul").prepare(bf16_scaled(128, 128, 32, False), None, ActAndMul("silu"))
    (copy,) = [c.cell_contents for c in fused.call.__closure__ or () if isinstance(c.cell_contents, w4mm.PackedInt4)]  # type: ignore[union-attr]
    assert copy.compact


@pytest.mark.skipif(not w4vnni.supported(), reason="this CPU has no AVX512-VNNI")
def test_w4vnni_gives_the_float_layouts_bits_from_the_compact_copy() -> None:
    plain, compact = layout_builds(w4vnni)
    w = bf16_scaled(130, 256, 64, symmetric=False)
    pf, pc = W4MMPath.pack(w), W4MMPath.pack(w, compact=True)
    for rows in (1, 4, 11):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert torch.equal(compact.vnni(x, pc, None), plain.vnni(x, pf, None))
    run = W4VNNIPath(plain, "vnni").prepare(w, None, None)
    (packed,) = [c.cell_contents for c in run.call.__closure__ or () if isinstance(c.cell_contents, w4mm.PackedInt4)]  # type: ignore[union-attr]
    assert packed.compact
    counts = [1, 3]
    x = torch.randn(4, 256).bfloat16()
    ws = [w, bf16_scaled(130, 256, 64, symmetric=True, seed=1)]
    assert torch.equal(GroupedQuantLinear(compact, ws)(x, counts), GroupedQuantLinear(plain, ws)(x, counts))


@pytest.mark.parametrize(
    ("module", "supported", "entries", "fused"),
    [
        (w4amx, amxmm.supported, ("amx", "amx_dequant"), ("amx_silu_mul", "amx_dequant_silu_mul")),
        (w4fp16, w4fp16.supported, ("fp16",), ("fp16_silu_mul",)),
    ],
    ids=["w4amx", "w4fp16"],
)
def test_the_amx_and_fp16_builds_give_the_float_layouts_bits_from_the_compact_copy(
    module: Any, supported: Any, entries: tuple[str, ...], fused: tuple[str, ...]
) -> None:
    if not supported():
        pytest.skip(f"this CPU lacks what {module.__name__} needs")
    plain, compact = layout_builds(module)
    w = bf16_scaled(130, 256, 64, symmetric=False)
    pf, pc = W4MMPath.pack(w), W4MMPath.pack(w, compact=True)
    for rows in (1, 3, 17, 40):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        for name in entries:
            assert torch.equal(getattr(compact, name)(x, pc, None), getattr(plain, name)(x, pf, None)), (name, rows)
    g = bf16_scaled(256, 128, 32, symmetric=True)
    gf, gc = W4MMSiluPath.pack(g), W4MMSiluPath.pack(g, compact=True)
    x = torch.randn(5, 128).bfloat16()
    for name in fused:
        assert torch.equal(getattr(compact, name)(x, gc, None), getattr(plain, name)(x, gf, None)), name
    if hasattr(compact, "grouped_entry"):
        ws = [w, bf16_scaled(130, 256, 64, symmetric=True, seed=1)]
        x = torch.randn(6, 256).bfloat16()
        assert torch.equal(GroupedQuantLinear(compact, ws)(x, [2, 4]), GroupedQuantLinear(plain, ws)(x, [2, 4]))
