"""The fused CPU kernels (engine.kernels.pointwise, engine.kernels.decode_attn), compiled here with gcc,
against the torch code they replace."""

from __future__ import annotations

import logging
import platform

import pytest
import torch

from engine.kernels import cbuild, decode_attn, pointwise
from engine.kernels.decode_attn import DecodeAttention, reference
from engine.kernels.pointwise import PointwiseKernels, apply_rotary, apply_rotary_interleaved, moe_combine, rms_norm

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def pw() -> PointwiseKernels:
    k = pointwise.kernel()
    assert k is not None, "gcc is part of make setup's requirements: the kernels must build here"
    return k


@pytest.fixture(scope="module", params=["plain", "prefetch"])
def attn(request: pytest.FixtureRequest) -> DecodeAttention:
    """Both builds the op choice times: without and with the next chunk's rows asked for ahead (PF_SPREAD)."""
    k = decode_attn.kernel() if request.param == "plain" else decode_attn.kernel_with_prefetch()
    assert k is not None, "gcc is part of make setup's requirements: the kernels must build here"
    return k


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- add + RMSNorm -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 896), (3, 17), (32, 896), (130, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_torch(
    pw: PointwiseKernels, dtype: torch.dtype, rows: int, dim: int, with_residual: bool
) -> None:
    x, r = _randn(rows, dim, seed=0, dtype=dtype), _randn(rows, dim, seed=1, dtype=dtype)
    w = (1 + 0.1 * _randn(dim, seed=2)).to(dtype)
    res = r if with_residual else None
    got, got_sum = pw.rms_norm(x, res, w, 1e-6)
    want, want_sum = rms_norm(x, res, w, 1e-6)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got_sum, want_sum)  # the residual stream is the same add, rounded the same way
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # the only freedom is the order of the float32 sum of squares: at most one bf16 step, rarely
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
        assert (got != want).float().mean() < 0.01


def _bf16_norm(pw: PointwiseKernels, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, in_place: bool) -> tuple:
    """rmsnorm_bf16 called as the decode programs call it (in place: the residual is also where its sum goes), or
    as PointwiseKernels.rms_norm does."""
    if not in_place:
        return pw.rms_norm(x, r, w, 1e-6)
    res, out = r.clone(), torch.empty_like(x)
    rows, dim = x.shape
    pw.lib.rmsnorm_bf16(rows, dim, x.data_ptr(), res.data_ptr(), w.data_ptr(), 1e-6, out.data_ptr(), res.data_ptr(), 2)
    return out, res


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("bad_weight", [False, True])
def test_bf16_rms_norm_rows_with_nan_inf_or_overflow_are_torchs(
    pw: PointwiseKernels, in_place: bool, bad_weight: bool
) -> None:
    """The bf16 kernel rounds without a NaN test (pointwise.c's rmsnorm_bf16 says why it needs none): rows with
    NaNs, infinities and overflows, and an infinite weight, also in place, end as torch computes them."""
    bf16, dim = torch.bfloat16, 100  # 6 vectors and a scalar tail of 4
    x, r = _randn(7, dim, seed=5, dtype=bf16), _randn(7, dim, seed=6, dtype=bf16)
    w = (1 + 0.1 * _randn(dim, seed=7)).to(bf16)
    x[1, 7] = float("nan")
    x[2, 98] = float("nan")  # in the scalar tail
    r[3, 20] = float("inf")
    x[4, 30] = 3e38  # a finite sum whose square overflows
    r[5, 40], x[5, 40] = 3e38, 3e38  # a sum that overflows to an infinity
    if bad_weight:
        w[9] = float("inf")
    got, got_sum = _bf16_norm(pw, x, r, w, in_place)
    want, want_sum = rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(got_sum.float(), want_sum.float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6, equal_nan=True)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())


