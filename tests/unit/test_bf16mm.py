"""The AVX512-BF16 GEMM (engine.kernels.bf16mm), compiled here with gcc, against float32 math rounded to bf16:
both builds, VDPBF16PS's tiles and the float32 FMA ones (FMA32, "bf16fma"), over the same packed weights.

It exists only for CPUs with AVX512-BF16 (the engine uses oneDNN elsewhere), so these tests run where the CPU
has it: Zen 4 and Intel from Cooper Lake on."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.kernels import bf16mm
from engine.kernels.bf16mm import BF16MM, SiluMulBF16MM
from engine.kernels.cbuild import SelfCheckError
from engine.kernels.gemm import interleave_halves
from engine.layers.mlp import GatedMLP
from tests.kernel_checks import assert_fused_silu_equals_unfused
from tests.kernel_checks import bf16 as _bf16

pytestmark = pytest.mark.skipif(not bf16mm.supported(), reason="this CPU has no AVX512-BF16")


BUILDS = {"vdpbf16ps": (), "fma32": ("-DFMA32",)}


@pytest.fixture(scope="module", params=list(BUILDS))
def flags(request: pytest.FixtureRequest) -> tuple[str, ...]:
    return ("-march=native", *BUILDS[request.param])


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory, flags: tuple[str, ...]) -> BF16MM:
    mp = pytest.MonkeyPatch()
    mp.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path_factory.mktemp("kernels")))
    try:
        return BF16MM.build(flags)
    finally:
        mp.undo()


def _assert_rounded_float32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """bf16 x bf16 products are exact in float32, so the only freedom is the order of the float32 sums: the
    result is float32's rounded to bf16, give or take one bf16 step where a sum lies near a rounding boundary."""
    want32 = x.float() @ w.float().t() + (b.float() if b is not None else 0)
    want = want32.bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    off = got.float() != want.float()
    step = (want.float().abs() * 2.0**-7).clamp_min(2.0**-126)  # one bf16 ulp (8 significant bits) or more
    # plus what reordering K float32 sums may move a result by (|error| <= K u sum|x w|, u = 2^-24): at a sum
    # that nearly cancels, that exceeds an ulp of the small result (seen at 400 x 130 x 895)
    k = x.shape[-1]
    slack = (x.float().abs() @ w.float().abs().t()) * k * 2.0**-24
    assert ((got.float() - want32).abs() <= step + slack).all(), (got.float() - want32).abs().max()
    assert off.float().mean() < 0.05  # most entries are exactly float32's, rounded once


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 32, 33, 191, 192, 193, 400])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (63, 17), (64, 64), (65, 3), (200, 96), (130, 895)])
def test_linear_is_float32_math_rounded_to_bf16(kernel: BF16MM, m: int, n: int, k: int) -> None:
    w, x, b = _bf16(n, k, seed=0), _bf16(m, k, seed=1), _bf16(n, seed=2)
    packed = kernel.pack(w)
    _assert_rounded_float32(kernel.linear(x, packed, n, None), x, w, None)
    _assert_rounded_float32(kernel.linear(x, packed, n, b), x, w, b)


def test_odd_k_never_reads_past_a_row(kernel: BF16MM) -> None:
    """An odd K's last pair is padded with a zero weight; the next row's first value must not enter it, or an
    inf there would turn into NaN (inf x 0)."""
    w = _bf16(64, 5, seed=3)
    x = _bf16(4, 6, seed=4)
    x[:, 5] = float("inf")
    got = kernel.linear(x[:, :5], kernel.pack(w), 64, None)  # rows of 5 inside rows of 6: strided
    assert torch.isfinite(got.float()).all()
    _assert_rounded_float32(got, x[:, :5], w, None)


def test_leading_dims_strided_and_float_bias(kernel: BF16MM) -> None:
    w, b = _bf16(70, 32, seed=5), torch.randn(70)
    x = _bf16(3, 32, 5, seed=6).transpose(1, 2)  # [3, 5, 32], not contiguous
    got = kernel.linear(x, kernel.pack(w), 70, b)
    assert got.shape == (3, 5, 70)
    _assert_rounded_float32(got.reshape(15, 70), x.reshape(15, 32), w, b.bfloat16())


def test_nan_and_inf_propagate(kernel: BF16MM) -> None:
    w, x = _bf16(70, 8, seed=7), _bf16(2, 8, seed=8)
    x[0, 3], x[1, 2] = float("nan"), float("inf")
    got = kernel.linear(x, kernel.pack(w), 70, None).float()
    assert got[0].isnan().all()  # the column tail (70 = 64 + 6) is rounded in C, the rest by the CPU
    assert not torch.isfinite(got[1]).any()


def test_pack_keeps_every_weight(kernel: BF16MM) -> None:
    """Identity rows pick each weight back out: packing loses and reorders nothing."""
    w = _bf16(131, 41, seed=9)
    got = kernel.linear(torch.eye(41, dtype=torch.bfloat16), kernel.pack(w), 131, None)
    assert torch.equal(got, w.t())


