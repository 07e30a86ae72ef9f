"""engine.quant.grouped: a MoE layer's quantized experts in two kernel calls (w4mm's grouped entry for W4A16, or
w4amx's on AMX CPUs, i8mm's for W8A8) give what that kernel's call per expert and projection (the GEMM plans they
replace) gives, and a quantized DeepSeek takes them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import EngineCore
from engine.kernels import bf16mm, i8amx, i8mm, op_choice, w4amx, w4mm, w4vnni
from engine.kernels.grouped import GroupedLinear
from engine.layers.activation import ActAndMul
from engine.layers.moe import MoE
from engine.quant.absorbed_key import GroupScaledKey, key_pieces
from engine.quant.grouped import GroupedQuantExperts, GroupedQuantLinear
from engine.quant.paths import I8MMPath, W4AMXPath, W4MMPath, W4VNNIPath
from engine.quant.quantize import quantize
from tests.int4_kernels import int4_weight
from tests.int8_kernels import int8_weight
from tests.parity import test_deepseek
from tests.parity.conftest import make_core, mixed_prompts, step_logits
from tests.parity.test_deepseek import build_deepseek

# bf16 rows in and out: the CPU needs AVX512-BF16 (and VNNI for i8mm)
pytestmark = pytest.mark.skipif(not bf16mm.supported(), reason="the grouped quantized calls need AVX512-BF16")

HIDDEN, INNER, GROUP = 128, 64, 32
SCHEMES = ["w4a16", "w8a8"]
# a scheme, and "-amx" for its AMX kernel (AMX CPUs only), "-vnni" for w4vnni (AVX512-VNNI CPUs), "-wide" for
# w4mm's grouped call through its wide tiles
KERNELS = ["w4a16", "w4a16-wide", "w4a16-vnni", "w4a16-amx", "w8a8", "w8a8-amx"]
Kernel = w4mm.W4MM | w4vnni.W4VNNI | w4amx.W4AMX | i8mm.I8MM | i8amx.I8AMX


def _kernel(name: str) -> Kernel:
    makers = {"w4a16": w4mm.kernel, "w4a16-vnni": w4vnni.kernel, "w4a16-amx": w4amx.kernel, "w8a8": i8mm.kernel}
    makers |= {"w8a8-amx": i8amx.kernel, "w4a16-wide": w4mm.wide_kernel}
    kernel = makers[name]()
    if kernel is None:
        pytest.skip(f"no {name} kernel on this CPU")
    return kernel


def _weight(scheme: str, n: int, k: int, seed: int, symmetric: bool = False):  # type: ignore[no-untyped-def]
    return int4_weight(n, k, GROUP, symmetric, seed) if scheme == "w4a16" else int8_weight(n, k, seed)


def _experts(scheme: str, e: int, symmetric: bool = False) -> tuple[list, list]:
    gate_up = [_weight(scheme, 2 * INNER, HIDDEN, 10 + i, symmetric) for i in range(e)]
    return gate_up, [_weight(scheme, HIDDEN, INNER, 50 + i, symmetric) for i in range(e)]


def _per_expert_path(kernel: Kernel) -> W4MMPath | W4AMXPath | I8MMPath:
    if isinstance(kernel, w4amx.W4AMX):
        return W4AMXPath(kernel, "amx")  # the same per-block code as its grouped call
    if isinstance(kernel, w4vnni.W4VNNI):
        return W4VNNIPath(kernel, "vnni")
    return W4MMPath(kernel, "direct") if isinstance(kernel, w4mm.W4MM) else I8MMPath(kernel)  # i8amx: its `linear`


_CHOOSE = op_choice.choose_quant_experts  # the real choice, which the tests below run under a timer of theirs


def _timed_core(
    monkeypatch: pytest.MonkeyPatch, path: Path, timer: Callable[[object], float] | None, **cfg: object
) -> tuple[EngineCore, list[MoE]]:
    """An engine on `path` whose experts' choice ran under `timer` (None: untimed, the first candidate), and its
    MoE layers."""
    monkeypatch.setattr(op_choice, "choose_quant_experts", lambda moe, dtype, *_: _CHOOSE(moe, dtype, timer, None))
    core = make_core(path, **cfg)
    return core, [m for m in core.runner.model.modules() if isinstance(m, MoE)]


# every expert a few rows; empty experts between busy ones and one past the kernels' row tiles (3, 6 and 16 rows;
# the wide tiles' 8 and two halves); single rows; none at all
# (w4amx: and one past its 32-row tile steps)
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("counts", [[3, 3, 3, 3], [0, 5, 0, 40, 1, 0], [1, 0, 0, 1], [0, 0, 0], [7, 2], [9, 0, 15]])
def test_grouped_experts_equal_the_kernel_s_call_per_expert(name: str, counts: list[int]) -> None:
    kernel, scheme = _kernel(name), name.split("-")[0]
    gate_up, down = _experts(scheme, len(counts), symmetric=len(counts) % 2 == 0)
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = GroupedQuantExperts(kernel, gate_up, down)(x, counts)
    assert got.shape == (sum(counts), HIDDEN) and got.dtype == torch.bfloat16
    path, act, start = _per_expert_path(kernel), ActAndMul("silu"), 0
    for e, n in enumerate(counts):
        h = act(path.prepare(gate_up[e], None, None)(x[start : start + n]))
        want = path.prepare(down[e], None, None)(h)
        # the same integer sums; only the fused SiLU's exp may round its bf16 result one step apart (and, W8A8,
        # the down projection's int8 rounding of that input then one step too)
        torch.testing.assert_close(got[start : start + n], want, rtol=3e-2, atol=2e-2)
        start += n


@pytest.mark.parametrize("name", KERNELS)
def test_wrong_counts_are_refused_before_the_kernel_reads_anything(name: str) -> None:
    kernel, scheme = _kernel(name), name.split("-")[0]
    gate_up, down = _experts(scheme, 2)
    grouped = GroupedQuantExperts(kernel, gate_up, down)
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    for counts in ([4], [3, 3], [5, -1], [1, 1, 2]):
        with pytest.raises(ValueError, match="groups of"):
            grouped(x, counts)
    with pytest.raises(ValueError, match="groups of"):
        grouped(torch.zeros(4, HIDDEN + 8, dtype=torch.bfloat16), [2, 2])


@pytest.mark.parametrize("name", KERNELS)
def test_only_chained_experts_of_one_shape_and_the_kernel_s_scheme_fit(name: str) -> None:
    kernel, scheme = _kernel(name), name.split("-")[0]
    gate_up, down = _experts(scheme, 2)
    other = "w8a8" if scheme == "w4a16" else "w4a16"
    assert GroupedQuantExperts.accepts(kernel, gate_up, down)
    assert not GroupedQuantExperts.accepts(kernel, gate_up, down[:1])
    assert not GroupedQuantExperts.accepts(kernel, gate_up, [_weight(scheme, HIDDEN, 2 * INNER, 1)] * 2)  # unchained
    assert not GroupedQuantExperts.accepts(kernel, *_experts(other, 2))  # the other scheme
    assert not GroupedQuantExperts.accepts(kernel, [torch.zeros(2 * INNER, HIDDEN)] * 2, down)  # not quantized
    assert not GroupedQuantLinear.accepts(kernel, [_weight(scheme, 96, HIDDEN, 1)], silu_mul=True)  # 96 % 64
    assert not GroupedQuantLinear.accepts(kernel, [gate_up[0], _weight(scheme, 2 * INNER, 2 * HIDDEN, 1)])
    if scheme == "w4a16":  # two group sizes
        assert not GroupedQuantLinear.accepts(kernel, [gate_up[0], int4_weight(2 * INNER, HIDDEN, 64, True)])
    if name == "w4a16-amx":  # its tiles take 32 inputs a step: a group of 16 does not fit them
        assert not GroupedQuantLinear.accepts(kernel, [int4_weight(HIDDEN, HIDDEN, 16, True)])
    if name == "w8a8-amx":  # its tiles take 64 inputs a step
        assert not GroupedQuantLinear.accepts(kernel, [int8_weight(HIDDEN, 96, 1)])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_deepseek_runs_its_experts_grouped_and_answers_as_with_a_call_per_expert(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    _kernel(scheme)
    quantize(build_deepseek("v2-grouped", tmp_path / "src"), tmp_path / "q", scheme, group_size=8)
    cfg = dict(dtype="bfloat16", max_num_seqs=8)
    grouped = make_core(tmp_path / "q", **cfg, gemm_path="bf16mm")  # untimed: the grouped call is taken
    moes = [m for m in grouped.runner.model.modules() if type(m).__name__ == "MoE"]
    assert moes and all(isinstance(m.grouped, GroupedQuantExperts) for m in moes)
    assert all(e.gate_up_proj.plan is None and e.gate_up_proj.quantized is None for e in moes[0].local_experts())
    monkeypatch.setattr(op_choice, "choose_quant_experts", lambda *_: None)
    each = make_core(tmp_path / "q", **cfg, gemm_path="bf16mm")
    assert all(m.grouped is None for m in each.runner.model.modules() if type(m).__name__ == "MoE")
    prompts = mixed_prompts(4)
    for a, b in zip(step_logits(grouped, prompts, 3), step_logits(each, prompts, 3), strict=True):
        assert (a.float() - b.float()).abs().max() <= 3e-2 * b.float().abs().max()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("fastest", ["noprefetch", "each"])
def test_the_experts_choice_takes_the_kernel_build_that_timed_fastest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str, fastest: str
) -> None:
    """Both builds of the kernel (with and without software prefetch) are grouped candidates: the one the timer
    says is fastest makes the layers' grouped calls; where a call per expert is faster, none does."""
    module = w4mm if scheme == "w4a16" else i8mm
    _kernel(scheme)
    plain = module.kernel_without_prefetch()
    assert plain is not None
    quantize(build_deepseek("v2-grouped", tmp_path / "src"), tmp_path / "q", scheme, group_size=8)

    def timer(fn: object) -> float:
        d = getattr(fn, "__defaults__", None) or ()
        ran = d[0].gate_up.kernel if d and isinstance(d[0], GroupedQuantExperts) else None
        return 1e-3 if (ran is plain if fastest == "noprefetch" else ran is None) else 1.0

    _, moes = _timed_core(monkeypatch, tmp_path / "q", timer, dtype="bfloat16")
    if fastest == "each":
        assert moes and all(m.grouped is None for m in moes)
    else:
        assert moes and all(isinstance(m.grouped, GroupedQuantExperts) for m in moes)
        assert all(m.grouped.gate_up.kernel is plain and m.grouped.down.kernel is plain for m in moes)