@pytest.mark.parametrize("rows", [1, 130])
def test_bf16_rms_norm_in_place_equals_out_of_place(pw: PointwiseKernels, rows: int) -> None:
    x, r = _randn(rows, 896, seed=8, dtype=torch.bfloat16), _randn(rows, 896, seed=9, dtype=torch.bfloat16)
    w = (1 + 0.1 * _randn(896, seed=10)).to(torch.bfloat16)
    a, b = _bf16_norm(pw, x, r, w, True), _bf16_norm(pw, x, r, w, False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_rms_norm_takes_strided_input_and_3d(pw: PointwiseKernels) -> None:
    x = _randn(4, 64, 3, seed=3).transpose(1, 2)  # [4, 3, 64], not contiguous
    w = _randn(64, seed=4)
    got, _ = pw.rms_norm(x, None, w, 1e-5)
    torch.testing.assert_close(got, rms_norm(x, None, w, 1e-5)[0], rtol=1e-6, atol=1e-6)


def test_rms_norm_is_not_taken_for_mixed_dtypes(pw: PointwiseKernels) -> None:
    assert pw.takes(torch.empty(2, 8), torch.empty(8))
    assert not pw.takes(torch.empty(2, 8, dtype=torch.bfloat16), torch.empty(8))  # float32 weight, bf16 x
    assert not pw.takes(torch.empty(2, 8, dtype=torch.float16), torch.empty(8, dtype=torch.float16))


# ---- rotary embedding ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "d"), [(1, 16, 64), (33, 3, 128), (5, 2, 20), (200, 9, 64)])
def test_rotary_in_place_equals_torch(
    pw: PointwiseKernels, dtype: torch.dtype, tokens: int, heads: int, d: int
) -> None:
    """On q and k as the model holds them: a view into the fused qkv projection, token rows strided."""
    qkv = _randn(tokens, (heads + 1) * d, seed=9, dtype=dtype)
    qk = qkv[:, : heads * d].view(tokens, heads, d)
    cos, sin = (_randn(tokens, 1, d, seed=10 + i, dtype=dtype) for i in range(2))
    want = apply_rotary(qk, cos, sin)
    v_before = qkv[:, heads * d :].clone()
    got = pw.rotary(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()  # in place
    assert torch.equal(qkv[:, heads * d :], v_before)  # nothing outside q/k touched
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # the same products and sum, rounded the same way
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "d"), [(1, 16, 64), (32, 16, 64), (5, 3, 40), (300, 16, 64)])
def test_rotary_on_interleaved_pairs_in_place_equals_torch(
    pw: PointwiseKernels, dtype: torch.dtype, tokens: int, heads: int, d: int
) -> None:
    """On MLA's q_pe (the last d of each head's query, heads strided) and k_pe (the tail of the latent row)."""
    q = _randn(tokens, heads, 32 + d, seed=15, dtype=dtype)
    latent = _randn(tokens, 48 + d, seed=16, dtype=dtype)
    half = _randn(tokens, 1, d // 2, seed=17)
    angles = torch.cat((half, half), dim=-1)  # as RotaryEmbedding's table: each angle twice
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    for x, c, s in ((q[..., 32:], cos, sin), (latent[:, 48:], cos.squeeze(1), sin.squeeze(1))):
        want = apply_rotary_interleaved(x, c, s)
        before = (q[..., :32].clone(), latent[:, :48].clone())
        got = pw.rotary_interleaved(x, c, s)
        assert got.data_ptr() == x.data_ptr()  # in place
        assert torch.equal(q[..., :32], before[0]) and torch.equal(latent[:, :48], before[1])  # nothing else touched
        assert torch.equal(got, want)  # the same products and sums, rounded the same way (float32: no FMA)


def test_rotary_on_interleaved_pairs_falls_back_to_torch_where_it_does_not_take(pw: PointwiseKernels) -> None:
    x = _randn(4, 8, 6, seed=18).transpose(1, 2)  # each head strided
    cos, sin = _randn(4, 1, 6, seed=19), _randn(4, 1, 6, seed=20)
    torch.testing.assert_close(pw.rotary_interleaved(x, cos, sin), apply_rotary_interleaved(x, cos, sin))
    xb = _randn(4, 2, 6, seed=21, dtype=torch.bfloat16)  # float32 cos/sin with bf16 x
    torch.testing.assert_close(pw.rotary_interleaved(xb, cos, sin), apply_rotary_interleaved(xb, cos, sin))


def _routed(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.rand(tokens, experts, generator=g).softmax(-1).topk(k, dim=-1)
    return weights, ids.flatten().argsort(stable=True)  # expert-major, as MoE.forward orders its rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "experts", "k", "dim"), [(1, 16, 4, 1024), (32, 16, 4, 64), (7, 64, 6, 37),
                                                             (600, 16, 4, 64)])  # fmt: skip
