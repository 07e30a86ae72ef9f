"""engine.kernels.op_choice: a kernel beside the GEMMs is bound only where it beats the torch code."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.context import AttentionContext
from engine.kernels import amxmm, decode_attn_amx, pointwise
from engine.kernels.decode_attn import DecodeAttention
from engine.kernels.op_choice import (
    PREFILL_LENGTHS,
    absorbed_gemm,
    absorbed_gemm_wins,
    attention_probe,
    choose_decode_attention,
    choose_kernels,
    decode_attention_kernels,
    faster,
    fastest,
    grouped_experts_win,
    latent_attention_wins,
    prefill_in_place_limit,
    prefill_probe,
)
from engine.kernels.select import PlanCache, Timer
from engine.layers.attention import PagedAttention
from engine.layers.mla import MLAttention
from engine.layers.moe import MoE, MoEGate


def quiet() -> bool:  # the machine is never busy for these tests
    return False


def _timer(slow: Callable[[], object]) -> Callable[[Callable[[], object]], float]:
    """A fake timer: `slow` takes 1 s, anything else 1 ms."""
    return lambda fn: 1.0 if fn is slow else 1e-3


def test_the_faster_side_wins_and_the_answer_is_cached(tmp_path: Path) -> None:
    ours, theirs = (lambda: None), (lambda: None)
    cache = PlanCache(tmp_path, "k", quiet)
    assert faster("op x", ours, theirs, _timer(theirs), cache)
    assert not faster("op y", ours, theirs, _timer(ours), cache)
    again = PlanCache(tmp_path, "k", quiet)
    assert faster("op x", ours, theirs, _timer(ours), again)  # cached: the new timer is not asked
    assert not faster("op y", ours, theirs, _timer(theirs), again)


def test_no_timer_means_forced_on() -> None:
    assert faster("op", lambda: None, lambda: None, None, None)


def test_kernels_measured_slower_are_not_bound() -> None:
    pw = pointwise.kernel()
    if pw is None:
        pytest.skip("the pointwise kernels did not build here (the warning says why)")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    from engine.layers.norm import RMSNorm

    model.append(RMSNorm(64, 1e-6))
    slow_kernel = choose_kernels(model, pw, {}, torch.float32, lambda fn: 1.0, None)
    assert slow_kernel.rms_norm is None  # every call "takes" 1 s: a tie is not a win
    forced = choose_kernels(model, pw, {}, torch.float32, None, None)
    assert forced.rms_norm is pw and forced.decode_attn is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_timing_runs_every_path_to_the_same_answer(dtype: torch.dtype) -> None:
    """The probe decodes through each kernel and through SDPA; all must give the same output, or the timing
    compares different work."""
    kernels = decode_attention_kernels()
    if not kernels:
        pytest.skip("no decode attention kernel built here (the warning says why)")
    layer = PagedAttention(8, 2, 64, 64**-0.5)
    run = attention_probe(layer, dtype)
    want = run(None)().float()  # type: ignore[attr-defined]
    for k in kernels.values():
        if k.takes(8, 2, 64, dtype, 16):
            torch.testing.assert_close(run(k)().float(), want, rtol=2e-2, atol=2e-2)  # type: ignore[attr-defined]


def test_the_fastest_of_several_wins_a_tie_keeps_the_first_and_the_cache_remembers(tmp_path: Path) -> None:
    a, b, c = (lambda: None), (lambda: None), (lambda: None)
    cache = PlanCache(tmp_path, "k", quiet)
    times = {a: 3e-3, b: 1e-3, c: 2e-3}
    assert fastest("op three", {"a": a, "b": b, "c": c}, lambda fn: times[fn], cache) == "b"
    assert fastest("op tie", {"a": a, "b": b}, lambda fn: 1e-3, cache) == "a"
    assert fastest("op forced", {"a": a, "b": b}, None, cache) == "a"
    again = PlanCache(tmp_path, "k", quiet)
    assert fastest("op three", {"a": a, "b": b, "c": c}, lambda fn: 1.0 if fn is b else 1e-3, again) == "b"


def _kernel_of(step: Callable[[], object]) -> DecodeAttention | None:
    """Which kernel a probe step (op_choice.attention_probe) runs: None for gather + SDPA."""
    return step.kernel  # type: ignore[attr-defined]


def test_decode_attention_takes_the_fastest_kernel_and_none_when_torch_wins() -> None:
    kernels = decode_attention_kernels()
    if not kernels:
        pytest.skip("no decode attention kernel built here (the warning says why)")
    layer = PagedAttention(8, 2, 64, 64**-0.5)
    dtype = torch.bfloat16
    for k in kernels.values():  # each kernel in turn made the only fast one
        assert (
            choose_decode_attention(
                kernels, layer, dtype, 16, lambda fn, k=k: 1e-3 if _kernel_of(fn) is k else 1.0, None
            )
            is k
        )
    torch_fastest = lambda fn: 1e-3 if _kernel_of(fn) is None else 1.0  # noqa: E731
    assert choose_decode_attention(kernels, layer, dtype, 16, torch_fastest, None) is None
    assert choose_decode_attention(kernels, layer, dtype, 16, None, None) is next(iter(kernels.values()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_in_place_gives_sdpa_causal_prefill_answer(dtype: torch.dtype) -> None:
    """A prompt's tokens attending as decode rows (each row's context ending at its own token) must give what
    SDPA's causal prefill gives, or the timing compares different work."""
    kernels = decode_attention_kernels()
    if not kernels:
        pytest.skip("no decode attention kernel built here (the warning says why)")
    layer = PagedAttention(8, 2, 64, 64**-0.5)
    for tokens in (1, 17, 40):
        run = prefill_probe(layer, dtype, tokens)
        want = run(None)().float()  # type: ignore[attr-defined]
        for k in kernels.values():
            if k.takes(8, 2, 64, dtype, 16):
                torch.testing.assert_close(run(k)().float(), want, rtol=2e-2, atol=2e-2)  # type: ignore[attr-defined]