def _spy(monkeypatch: pytest.MonkeyPatch, kernel: Kernel, calls: list[Kernel]) -> None:
    """Record `kernel` in calls at each of its grouped calls."""
    original = kernel.grouped
    monkeypatch.setattr(kernel, "grouped", lambda *a: calls.append(kernel) or original(*a))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_single_token_s_rows_run_through_the_one_token_kernel_over_the_same_packed_copies(
    monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    kernel, plain = _kernel(scheme), (w4mm if scheme == "w4a16" else i8mm).kernel_without_prefetch()
    assert plain is not None
    gate_up, down = _experts(scheme, 4)
    grouped = GroupedQuantExperts(plain, gate_up, down, one_token=kernel, top_k=2)
    assert grouped.one is not None and [p.kernel for p in grouped.one] == [kernel, kernel]
    assert grouped.one[0].packed is grouped.gate_up.packed and grouped.one[1].pointers is grouped.down.pointers
    assert grouped.projections(2) == grouped.one and grouped.projections(3) == (grouped.gate_up, grouped.down)
    calls: list[Kernel] = []
    _spy(monkeypatch, kernel, calls), _spy(monkeypatch, plain, calls)
    for counts, ran in (([0, 1, 0, 1], kernel), ([2, 0, 1, 1], plain)):  # one token's top-2 rows; two tokens'
        x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(sum(counts))).bfloat16()
        want = GroupedQuantExperts(ran, gate_up, down)(x, counts)
        calls.clear()
        assert torch.equal(grouped(x, counts), want) and calls == [ran, ran]  # gate/up, then down
    assert GroupedQuantExperts(kernel, gate_up, down, one_token=kernel).one is None  # the same kernel: no second


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_experts_choice_times_the_grouped_kernels_again_at_one_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """The timer makes the build without prefetch fastest at a batch's rows and the default build at one token's:
    the layers' grouped calls take both, and one sequence's decode steps (programs or layers) run the default
    build's; the model answers as with the default build alone (the two builds give the same bits)."""
    module = w4mm if scheme == "w4a16" else i8mm
    kernel, plain = _kernel(scheme), module.kernel_without_prefetch()
    quantize(build_deepseek("v2-grouped", tmp_path / "src"), tmp_path / "q", scheme, group_size=8)

    def timer(fn: object) -> float:
        d = getattr(fn, "__defaults__", None) or ()
        if len(d) < 2 or not isinstance(d[0], GroupedQuantExperts):
            return 1.0
        one = d[1].shape[0] <= 8  # the probe's one token: its top-k rows; a batch's: 32 tokens' (ROWS)
        return 1e-3 if d[0].gate_up.kernel is (kernel if one else plain) else 1.0

    cfg = dict(dtype="bfloat16", max_num_seqs=8, gemm_path="bf16mm")
    both, moes = _timed_core(monkeypatch, tmp_path / "q", timer, **cfg)
    assert moes and all(isinstance(m.grouped, GroupedQuantExperts) for m in moes)
    assert all(m.grouped.gate_up.kernel is plain and m.grouped.one[0].kernel is kernel for m in moes)
    assert all(m.grouped.top_k == m.gate.top_k for m in moes)
    first, untimed = _timed_core(monkeypatch, tmp_path / "q", None, **cfg)  # the first candidate for all rows
    assert all(m.grouped.one is None for m in untimed)
    used: list[GroupedQuantLinear] = []  # each grouped call (layers) or program's take of one (programs)
    for method in ("__call__", "emit"):
        original = getattr(GroupedQuantLinear, method)
        spy = lambda self, *a, original=original: used.append(self) or original(self, *a)  # noqa: E731
        monkeypatch.setattr(GroupedQuantLinear, method, spy)
    prompt = mixed_prompts(1)  # one sequence: each decode step one token
    got = step_logits(both, prompt, 4)
    assert any(u is m.grouped.one[0] for m in moes for u in used)  # its decode steps took the one-token kernel
    for a, b in zip(got, step_logits(first, prompt, 4), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["w4a16-amx", "w8a8-amx"])