@pytest.mark.parametrize("with_shared", [False, True])
def test_moe_combine_equals_torch(
    pw: PointwiseKernels, dtype: torch.dtype, tokens: int, experts: int, k: int, dim: int, with_shared: bool
) -> None:
    weights, order = _routed(tokens, experts, k, seed=22)
    ys = _randn(tokens * k, dim, seed=23, dtype=dtype) * 4
    shared = _randn(tokens, dim, seed=24, dtype=dtype) if with_shared else None
    want = moe_combine(ys, order, weights, shared, tokens)
    assert torch.equal(pw.moe_combine(ys, order, weights, shared, tokens), want)  # same roundings, same order


def test_moe_combine_of_some_rows_leaves_the_other_tokens_zero_or_shared(pw: PointwiseKernels) -> None:
    """An expert-parallel rank holds some experts: only their rows come, and tokens routed elsewhere get 0."""
    weights, order = _routed(9, 8, 2, seed=25)
    mine = order[5:11]
    ys = _randn(len(mine), 40, seed=26, dtype=torch.bfloat16)
    shared = _randn(9, 40, seed=27, dtype=torch.bfloat16)
    for sh in (None, shared):
        assert torch.equal(pw.moe_combine(ys, mine, weights, sh, 9), moe_combine(ys, mine, weights, sh, 9))
    none = pw.moe_combine(ys[:0], mine[:0], weights, None, 9)
    assert torch.equal(none, torch.zeros(9, 40, dtype=torch.bfloat16))


def test_rotary_falls_back_to_torch_for_layouts_it_does_not_take(pw: PointwiseKernels) -> None:
    x = _randn(4, 8, 3, seed=12).transpose(1, 2)  # heads not contiguous
    cos, sin = _randn(4, 1, 8, seed=13), _randn(4, 1, 8, seed=14)
    torch.testing.assert_close(pw.rotary(x, cos, sin), apply_rotary(x, cos, sin))
    xb = x.bfloat16()  # float32 cos/sin with bf16 x
    torch.testing.assert_close(pw.rotary(xb, cos, sin), apply_rotary(xb, cos, sin))