def test_prefill_in_place_goes_up_to_the_longest_length_it_won_at_every_step() -> None:
    kernels = decode_attention_kernels()
    if not kernels:
        pytest.skip("no decode attention kernel built here (the warning says why)")
    k = next(iter(kernels.values()))
    layer, dtype = PagedAttention(8, 2, 64, 64**-0.5), torch.bfloat16
    probed: list[int] = []

    def timer_losing_from(tokens: int) -> Callable[[Callable[[], object]], float]:
        def timer(fn: Callable[[], object]) -> float:
            return 1e-3 if (_kernel_of(fn) is None) == (current[0] >= tokens) else 1.0

        return timer

    current = [0]
    original = prefill_probe

    def counting_probe(attention: PagedAttention, d: torch.dtype, tokens: int):  # type: ignore[no-untyped-def]
        current[0] = tokens
        probed.append(tokens)
        return original(attention, d, tokens)

    import engine.kernels.op_choice as op_choice

    mp = pytest.MonkeyPatch()
    mp.setattr(op_choice, "prefill_probe", counting_probe)
    try:
        assert prefill_in_place_limit(k, layer, dtype, timer_losing_from(512), None) == 128
        assert probed == [32, 128, 512]  # no longer length is timed once one lost
        assert prefill_in_place_limit(k, layer, dtype, timer_losing_from(32), None) == 0
        assert prefill_in_place_limit(k, layer, dtype, timer_losing_from(10**6), None) == PREFILL_LENGTHS[-1]
    finally:
        mp.undo()
    assert prefill_in_place_limit(k, layer, dtype, None, None) == PREFILL_LENGTHS[-1]  # forced: always in place


def _marking(monkeypatch: pytest.MonkeyPatch, cls: type) -> Callable[[Callable[[], object]], float]:
    """`cls`'s calls leave a mark; the fake timer returned says 1 ms for a candidate that ran it, 1 s for any
    other."""
    marks: list[bool] = []
    original = cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, *a: marks.append(True) or original(self, *a))

    def kernel_fast(fn: Callable[[], object]) -> float:
        marks.clear()
        fn()
        return 1e-3 if marks else 1.0

    return kernel_fast


def _bound_only_when_faster(monkeypatch: pytest.MonkeyPatch, cls: type, wins: Callable[[Timer], bool]) -> None:
    """`wins(timer)` says yes when `cls`'s calls are the fast ones, and no when they are the slow ones."""
    kernel_fast = _marking(monkeypatch, cls)
    assert wins(kernel_fast)
    assert not wins(lambda fn: 1.0 - 0.999 * kernel_fast(fn))


