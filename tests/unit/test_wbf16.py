"""The bf16-weight float32 kernel (engine.kernels.wbf16), compiled here with gcc, against torch."""

from __future__ import annotations

import ctypes
import logging
import platform
from pathlib import Path

import pytest
import torch

from engine.kernels import cbuild, wbf16
from engine.kernels.program import OP_GEMM, ProgramBuilder, address
from engine.kernels.wbf16 import BLAS_ROWS, WBF16, bf16_exact

X86 = platform.machine().lower() in ("x86_64", "amd64")
# -march=native takes the AVX-512 intrinsics where the CPU has them; a baseline target takes the generic
# vector code, which is what an AVX2-only x86 or an ARM server runs
FLAGS = [("-march=native",), *([("-march=x86-64",), ("-march=x86-64-v3",)] if X86 else [])]


@pytest.fixture(scope="module", params=FLAGS, ids=lambda f: f[0])
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> WBF16:
    mp = pytest.MonkeyPatch()
    mp.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path_factory.mktemp("kernels")))
    try:
        return WBF16.build(request.param)
    finally:
        mp.undo()


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 12, 13, 32, 33])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (63, 17), (64, 64), (65, 3), (200, 96)])
def test_linear_equals_float32_math(kernel: WBF16, m: int, n: int, k: int) -> None:
    w = _weight(n, k)
    x = torch.randn(m, k)
    b = torch.randn(n)
    packed = kernel.pack(w)
    torch.testing.assert_close(kernel.linear(x, packed, n, None), x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel.linear(x, packed, n, b), torch.addmm(b, x, w.t()), rtol=1e-5, atol=1e-5)


def test_large_batches_take_the_blas_path_with_the_same_result(kernel: WBF16) -> None:
    w, b = _weight(130, 48), torch.randn(130)
    x = torch.randn(BLAS_ROWS + 3, 48)
    torch.testing.assert_close(kernel.linear(x, kernel.pack(w), 130, b), torch.addmm(b, x, w.t()))


def test_pack_is_lossless(kernel: WBF16) -> None:
    w = _weight(131, 40)
    assert torch.equal(kernel.widen_t(kernel.pack(w), 131, 40), w.t())


def test_leading_dims_and_strided_inputs(kernel: WBF16) -> None:
    w = _weight(70, 32)
    x = torch.randn(3, 32, 5).transpose(1, 2)  # [3, 5, 32], not contiguous
    torch.testing.assert_close(kernel.linear(x, kernel.pack(w), 70, None), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_bf16_exact() -> None:
    w = _weight(8, 8)
    assert bf16_exact(w)
    w[3, 5] += 1e-3  # low mantissa bits set: bf16 storage would round it
    assert not bf16_exact(w)
    assert not bf16_exact(_weight(8, 8).bfloat16())  # only float32 tensors are candidates
    assert not bf16_exact(torch.empty(0))


def test_the_build_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path))
    WBF16.build()
    built = sorted(tmp_path.glob("wbf16-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    WBF16.build()
    assert sorted(tmp_path.glob("wbf16-*.so")) == built and built[0].stat().st_mtime_ns == mtime
    assert not list(tmp_path.glob(".*tmp"))


def test_without_a_compiler_the_engine_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(cbuild.BuildError, match="no-such-cc"):
        WBF16.build()
    wbf16.kernel.reset()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.kernels.wbf16"):
            assert wbf16.kernel() is None
    finally:
        wbf16.kernel.reset()  # the next caller builds with the real compiler again
    assert "widened to float32" in caplog.text and "gcc" in caplog.text


def test_a_compile_error_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path))
    bad = tmp_path / "bad.c"
    bad.write_text("int f( {")
    with pytest.raises(cbuild.BuildError, match=r"could not build bad\.c"):
        cbuild.build(bad)