# ---- argmax --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("rows", "n"), [(1, 1), (1, 151936), (32, 151936), (5, 1000), (3, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_equals_torch(pw: PointwiseKernels, rows: int, n: int, dtype: torch.dtype) -> None:
    x = _randn(rows, n, seed=5).to(dtype)
    assert torch.equal(pw.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_ties_nan_and_infinities_as_torch(pw: PointwiseKernels, dtype: torch.dtype) -> None:
    x = _randn(6, 100, seed=6).to(dtype)
    x[0, 3] = x[0, 90] = 50.0  # a tie: the first wins
    x[1, 40] = float("nan")  # a NaN wins
    x[1, 60] = float("inf")
    x[2, 97] = float("nan")  # ... also in the scalar tail
    x[3] = float("-inf")  # all -inf: index 0
    x[4, 99] = float("inf")  # the maximum in the tail
    x[5, :] = 1.0  # all equal: index 0
    assert torch.equal(pw.argmax(x), x.argmax(dim=-1))


def test_argmax_of_bf16_logits_is_the_argmax_of_their_float32_widening(pw: PointwiseKernels) -> None:
    """Greedy rows read the LM head's bf16 output as it is (engine.sampler): bf16 rounds many logits to one value,
    so ties are common, and the first of them must win as it does over the widened copy."""
    x = (_randn(16, 151936, seed=8) * 4).bfloat16()
    assert torch.equal(pw.argmax(x), pw.argmax(x.float()))
    assert torch.equal(pw.argmax(x), x.float().argmax(dim=-1))


def test_greedy_sampler_uses_the_kernel_with_the_same_tokens(pw: PointwiseKernels) -> None:
    from engine.params import SamplingParams
    from engine.sampler import Sampler

    logits = _randn(8, 5000, seed=7)
    plain, fast = Sampler(), Sampler()
    fast.argmax = pw.argmax
    params = [SamplingParams(temperature=0)] * 8
    assert fast(logits, params, [None] * 8)[0] == plain(logits, params, [None] * 8)[0]


# ---- random sampling's inverse CDF -----------------------------------------------------------------------------
@pytest.mark.parametrize(("rows", "n"), [(1, 1), (32, 49152), (5, 1000), (3, 17)])
def test_sample_draws_what_inverse_cdf_draws(pw: PointwiseKernels, rows: int, n: int) -> None:
    from engine.sampler import inverse_cdf

    x = _randn(rows, n, seed=9) * 3
    for seed in range(4):
        u = torch.rand(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(pw.sample(x, u), inverse_cdf(x, u))


def test_sample_never_draws_a_masked_token_and_takes_the_ends(pw: PointwiseKernels) -> None:
    x = _randn(3, 300, seed=10)
    x[0, ::2] = float("-inf")  # every other token excluded
    x[1, :299] = float("-inf")  # one token left, the last (in the scalar tail of the blocks)
    x[2, 5:] = float("-inf")  # five left, the first block only
    for u in torch.linspace(0, 1 - 2**-53, 101, dtype=torch.float64):
        got = pw.sample(x, u.expand(3).contiguous())
        assert torch.isfinite(x.gather(1, got.unsqueeze(1))).all()
    assert pw.sample(x, torch.zeros(3, dtype=torch.float64)).tolist() == [1, 299, 0]  # the first with weight
    ends = pw.sample(x, torch.full((3,), 1 - 2**-53, dtype=torch.float64)).tolist()
    assert ends == [299, 299, 4]  # the last with weight


def test_random_sampler_uses_the_kernel_with_the_same_tokens(pw: PointwiseKernels) -> None:
    from engine.params import SamplingParams
    from engine.sampler import Sampler

    logits = _randn(8, 5000, seed=11)
    plain, fast = Sampler(), Sampler()
    fast.inverse_cdf = pw.sample
    params = [SamplingParams(temperature=0.7, seed=i) for i in range(8)]
    gens = [[torch.Generator().manual_seed(i) for i in range(8)] for _ in range(2)]
    assert fast(logits, params, gens[0])[0] == plain(logits, params, gens[1])[0]


def test_self_check_catches_a_wrong_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    k = pointwise.kernel()
    assert k is not None
    pointwise.check_sample(k)
    monkeypatch.setattr(k, "sample", lambda x, u: x.argmax(dim=-1))  # greedy, whatever u says
    with pytest.raises(cbuild.SelfCheckError, match="self-check failed for sampling"):
        pointwise.check_sample(k)


# ---- paged decode attention -----------------------------------------------------------------------------------
def _paged_case(
    b: int, h: int, kv: int, d: int, lens: list[int], dtype: torch.dtype, block: int = 16, seed: int = 8
) -> tuple[torch.Tensor, ...]:
    """Caches whose unused blocks hold NaN: reading anything past a sequence's context would show."""
    width = max(-(-n // block) for n in lens)
    num_blocks = b * width + 1
    kc, vc = (_randn(num_blocks, block, kv, d, seed=seed + i, dtype=dtype) for i in range(2))
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))
    tables = torch.full((b, width), num_blocks - 1, dtype=torch.int64)  # padding: the last (NaN) block
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block)
        tables[i, :nb] = order[used : used + nb]
        used += nb
        last = tables[i, nb - 1]
        kc[last, n - (nb - 1) * block :] = float("nan")  # past the context inside its last block
        vc[last, n - (nb - 1) * block :] = float("nan")
    kc[-1], vc[-1] = float("nan"), float("nan")
    q = _randn(b, h, d, seed=seed + 2, dtype=dtype)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "kv", "d"), [(14, 2, 64), (4, 4, 16), (8, 1, 128), (32, 2, 64), (6, 3, 32), (5, 1, 80)])