def test_the_experts_choice_takes_the_amx_kernel_s_grouped_call_where_it_timed_fastest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """On AMX CPUs w4amx's and i8amx's builds are grouped candidates beside w4mm's and i8mm's (over the same packed
    copies): the timer's fastest makes the layers' grouped calls, and the model answers as with a call per
    expert."""
    amx, scheme = _kernel(name), name.split("-")[0]
    # v2-lite with experts 64 wide: every expert's input width a multiple of 64 (i8amx's k-step), and every
    # layer's of 32 (w4amx's group); v2-grouped's q_lora_rank of 24 is neither
    wide = test_deepseek.CONFIGS["v2-lite"] | {"moe_intermediate_size": 64}
    monkeypatch.setitem(test_deepseek.CONFIGS, "v2-amx", wide)
    quantize(build_deepseek("v2-amx", tmp_path / "src"), tmp_path / "q", scheme, group_size=32)

    def timer(fn: object) -> float:
        d = getattr(fn, "__defaults__", None) or ()
        return 1e-3 if d and isinstance(d[0], GroupedQuantExperts) and d[0].gate_up.kernel is amx else 1.0

    # the other layers on one untimed path in both engines: timed, each could pick another (a bf16-dequantizing one
    # rounds the weights, which moved a logit 6% of the largest in one CI run)
    cfg = dict(dtype="bfloat16", max_num_seqs=8, gemm_path="bf16mm")
    grouped, moes = _timed_core(monkeypatch, tmp_path / "q", timer, **cfg)
    assert moes and all(isinstance(m.grouped, GroupedQuantExperts) for m in moes)
    assert all(m.grouped.gate_up.kernel is amx and m.grouped.down.kernel is amx for m in moes)
    monkeypatch.setattr(op_choice, "choose_quant_experts", lambda *_: None)
    each = make_core(tmp_path / "q", **cfg)
    prompts = mixed_prompts(4)
    same = torch.ones(len(prompts), dtype=torch.bool)  # rows whose tokens so far agree (a near-tie may flip one)
    for a, b in zip(step_logits(grouped, prompts, 3), step_logits(each, prompts, 3), strict=True):
        assert same.any() and (a[same].float() - b[same].float()).abs().max() <= 3e-2 * b.float().abs().max()
        same &= a.argmax(-1) == b.argmax(-1)