@pytest.mark.skipif(not amxmm.supported(), reason="this CPU has no AMX tiles: no grouped experts kernel")
def test_grouped_experts_are_bound_only_where_they_beat_a_gemm_per_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = amxmm.kernel()
    assert kernel is not None
    moe = MoE(MoEGate(64, 8, 2, "softmax", 1, 1, False, 1.0), 64, 32, 0, "silu")
    _bound_only_when_faster(monkeypatch, amxmm.GroupedExperts,
                            lambda t: grouped_experts_win(kernel, moe, torch.bfloat16, t, None))  # fmt: skip
    assert not grouped_experts_win(kernel, moe, torch.float32, None, None)  # bf16 math only
    assert grouped_experts_win(kernel, moe, torch.bfloat16, None, None)  # forced


MLA = (64, 4, None, 64, 32, 32, 32, False, 0.2, False)  # hidden, heads, q_lora, latent, nope, rope, v, ...


# each with an MLA shape that does not fit it: latent + rope = 72 (not whole tiles); nope 16 (K of W_UK)
@pytest.mark.skipif(not amxmm.supported(), reason="this CPU has no AMX tiles: no latent decode or grouped GEMM")
@pytest.mark.parametrize(
    ("wins", "cls", "narrow"),
    [
        (latent_attention_wins, decode_attn_amx.AMXDecodeAttention, (64, 4, None, 64, 32, 8, 32, False, 0.2, False)),
        (absorbed_gemm_wins, amxmm.GroupedLinear, (64, 4, None, 64, 16, 32, 16, False, 0.2, False)),
    ],
    ids=["latent attention vs gather + SDPA", "grouped W_UK / W_UV vs bmm"],
)
def test_an_mla_kernel_is_bound_only_where_it_fits_and_is_faster(
    monkeypatch: pytest.MonkeyPatch, wins: Callable[..., bool], cls: type, narrow: tuple
) -> None:
    kernel = decode_attn_amx.kernel() if wins is latent_attention_wins else amxmm.kernel()
    assert kernel is not None
    mla = MLAttention(*MLA)
    _bound_only_when_faster(monkeypatch, cls, lambda t: wins(kernel, mla, torch.bfloat16, t, None))
    assert not wins(kernel, MLAttention(*narrow), torch.bfloat16, None, None)  # forced, yet it does not fit
    if wins is absorbed_gemm_wins:
        assert absorbed_gemm(kernel)(MLAttention(*narrow)) is None  # type: ignore[arg-type]


@pytest.mark.skipif(not amxmm.supported(), reason="this CPU has no AMX tiles: no grouped GEMM")
def test_mla_decode_with_the_grouped_products_equals_bmm() -> None:
    """The decode path alone: the same layer, its latent cache and query, with and without the grouped calls."""
    kernel = amxmm.kernel()
    assert kernel is not None
    torch.manual_seed(0)
    mla = MLAttention(*MLA).to(torch.bfloat16)
    mla.kv_b_proj.weight.data.normal_()
    rows, per_seq = 5, 2
    mla.kv_cache = torch.randn(rows * per_seq + 1, 16, 64 + 32).bfloat16()
    mla.scratch = torch.empty(0, dtype=torch.bfloat16)
    tables = torch.arange(rows * per_seq).view(rows, per_seq)
    lens = torch.tensor([1, 9, 16, 17, 32])
    mask = torch.full((rows, 1, 1, 32), float("-inf")).masked_fill(torch.arange(32) < lens[:, None, None, None], 0)
    ctx = AttentionContext(tables[:, -1] * 16, rows, tables, mask.bfloat16(), [], lens)
    q_nope, q_pe = torch.randn(rows, 4, 32).bfloat16(), torch.randn(rows, 4, 32).bfloat16()
    plain = mla._decode(q_nope, q_pe, ctx)
    mla.absorbed = absorbed_gemm(kernel)(mla)
    assert mla.absorbed is not None
    torch.testing.assert_close(mla._decode(q_nope, q_pe, ctx).float(), plain.float(), rtol=2e-2, atol=2e-2)