def test_self_check_catches_a_wrong_kernel(kernel: BF16MM, monkeypatch: pytest.MonkeyPatch) -> None:
    bf16mm.self_check(kernel)
    monkeypatch.setattr(kernel, "linear", lambda x, p, n, b: torch.zeros(x.shape[0], n, dtype=torch.bfloat16))
    with pytest.raises(SelfCheckError, match="self-check failed"):
        bf16mm.self_check(kernel)


def test_no_avx512_bf16_means_onednn_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert bf16mm.kernel() is None
    assert not caplog.records  # nothing to fix: this CPU has no faster path for bf16


@pytest.mark.parametrize("m", [1, 7, 32, 200])
@pytest.mark.parametrize(("inter", "k"), [(32, 64), (160, 33), (4864 // 8, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_silu_mul_equals_the_unfused_torch_code(
    kernel: BF16MM, m: int, inter: int, k: int, with_bias: bool
) -> None:
    assert_fused_silu_equals_unfused(kernel, SiluMulBF16MM(kernel), m, inter, k, with_bias)


def test_interleave_halves_alternates_blocks_of_32() -> None:
    rows = torch.arange(128)
    assert interleave_halves(rows).tolist() == [*range(0, 32), *range(64, 96), *range(32, 64), *range(96, 128)]


@pytest.mark.parametrize(("inter", "fused"), [(64, True), (48, False)])
def test_gated_mlp_fuses_silu_only_where_the_kernel_takes_the_weight(kernel: BF16MM, inter: int, fused: bool) -> None:
    """An intermediate size that is not a multiple of 32 keeps the unfused path: gate_up runs through the plain
    kernel and the SiLU in torch."""
    from engine.kernels.bind import make_selector, plan_linears
    from engine.kernels.gemm import FusedSiluPath, KernelPath, OneDNNPath

    mlp = GatedMLP(32, inter, "silu").to(torch.bfloat16)
    for p in mlp.parameters():
        p.data.normal_(0, 0.2)
    x = _bf16(5, 32, seed=13)
    want = mlp(x)
    paths = [FusedSiluPath(SiluMulBF16MM(kernel)), KernelPath("bf16mm", kernel, torch.bfloat16)]
    assert paths[0].accepts(mlp.gate_up_proj.weight, mlp.act) is fused
    plan_linears(mlp, make_selector([*paths, OneDNNPath(torch.bfloat16, 8)], torch.bfloat16, forced="bf16mm"))
    assert mlp.gate_up_act is not None and mlp.down_proj.plan is not None
    assert set(mlp.gate_up_act.names) == {"bf16mm-silu" if fused else "bf16mm"}
    assert set(mlp.down_proj.plan.names) == {"bf16mm"}
    torch.testing.assert_close(mlp(x).float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_build_without_prefetch_computes_the_same_and_is_only_ever_timed(
    kernel: BF16MM, flags: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.kernels.bind import TIMED_ONLY, gemm_paths, make_selector

    monkeypatch.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path))
    plain = BF16MM.build((*flags, "-DPF_TILES=1"))
    for i, (m, n, k) in enumerate(((1, 192, 96), (16, 640, 130), (40, 200, 64))):  # 2-8 row tiles: it prefetches
        x, w = _bf16(m, k, seed=i), _bf16(n, k, seed=10 + i)
        assert torch.equal(plain.linear(x, plain.pack(w), n, None), kernel.linear(x, kernel.pack(w), n, None))
    names = [p.name for p in gemm_paths(torch.bfloat16, 1, True, True)]
    assert "bf16mm" + TIMED_ONLY in names and "bf16mm-silu" + TIMED_ONLY in names
    forced = make_selector(gemm_paths(torch.bfloat16, 1, True, True), torch.bfloat16, forced="bf16mm")
    assert not any(name.endswith(TIMED_ONLY) for name in forced.paths)


def test_the_fma_build_computes_float32_sums_and_shares_the_packed_weights() -> None:
    """bf16fma is timed beside bf16mm over one packed copy (layout "bf16mm"), forced by its own name; its sums are
    float32's (products exact, fp32 adds), so at one k it gives float32's result rounded once, the same bits as
    VDPBF16PS's build; over many k both stay within bf16 rounding of float32 (the test above)."""
    from engine.kernels.bind import gemm_paths, make_selector
    from engine.kernels.op_choice import grouped_kernels

    paths = {p.name: p for p in gemm_paths(torch.bfloat16, 1, True, True)}
    assert paths["bf16fma"].layout == "bf16mm" and paths["bf16fma-silu"].layout == "bf16mm-silu"
    assert "bf16fma" in grouped_kernels(torch.bfloat16)
    forced = make_selector(list(paths.values()), torch.bfloat16, forced="bf16fma")
    assert set(list(forced.paths)[:2]) == {"bf16fma", "bf16fma-silu"}  # the forced family first
    dp, fma = bf16mm.kernel(), bf16mm.kernel_fma32()  # (not the fixture's: one run, the two builds against each other)
    assert dp is not None and fma is not None
    w, x = _bf16(130, 2, seed=20), _bf16(7, 2, seed=21)  # one k-pair: one rounding either way
    packed = dp.pack(w)
    assert torch.equal(fma.linear(x, packed, 130, None), dp.linear(x, packed, 130, None))