def _mla_timed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, scheme: str, choice: str, timer: Callable[[object], float],
    product: int, want: str,
) -> Any:  # fmt: skip
    """The first MLA layer of a bf16 engine on a `scheme` DeepSeek whose op_choice.`choice` (one of MLA's absorbed
    products: 0 W_UK, 1 W_UV) ran under `timer`, once every layer was checked to take the `want` kind of call."""
    quantize(build_deepseek("v2-grouped", tmp_path / "src"), tmp_path / "q", scheme, group_size=8)
    choose = getattr(op_choice, choice)
    monkeypatch.setattr(op_choice, choice, lambda k, mla, dtype, *_: choose(k, mla, dtype, timer, None))
    core = make_core(tmp_path / "q", dtype="bfloat16", max_num_seqs=8, gemm_path="bf16mm")
    mlas = [m for m in core.runner.model.modules() if type(m).__name__ == "MLAttention"]
    assert mlas and {type(m.absorbed[product]).__name__ for m in mlas} == {want}
    return mlas[0]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("faster", ["quantized", "bf16"])
def test_w_uv_runs_from_the_checkpoints_quantized_rows_where_that_timed_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str, faster: str
) -> None:
    """MLA's W_UV per head can run over kv_b_proj's own quantized value rows (their groups, or W8A8's channel
    scales, run along the latent, W_UV's inputs): the one-row call the timer says is faster is the one the layers
    take, and the quantized call gives each head's reference product of those rows."""
    _kernel(scheme)

    def timer(fn: object) -> float:
        cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
        quantized = any(isinstance(c, GroupedQuantLinear) for c in cells)
        return 1e-3 if quantized == (faster == "quantized") else 1.0

    want = "GroupedQuantLinear" if faster == "quantized" else "GroupedLinear"
    mla = _mla_timed(monkeypatch, tmp_path, scheme, "choose_absorbed_quant", timer, 1, want)
    uv = mla.absorbed_quantized()
    assert uv is not None and len(uv) == mla.num_heads and uv[0].shape == (mla.v_dim, mla.kv_lora_rank)
    if faster == "quantized":
        rows = 3
        o = torch.randn(rows * mla.num_heads, mla.kv_lora_rank, generator=torch.Generator().manual_seed(5)).bfloat16()
        got = mla.absorbed[1](o, [rows] * mla.num_heads).float()
        want = torch.cat([w.reference(o[h * rows : (h + 1) * rows], None) for h, w in enumerate(uv)])
        torch.testing.assert_close(got, want, rtol=3e-2, atol=2e-2 * want.abs().max().item())