def test_decode_attention_equals_sdpa(attn: DecodeAttention, dtype: torch.dtype, h: int, kv: int, d: int) -> None:
    lens = [1, 15, 16, 17, 100, 33]
    q, kc, vc, tables, ctx = _paged_case(len(lens), h, kv, d, lens, dtype)
    got = attn(q, kc, vc, tables, ctx, d**-0.5)
    want = reference(q, kc, vc, tables, ctx, d**-0.5)
    assert got.dtype == dtype and torch.isfinite(got.float()).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # float32 inside, one rounding at the end
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3)


def test_decode_attention_long_context_and_peaked_scores(attn: DecodeAttention) -> None:
    """Several softmax chunks whose running maximum keeps moving, and scores far apart (exp underflow)."""
    q, kc, vc, tables, ctx = _paged_case(2, 4, 2, 64, [1000, 77], torch.float32, seed=11)
    q *= 30
    got = attn(q, kc, vc, tables, ctx, 0.125)
    torch.testing.assert_close(got, reference(q, kc, vc, tables, ctx, 0.125), rtol=1e-5, atol=1e-5)


def test_decode_attention_takes_only_shapes_it_is_written_for(attn: DecodeAttention) -> None:
    assert attn.takes(14, 2, 64, torch.bfloat16) and attn.takes(32, 32, 128, torch.float32)
    assert not attn.takes(14, 2, 72, torch.float32)  # head_dim not a multiple of 16
    assert not attn.takes(40, 2, 64, torch.float32)  # 20 query heads per KV head
    assert not attn.takes(14, 2, 64, torch.float16)


# ---- build failures --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", [pointwise, decode_attn], ids=["pointwise", "decode_attn"])
def test_without_a_compiler_the_engine_says_what_to_install(
    module: object, tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    once: cbuild.Once = module.kernel  # type: ignore[attr-defined]
    once.reset()
    try:
        with caplog.at_level("WARNING"):
            assert once() is None
            assert once() is None  # said once, not at every call
        assert caplog.text.count("gcc") == 1 and "no-such-cc" in caplog.text
    finally:
        once.reset()


@pytest.mark.parametrize("module", [pointwise, decode_attn], ids=["pointwise", "decode_attn"])
def test_self_check_catches_a_wrong_kernel(module: object, monkeypatch: pytest.MonkeyPatch) -> None:
    k = module.kernel()  # type: ignore[attr-defined]
    module.self_check(k)  # type: ignore[attr-defined]
    if isinstance(k, PointwiseKernels):
        monkeypatch.setattr(k, "argmax", lambda x: torch.zeros(x.shape[0], dtype=torch.int64))
    else:
        monkeypatch.setattr(DecodeAttention, "__call__", lambda self, q, *args: torch.zeros_like(q))
    with pytest.raises(cbuild.SelfCheckError, match="self-check failed"):
        module.self_check(k)  # type: ignore[attr-defined]


def test_a_kernel_that_fails_its_self_check_is_not_used_and_the_warning_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def wrong() -> object:
        raise cbuild.SelfCheckError("self-check failed for argmax")

    once = cbuild.Once(wrong, logging.getLogger("engine.kernels.test"), "argmax will run in torch")
    with caplog.at_level("WARNING"):
        assert once() is None
    assert "not used" in caplog.text and "lscpu" in caplog.text and "gcc" not in caplog.text


@pytest.mark.parametrize("flags", [("-march=x86-64",), ("-march=x86-64-v3",)], ids=["x86-64", "x86-64-v3"])
@pytest.mark.parametrize("cls", [PointwiseKernels, DecodeAttention], ids=["pointwise", "decode_attn"])
def test_the_portable_code_is_right_without_avx512(
    cls: type, flags: tuple[str, ...], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernels are GCC vector extensions, no intrinsics: built for a baseline x86 (SSE2) or AVX2 target, as
    on CPUs without AVX-512 (and, the same way, on ARM), they must give the same answers."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 -march targets")
    monkeypatch.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path))
    k = cls.build(flags)  # type: ignore[attr-defined]
    (pointwise if cls is PointwiseKernels else decode_attn).self_check(k)
