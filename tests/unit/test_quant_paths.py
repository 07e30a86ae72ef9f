"""Every quantized GEMM path equals the dequantize-then-matmul reference within float tolerance, and the
engine's measured selection binds them (or the reference where nothing faster runs)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.kernels.select import GemmSelector, _matches_reference
from engine.layers.activation import ActAndMul
from engine.quant.paths import Int4PackPath, IntMMPath, OneDNNInt8Path, QuantReferencePath, quant_paths
from engine.quant.weights import Int4Weight, Int8Weight, pack_nibbles, quantize_tokens

N, K, G = 96, 256, 128
ROWS = [1, 7, 33]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int8_weight(n: int = N, k: int = K) -> Int8Weight:
    q = torch.randint(-128, 128, (n, k), generator=_gen(0), dtype=torch.int8)
    return Int8Weight(q, torch.rand(n, generator=_gen(1)) * 0.02 + 1e-3)


def int4_weight(n: int = N, k: int = K, g: int = G, symmetric: bool = False) -> Int4Weight:
    values = torch.randint(0, 16, (n, k), generator=_gen(2))
    zero = torch.full((n, k // g), 8) if symmetric else torch.randint(0, 16, (n, k // g), generator=_gen(3))
    scale = torch.rand(n, k // g, generator=_gen(4)) * 0.05 + 1e-3
    return Int4Weight(pack_nibbles(values), scale, zero.to(torch.uint8), g)


def test_int8_reference_is_per_token_quantized_activations_times_the_dequantized_weight() -> None:
    w, x = int8_weight(), torch.randn(5, K, generator=_gen(5))
    scale = x.abs().amax(1, keepdim=True) / 127.5
    xq = torch.round(x / scale).clamp(-128, 127)
    assert torch.allclose(w.reference(x, None), (xq * scale) @ (w.q.float() * w.scale[:, None]).T, atol=1e-5)
    q, s = quantize_tokens(torch.zeros(2, K))
    assert bool((q == 0).all()) and bool(torch.isfinite(s).all())  # an all-zero token does not divide by zero


def test_int4_reference_dequantizes_per_group() -> None:
    w = int4_weight()
    v, z = w.values().float(), w.zero.float().repeat_interleave(G, 1)
    assert torch.equal(w.float(), (v - z) * w.scale.repeat_interleave(G, 1))


def _w8a8_paths() -> list:
    return [p for p in (OneDNNInt8Path(), IntMMPath()) if p.available]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_paths_equal_the_reference(dtype: torch.dtype, bias: bool) -> None:
    w = int8_weight()
    b = torch.randn(N, generator=_gen(6)) if bias else None
    paths = _w8a8_paths()
    assert paths, "neither oneDNN int8 nor torch._int_mm runs on this CPU"
    for path in [*paths, QuantReferencePath()]:
        assert path.accepts(w, None) and not path.accepts(torch.zeros(N, K), None)
        assert path.name == "torch-dequant" or not path.accepts(int4_weight(), None)
        run = path.prepare(w, b, None)
        for rows in ROWS:
            x = torch.randn(rows, K, generator=_gen(rows)).to(dtype)
            got, want = run(x), w.reference(x, b)
            assert got.dtype == dtype and got.shape == (rows, N)
            assert _matches_reference(run, x, w, b, None), path.name  # the selector's own check
            tol = 1e-4 if dtype == torch.float32 else 1e-2
            assert (got.float() - want).abs().max() <= tol * want.abs().max(), path.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "symmetric"), [(128, False), (32, True), (64, False)])
def test_int4pack_equals_the_reference(dtype: torch.dtype, group: int, symmetric: bool) -> None:
    path = Int4PackPath(dtype)
    assert path.available
    w, b = int4_weight(g=group, symmetric=symmetric), torch.randn(N, generator=_gen(7))
    assert path.accepts(w, None) and not path.accepts(int8_weight(), None)
    run = path.prepare(w, b, None)
    for rows in ROWS:
        x = torch.randn(rows, K, generator=_gen(rows)).to(dtype)
        got, want = run(x), w.reference(x, b)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert got.dtype == dtype and (got.float() - want).abs().max() <= tol * want.abs().max()


def test_int4pack_refuses_group_sizes_it_has_no_kernel_for() -> None:
    assert not Int4PackPath(torch.float32).accepts(int4_weight(g=16), None)
    assert not Int4PackPath(torch.float32).accepts(int4_weight(n=40), None)  # 16 output channels at a time
    assert QuantReferencePath().accepts(int4_weight(g=16), None)


def test_gated_act_runs_after_every_path() -> None:
    act = ActAndMul("silu")
    w = int4_weight(n=2 * 48)
    x = torch.randn(3, K, generator=_gen(8))
    want = act(w.reference(x, None))
    for path in quant_paths(torch.float32):
        if path.accepts(w, act):
            assert torch.allclose(path.prepare(w, None, act)(x), want, atol=1e-4), path.name


def test_three_dimensional_inputs_keep_their_leading_shape() -> None:
    w8, w4 = int8_weight(), int4_weight()
    x = torch.randn(2, 3, K, generator=_gen(9))
    for path in quant_paths(torch.float32):
        for w in (w8, w4):
            if path.accepts(w, None):
                assert path.prepare(w, None, None)(x).shape == (2, 3, N), path.name


class _Unavailable(IntMMPath):
    def __init__(self) -> None:
        self.available = False


def test_selector_measures_the_quantized_candidates_and_keeps_one_that_matches() -> None:
    paths = quant_paths(torch.float32)
    assert paths[-1].name == "torch-dequant"  # always there: a CPU without int8 / int4 kernels still runs
    sel = GemmSelector(paths, torch.float32, timer=lambda fn: (fn(), 1e-6)[1])
    w = int8_weight()
    choice = sel.choose("w8a8 test", [(w, None)], None)  # type: ignore[list-item]
    assert set(choice.per_class) <= {p.name for p in paths if p.accepts(w, None)}
    assert all(v < float("inf") for p in choice.per_class for v in choice.us[p][:1])


def test_without_fast_paths_the_reference_runs() -> None:
    sel = GemmSelector([_Unavailable(), QuantReferencePath()], torch.float32)
    w = int8_weight()
    choice = sel.choose("w8a8 only-ref", [(w, None)], None)  # type: ignore[list-item]
    assert set(choice.per_class) == {"torch-dequant"}


class _Wrong(QuantReferencePath):
    name = "wrong"

    def prepare(self, weight, bias, act):  # type: ignore[no-untyped-def]
        return lambda x: weight.reference(x, bias).to(x.dtype) * 1.01


def test_a_path_that_disagrees_with_the_reference_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    sel = GemmSelector([_Wrong(), QuantReferencePath()], torch.float32, timer=lambda fn: (fn(), 1e-6)[1])
    choice = sel.choose("w4 wrong", [(int4_weight(), None)], None)  # type: ignore[list-item]
    assert set(choice.per_class) == {"torch-dequant"} and choice.us["wrong"][0] == float("inf")


def test_a_w8a8_path_whose_products_saturate_is_not_a_candidate() -> None:
    """oneDNN's int8 GEMM on a CPU without VNNI sums u8 x s8 pairs into int16 with saturation: the path's
    availability checks exact products at the int8 extremes, not only that the op runs."""

    class Saturating(IntMMPath):
        name = "saturating"

        def products(self, weight: Int8Weight) -> Callable[[torch.Tensor], torch.Tensor]:
            wt = weight.q.t()
            return lambda xq: torch._int_mm(xq, wt).clamp(-32768, 32767).float()

    assert IntMMPath().available
    assert not Saturating().available


def test_a_w8a8_path_far_slower_than_float_matmul_is_not_a_candidate_and_is_probed_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """oneDNN's int8 GEMM ran a reference implementation on a Zen 4, ~2,000x a float32 matmul: timing it among
    the candidates at start cost minutes for a path that could never win. The probe's timings are faked here
    (under load from elsewhere real ones swing 40x); the decision and its caching are what is tested."""
    import engine.quant.paths as paths

    calls: list[int] = []

    def turns(ours: Callable[[], object], float_mm: Callable[[], object]) -> tuple[float, float]:
        ours(), float_mm()  # both really run: the probe's shapes and types are right
        calls.append(1)
        return 1.0, 0.01  # 100x a float32 matmul

    monkeypatch.setattr(paths, "_best_of_turns", turns)

    class Slow(IntMMPath):
        name = "slow-int8"

    class Fine(IntMMPath):
        name = "fine-int8"

    assert not Slow().available and len(calls) == 1
    assert not Slow().available and len(calls) == 1  # the verdict is kept for the process
    monkeypatch.setattr(paths, "_best_of_turns", lambda a, b: (a(), b(), calls.append(1), (0.02, 0.01))[-1])
    assert Fine().available and len(calls) == 2  # 2x a float32 matmul: a candidate, timed with the others
