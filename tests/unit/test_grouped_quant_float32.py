"""engine.quant.grouped in float32 math (the AVX2 CPUs', and any CPU without bf16 arithmetic): a MoE layer's
quantized experts in two calls of w4f32's grouped entry (W4A16) or i8avx2's (W8A8), float32 rows in and out, give
the bits of that kernel's call per expert and projection, and a quantized DeepSeek in float32 math takes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.kernels.bind
from engine.kernels import i8avx2, op_choice, w4f32
from engine.layers.moe import MoE
from engine.quant.grouped import GroupedQuantExperts, GroupedQuantLinear, rows_dtype
from engine.quant.paths import (
    I8AVX2Path,
    I8AVX2SiluPath,
    I8MMPath,
    I8MMSiluPath,
    W4F32Path,
    W4F32SiluPath,
    _W8A8Path,
    quant_paths,
)
from engine.quant.quantize import quantize
from tests.int4_kernels import int4_weight
from tests.int8_kernels import int8_weight
from tests.parity.conftest import make_core, mixed_prompts, step_logits
from tests.parity.test_deepseek import build_deepseek

HIDDEN, INNER, GROUP = 128, 64, 32
SCHEMES = ["w4a16", "w8a8"]


def _kernel(scheme: str) -> w4f32.W4F32 | i8avx2.I8AVX2:
    kernel = w4f32.kernel() if scheme == "w4a16" else i8avx2.kernel()
    if kernel is None:
        pytest.skip(f"no float32 {scheme} kernel on this CPU (i8avx2 needs AVX2)")
    return kernel


def _experts(scheme: str, e: int) -> tuple[list, list]:
    def weight(n: int, k: int, seed: int):  # type: ignore[no-untyped-def]
        return int4_weight(n, k, GROUP, False, seed) if scheme == "w4a16" else int8_weight(n, k, seed)

    return [weight(2 * INNER, HIDDEN, 10 + i) for i in range(e)], [weight(HIDDEN, INNER, 50 + i) for i in range(e)]


def _per_expert(scheme: str, kernel: object, rows: int) -> tuple:
    """The fused gate/up path and the down path whose C code the grouped call runs for an expert of `rows` rows:
    w4f32's direct tiles up to two rows and its panels past that; i8avx2's `linear` entries."""
    if scheme == "w8a8":
        return I8AVX2SiluPath(kernel, "i8avx2-silu-mul", "linear"), I8AVX2Path(kernel)  # type: ignore[arg-type]
    direct = rows <= 2
    silu = W4F32SiluPath(kernel, "silu-mul" if direct else "panel-silu-mul")  # type: ignore[arg-type]
    return silu, W4F32Path(kernel, "direct" if direct else "panel")  # type: ignore[arg-type]


# experts of one and two rows (direct tiles), three and more (panels, one past a 6-row tile, one past a 96-row
# pass), none at all between them
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("counts", [[1, 0, 2, 1], [0, 5, 0, 40, 1, 0], [3, 7], [0, 0, 0], [97, 2]])
def test_grouped_experts_give_the_bits_of_the_kernel_s_call_per_expert(scheme: str, counts: list[int]) -> None:
    from engine.layers.activation import ActAndMul

    kernel = _kernel(scheme)
    gate_up, down = _experts(scheme, len(counts))
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(3))
    got = GroupedQuantExperts(kernel, gate_up, down)(x, counts)  # type: ignore[arg-type]
    assert got.shape == (sum(counts), HIDDEN) and got.dtype == torch.float32 == rows_dtype(kernel)  # type: ignore[arg-type]
    start = 0
    for e, n in enumerate(counts):
        up, dn = _per_expert(scheme, kernel, n)
        h = up.prepare(gate_up[e], None, ActAndMul("silu"))(x[start : start + n])
        want = dn.prepare(down[e], None, None)(h)
        assert torch.equal(got[start : start + n], want), f"expert {e} of {n} rows"
        start += n


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_grouped_call_equals_the_dequantized_reference(scheme: str) -> None:
    """Independent of the kernels' own entries: down(silu(gate) * up) by each expert's dequantized weights."""
    kernel, counts = _kernel(scheme), [2, 0, 9, 1]
    gate_up, down = _experts(scheme, len(counts))
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(4))
    got, start = GroupedQuantExperts(kernel, gate_up, down)(x, counts), 0  # type: ignore[arg-type]
    scale = got.abs().max().item()
    for e, n in enumerate(counts):
        if n == 0:  # the reference cannot shape an empty int8 input
            continue
        gate, up = gate_up[e].reference(x[start : start + n], None).chunk(2, dim=-1)
        want = down[e].reference(torch.nn.functional.silu(gate) * up, None)
        torch.testing.assert_close(got[start : start + n], want, rtol=2e-2, atol=2e-2 * scale)
        start += n


@pytest.mark.parametrize("scheme", SCHEMES)
def test_only_experts_of_the_kernel_s_scheme_and_shapes_fit(scheme: str) -> None:
    kernel = _kernel(scheme)
    gate_up, down = _experts(scheme, 2)
    assert GroupedQuantExperts.accepts(kernel, gate_up, down)  # type: ignore[arg-type]
    assert not GroupedQuantExperts.accepts(kernel, *_experts("w8a8" if scheme == "w4a16" else "w4a16", 2))  # type: ignore[arg-type]
    assert not GroupedQuantLinear.accepts(kernel, [_experts(scheme, 1)[0][0]] * 2 + [down[0]])  # type: ignore[arg-type]
    odd = int4_weight(96, HIDDEN, GROUP, False) if scheme == "w4a16" else int8_weight(96, HIDDEN)
    assert not GroupedQuantLinear.accepts(kernel, [odd], silu_mul=True)  # type: ignore[arg-type]  # 96 % 64


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_deepseek_in_float32_runs_its_experts_grouped_and_answers_as_with_a_call_per_expert(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    _kernel(scheme)
    if scheme == "w8a8":
        # every int8 layer through i8avx2 in both engines: where this CPU has oneDNN's int8 GEMM or i8mm (an AMX
        # Xeon), the untimed choice takes those per expert, whose float epilogue rounds another way, and a last-bit
        # difference flips a per-token int8 rounding downstream (the logits then differ by ~0.5%, not by bits)
        monkeypatch.setattr(_W8A8Path, "accepts", lambda *_: False)
        monkeypatch.setattr(I8MMPath, "accepts", lambda *_: False)
        monkeypatch.setattr(I8MMSiluPath, "accepts", lambda *_: False)
    # every gated MLP through its kernel's fused SiLU entry in both engines, as the grouped call computes it (silu.h):
    # a per-expert plan's plain GEMM and then torch's act rounds SiLU another way in the last bit (torch's vector
    # exp against silu.h's), which W8A8's per-token int8 rounding downstream turned into 0.3% of the logits (a Zen
    # 5, 2026-12-07)
    fused = (I8AVX2SiluPath, W4F32SiluPath)
    monkeypatch.setattr(
        engine.kernels.bind, "quant_paths", lambda d: sorted(quant_paths(d), key=lambda p: not isinstance(p, fused))
    )
    quantize(build_deepseek("v2-grouped", tmp_path / "src"), tmp_path / "q", scheme, group_size=8)
    cfg = dict(dtype="float32", max_num_seqs=8, gemm_path="wbf16")
    grouped = make_core(tmp_path / "q", **cfg)  # untimed: the grouped call is taken
    moes = [m for m in grouped.runner.model.modules() if isinstance(m, MoE)]
    assert moes and all(isinstance(m.grouped, GroupedQuantExperts) for m in moes)
    assert all(isinstance(m.grouped.gate_up.kernel, w4f32.W4F32 | i8avx2.I8AVX2) for m in moes)  # type: ignore[union-attr]
    monkeypatch.setattr(op_choice, "choose_quant_experts", lambda *_: None)
    each = make_core(tmp_path / "q", **cfg)
    assert all(m.grouped is None for m in each.runner.model.modules() if isinstance(m, MoE))
    chosen = {p for _, choice in each.runner.kernel_report.shapes.values() for p in choice.per_class}
    assert {"i8avx2-silu-mul", "w4f32-silu-mul"} & chosen, chosen  # the experts' own calls fuse SiLU too
    prompts = mixed_prompts(4)
    for a, b in zip(step_logits(grouped, prompts, 3), step_logits(each, prompts, 3), strict=True):
        assert (a.float() - b.float()).abs().max() <= 1e-3 * b.float().abs().max()


@pytest.mark.parametrize("faster", ["int4", "torch"])
def test_mlas_products_run_over_the_int4_rows_in_float32_where_that_timed_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, faster: str
) -> None:
    """W4A16 in float32 math: MLA's W_UK and W_UV per head over kv_b_proj's own int4 rows (the key rows with their
    scales moved onto the query per latent group, in float32; the value rows as they are) where that pair, timed as
    a decode program runs it, beat torch.bmm over the dequantized float32 weight; else the layer keeps bmm. The
    int4 calls give each head's float32 product with the dequantized rows, at one row and at more (no bf16 call
    takes over past one row in this math)."""
    from engine.quant.absorbed_key import GroupScaledKey

    _kernel("w4a16")

    def timer(fn: object) -> float:
        int4 = isinstance(getattr(fn, "what", None), GroupScaledKey)
        return 1e-3 if int4 == (faster == "int4") else 1.0

    choose = op_choice.choose_absorbed_float32
    monkeypatch.setattr(op_choice, "choose_absorbed_float32", lambda mla, dtype, *_: choose(mla, dtype, timer, None))
    quantize(build_deepseek("v2-grouped", tmp_path / "src"), tmp_path / "q", "w4a16", group_size=8)
    core = make_core(tmp_path / "q", dtype="float32", max_num_seqs=8, gemm_path="wbf16")
    mlas = [m for m in core.runner.model.modules() if type(m).__name__ == "MLAttention"]
    if faster == "torch":  # this checkpoint's float32 scales leave no exact bf16 halves (SplitGrouped) either: bmm
        assert mlas and all(m.absorbed is None for m in mlas)
        return
    assert mlas and all(isinstance(m.absorbed[0], GroupScaledKey) for m in mlas)
    mla = mlas[0]
    h, nope, per, lat = mla.num_heads, mla.nope, mla.nope + mla.v_dim, mla.kv_lora_rank
    kv_b = mla.kv_b_proj.kept
    keys = [kv_b.rows(i * per, i * per + nope).float() for i in range(h)]  # [nope, latent] each
    values = [kv_b.rows(i * per + nope, (i + 1) * per).float() for i in range(h)]  # [v, latent] each
    for rows in (1, 3):
        g = torch.Generator().manual_seed(rows)
        x, o = torch.randn(rows * h, nope, generator=g), torch.randn(rows * h, lat, generator=g)
        got_k, got_v = mla.absorbed[0](x, [rows] * h), mla.absorbed[1](o, [rows] * h)
        assert got_k.dtype == got_v.dtype == torch.float32
        want_k = torch.cat([x[i * rows : (i + 1) * rows] @ w for i, w in enumerate(keys)])
        want_v = torch.cat([o[i * rows : (i + 1) * rows] @ w.t() for i, w in enumerate(values)])
        torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5 * want_k.abs().max().item())
        torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=1e-5 * want_v.abs().max().item())


def test_float32_weights_of_up_to_16_bits_run_as_two_exact_bf16_halves() -> None:
    """engine.kernels.grouped.bf16_pair / SplitGrouped: an int8 weight times bf16 scales (a W8A8 kv_b_proj
    dequantized in float32) is exactly hi + lo, two bf16 values; through wbf16's grouped call with the rows fed
    twice the products equal the float32 reference to float32 rounding. A float32 checkpoint's values (24 bits)
    have no such pair, and a bf16-row kernel takes none."""
    from engine.kernels import wbf16
    from engine.kernels.grouped import SplitGrouped, bf16_pair

    kernel = wbf16.kernel()
    assert kernel is not None and kernel.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    weights = [
        torch.randint(-127, 128, (48, 64), generator=g).float() * torch.rand(48, 1, generator=g).bfloat16().float()
        for _ in range(3)
    ]
    for w in weights:
        pair = bf16_pair(w)
        assert pair is not None and pair.dtype == torch.bfloat16 and pair.shape == (48, 128)
        assert torch.equal(pair[:, :64].float() + pair[:, 64:].float(), w)
    assert bf16_pair(torch.randn(48, 64, generator=g)) is None
    split = SplitGrouped.make(kernel, weights)
    assert split is not None and (split.n, split.k) == (48, 64)
    counts = [2, 0, 3]
    x = torch.randn(sum(counts), 64, generator=g)
    got = split(x, counts)
    want = torch.cat([x[:2] @ weights[0].t(), x[2:] @ weights[2].t()])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert SplitGrouped.make(kernel, [torch.randn(48, 64, generator=g)]) is None
    with pytest.raises(ValueError):
        split(x, [1, 1, 1])


@pytest.mark.parametrize("counts", [[1, 0, 2, 1], [0, 5, 0, 40, 1, 0], [97, 2], [0, 0]])
def test_i8mm_s_grouped_call_over_float32_rows_gives_its_linear_entry_per_expert(counts: list[int]) -> None:
    """AVX512-VNNI CPUs in float32 math (Cascade Lake, or float32 forced): i8mm's grouped call over float32 rows
    (i8mm_grouped_f32) gives, per expert, the bits of i8mm's own linear entry over float32 rows; with the fused
    gated MLP, silu(gate) * up of those sums in float32, then down, as that entry and torch's SiLU give it (the C
    library's exp against torch's), and within W8A8's error of the dequantized reference."""
    from engine.kernels import i8mm
    from engine.kernels.i8mm import I8MM

    kernel = i8mm.float32_rows(i8mm.kernel())
    if kernel is None:
        pytest.skip("this CPU has no AVX512-VNNI: i8mm does not run (i8avx2's grouped call serves float32 math)")
    assert rows_dtype(kernel) == torch.float32
    gate_up, down = _experts("w8a8", len(counts))
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(3))
    got = GroupedQuantLinear(kernel, gate_up)(x, counts)  # [rows, 2I] float32, unfused
    fused = GroupedQuantExperts(kernel, gate_up, down)(x, counts)
    assert got.dtype == fused.dtype == torch.float32
    start = 0
    for e, n in enumerate(counts):
        rows = x[start : start + n]
        want = kernel.linear(rows, I8MM.pack(gate_up[e].q, gate_up[e].scale))
        assert torch.equal(got[start : start + n], want), f"expert {e} of {n} rows"
        if n:
            gate, up = want.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
            hw = kernel.linear(h, I8MM.pack(down[e].q, down[e].scale))
            # the C library's exp against torch's may move h by an ulp, and that an int8 step of h's quantization
            torch.testing.assert_close(fused[start : start + n], hw, rtol=1e-2, atol=1e-2 * hw.abs().max().item())
            g2, u2 = gate_up[e].reference(rows, None).chunk(2, dim=-1)
            ref = down[e].reference(torch.nn.functional.silu(g2) * u2, None)
            torch.testing.assert_close(fused[start : start + n], ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
        start += n


def test_the_one_token_kernel_shares_the_chosen_kernel_s_packed_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32 math on an AVX512-VNNI CPU has grouped W8A8 calls over two packed layouts (i8mm's and i8avx2's):
    where the timer makes i8mm's fastest at a batch's rows and i8avx2's at one token's, the one-token call is
    chosen among i8mm's builds only (it runs over the batch call's packed copies), and the engine starts."""
    from engine.kernels import i8mm

    if i8mm.kernel() is None:
        pytest.skip("this CPU has no AVX512-VNNI: float32 math has i8avx2's layout alone")
    choose = op_choice.choose_quant_experts

    def timer(fn: object) -> float:
        d = getattr(fn, "__defaults__", None) or ()
        if len(d) < 2 or not isinstance(d[0], GroupedQuantExperts):
            return 1.0
        one = d[1].shape[0] <= 8  # the probe's one token: its top-k rows; a batch's: 32 tokens' (ROWS)
        want = i8avx2.I8AVX2 if one else i8mm.I8MMFloat32Rows
        return 1e-3 if isinstance(d[0].gate_up.kernel, want) else 1.0

    monkeypatch.setattr(op_choice, "choose_quant_experts", lambda moe, dtype, *_: choose(moe, dtype, timer, None))
    quantize(build_deepseek("v2-grouped", tmp_path / "src"), tmp_path / "q", "w8a8")
    core = make_core(tmp_path / "q", dtype="float32", max_num_seqs=8, gemm_path="wbf16")
    moes = [m for m in core.runner.model.modules() if isinstance(m, MoE)]
    assert moes and all(isinstance(m.grouped.gate_up.kernel, i8mm.I8MMFloat32Rows) for m in moes)  # type: ignore[union-attr]
    assert all(m.grouped.one is None or isinstance(m.grouped.one[0].kernel, i8mm.I8MMFloat32Rows) for m in moes)  # type: ignore[union-attr]
    assert step_logits(core, mixed_prompts(1), 2)


@pytest.mark.parametrize("faster", ["split", "torch"])
def test_mlas_products_over_exact_bf16_halves_only_where_that_timed_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, faster: str
) -> None:
    """W8A8 in float32 math: MLA's two products through wbf16's grouped call over each dequantized weight's two
    exact bf16 halves (grouped.SplitGrouped) where that pair, timed as a program runs it, beat torch.bmm over the
    float32 weight; else the layer keeps bmm."""
    from engine.kernels.grouped import SplitGrouped
    from tests.parity.test_deepseek_program import _save

    def timer(fn: object) -> float:
        split = isinstance(getattr(fn, "what", None), SplitGrouped)
        return 1e-3 if split == (faster == "split") else 1.0

    wins = op_choice.split_wins
    monkeypatch.setattr(op_choice, "split_wins", lambda k, mla, dtype, *_: wins(k, mla, dtype, timer, None))
    quantize(_save(tmp_path / "src"), tmp_path / "q", "w8a8")  # a bf16 model: its scales are bf16 values
    core = make_core(tmp_path / "q", dtype="float32", max_num_seqs=8, gemm_path="wbf16")
    mlas = [m for m in core.runner.model.modules() if type(m).__name__ == "MLAttention"]
    assert mlas
    if faster == "torch":
        assert all(m.absorbed is None for m in mlas)
        return
    assert all(isinstance(m.absorbed[0], SplitGrouped) and isinstance(m.absorbed[1], SplitGrouped) for m in mlas)