def test_self_check_catches_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    k = wbf16.kernel()
    assert k is not None, "gcc is part of make setup's requirements: the kernel must build here"
    monkeypatch.setattr(k, "linear", lambda x, p, n, b: torch.zeros(x.shape[0], n))
    with pytest.raises(cbuild.SelfCheckError, match="self-check failed"):
        wbf16.self_check(k)


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 33, 70])  # 70: past a pass of wbf16.c's SR rows
@pytest.mark.parametrize(("n", "k", "bias"), [(64, 17, True), (192, 96, False), (128, 5, True)])
def test_fused_silu_mul_equals_float32_math(kernel: WBF16, m: int, n: int, k: int, bias: bool) -> None:
    """The gated MLP's [gate; up] projection with silu(gate) * up in the epilogue (its rows interleaved in blocks
    of 32 by the pack), against the unfused float32 torch code, on every build (AVX-512, AVX2, generic)."""
    fused = wbf16.SiluMulWBF16(kernel)
    w, x = _weight(n, k), torch.randn(m, k)
    b = torch.randn(n) if bias else None
    z = x @ w.t() + (b if b is not None else 0)
    gate, up = z.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    packed = fused.pack(w)
    got = fused.linear(x, packed, n, b)
    assert got.shape == (m, n // 2) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    entry = fused.c_entry(n, b, packed)  # what a decode program calls: the same entry, half the columns, f32 rows
    assert (entry.cols, entry.dtype) == (n // 2, torch.float32)
    builder = ProgramBuilder()
    entry.emit(builder, k, 111, 222)
    (op,) = builder.rows
    assert op[:2] == [OP_GEMM, address(fused.fn)] and op[4:10] == [n, k, 111, packed.data_ptr(), op[8], 222]


def test_fused_silu_mul_takes_blas_at_large_batches_with_the_same_result(kernel: WBF16) -> None:
    fused = wbf16.SiluMulWBF16(kernel)
    w, x, b = _weight(128, 40), torch.randn(BLAS_ROWS + 3, 40), torch.randn(128)
    gate, up = torch.addmm(b, x, w.t()).chunk(2, dim=-1)
    got = fused.linear(x, fused.pack(w), 128, b)
    assert torch.allclose(got, torch.nn.functional.silu(gate) * up, rtol=1e-4, atol=1e-4)
    assert torch.allclose(got[:7], fused.linear(x[:7], fused.pack(w), 128, b), rtol=1e-5, atol=1e-5)


def test_the_build_without_prefetch_computes_the_same_and_is_only_ever_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The AVX-512 tiles ask for the next block's weights (PF_TILES); built without it they give the same bits
    through the plain, fused and grouped entries, at row counts with 2-8 tiles a block (where it asks) and more.
    The selection times that build beside the other where it differs (AVX-512); a forced path never runs it."""
    from engine.kernels.bind import TIMED_ONLY, gemm_paths, make_selector

    monkeypatch.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path))
    with_pf, plain = WBF16.build(("-march=native",)), WBF16.build(("-march=native", "-DPF_TILES=1"))
    fused = {"with": wbf16.SiluMulWBF16(with_pf), "plain": wbf16.SiluMulWBF16(plain)}
    for i, (m, n, k) in enumerate(((7, 192, 96), (32, 320, 130), (40, 256, 64), (64, 128, 33))):
        x, w = torch.randn(m, k, generator=torch.Generator().manual_seed(i)), _weight(n, k, seed=10 + i)
        packed = with_pf.pack(w)
        assert torch.equal(with_pf.linear(x, packed, n, None), plain.linear(x, packed, n, None))
        assert torch.equal(fused["with"].linear(x, packed, n, None), fused["plain"].linear(x, packed, n, None))
        counts = (ctypes.c_int64 * 2)(m // 2, m - m // 2)
        weights = (ctypes.c_void_p * 2)(packed.data_ptr(), packed.data_ptr())
        ys = [torch.empty(m, n) for _ in range(2)]
        for kern, y in zip((with_pf, plain), ys, strict=True):
            kern.grouped(counts, n, k, x, weights, y, False)
        assert torch.equal(ys[0], ys[1])
    names = [p.name for p in gemm_paths(torch.float32, 1, True, True)]
    avx512 = "avx512f" in cbuild.cpu_flags()
    assert ("wbf16" + TIMED_ONLY in names) == avx512 and ("wbf16-silu" + TIMED_ONLY in names) == avx512
    forced = make_selector(gemm_paths(torch.float32, 1, True, True), torch.float32, forced="wbf16")
    assert not any(name.endswith(TIMED_ONLY) for name in forced.paths)