def test_w_uk_pieces_hold_the_checkpoints_key_rows_exactly() -> None:
    """kv_b_proj's int4 key rows as W_UK's int4 products (engine.quant.absorbed_key): per head and latent group,
    the query's scales times the transposed codes are those rows dequantized, exactly; a weight with zero points
    has no such form."""
    heads, nope, v, lat, g = 3, 8, 4, 32, 16
    kv_b = int4_weight(heads * (nope + v), lat, g, symmetric=True, seed=3)
    pieces = key_pieces(kv_b, heads, nope, v)
    assert pieces is not None and pieces.scales.shape == (heads, lat // g, nope) and len(pieces.weights) == 6
    dense = kv_b.float()
    for h in range(heads):
        for j in range(lat // g):
            piece = pieces.weights[h * (lat // g) + j]
            assert piece.shape == (g, nope) and piece.group_size == nope and bool((piece.scale == 1).all())
            got = pieces.scales[h, j][:, None] * (piece.values().t().float() - 8)
            want = dense[h * (nope + v) : h * (nope + v) + nope, j * g : (j + 1) * g]
            assert torch.equal(got, want)
    assert key_pieces(int4_weight(heads * (nope + v), lat, g, symmetric=False, seed=3), heads, nope, v) is None


@pytest.mark.parametrize("faster", ["int4", "bf16"])
def test_w_uk_runs_from_the_checkpoints_int4_key_rows_where_that_timed_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, faster: str
) -> None:
    """MLA's W_UK per head can run over kv_b_proj's own int4 key rows, their scales moved onto the query per latent
    group: the one-row call the timer says is faster (each timed as a decode program runs it) is the one the
    layers take, and the int4 call gives each head's product with the dequantized key rows."""
    kernel = _kernel("w4a16")

    def timer(fn: object) -> float:
        int4 = isinstance(getattr(fn, "what", None), GroupScaledKey)
        return 1e-3 if int4 == (faster == "int4") else 1.0

    want = "GroupScaledKey" if faster == "int4" else "GroupedLinear"
    mla = _mla_timed(monkeypatch, tmp_path, "w4a16", "choose_absorbed_key", timer, 0, want)
    pieces = mla.absorbed_key_quantized()
    assert pieces is not None
    wide = GroupedLinear(bf16mm.kernel(), mla.absorbed_weights()[0])
    key = mla.absorbed[0] if faster == "int4" else GroupScaledKey(kernel, pieces, wide)
    h, nope, per = mla.num_heads, mla.nope, mla.nope + mla.v_dim
    kv_b = mla.kv_b_proj.kept
    heads = [kv_b.rows(i * per, i * per + nope).float() for i in range(h)]  # [nope, latent] each
    for rows in (1, 3):  # one row through the int4 call, more through the bf16 one (the dequantized rows)
        x = torch.randn(rows * h, nope, generator=torch.Generator().manual_seed(5)).bfloat16()
        got = key(x, [rows] * h).float()
        want = torch.cat([x[i * rows : (i + 1) * rows].float() @ w for i, w in enumerate(heads)])
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2 * want.abs().max().item())
    with pytest.raises(ValueError):
        key(x, [rows] * (h - 1) + [rows + 1])
