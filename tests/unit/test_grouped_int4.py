"""engine.quant.grouped: a MoE layer's W4A16 experts in two w4mm calls give what a w4mm call per expert and
projection (the GEMM plans they replace) gives, and a W4A16 DeepSeek takes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import bf16mm, op_choice, w4mm
from engine.layers.activation import ActAndMul
from engine.quant.grouped import GroupedInt4Experts, GroupedInt4Linear
from engine.quant.paths import W4MMPath
from engine.quant.quantize import quantize
from tests.int4_kernels import int4_weight
from tests.parity.conftest import make_core, mixed_prompts, step_logits
from tests.parity.test_deepseek import build_deepseek

pytestmark = pytest.mark.skipif(not bf16mm.supported(), reason="w4mm needs AVX512-BF16")

HIDDEN, INNER, GROUP = 128, 64, 32


def _experts(e: int, symmetric: bool = False) -> tuple[list, list]:
    gate_up = [int4_weight(2 * INNER, HIDDEN, GROUP, symmetric, seed=10 + i) for i in range(e)]
    return gate_up, [int4_weight(HIDDEN, INNER, GROUP, symmetric, seed=50 + i) for i in range(e)]


# every expert a few rows; empty experts between busy ones and one past the kernel's 3-row tiles; single rows;
# none at all
@pytest.mark.parametrize("counts", [[3, 3, 3, 3], [0, 5, 0, 40, 1, 0], [1, 0, 0, 1], [0, 0, 0], [7, 2]])
def test_grouped_experts_equal_a_w4mm_call_per_expert(counts: list[int]) -> None:
    kernel = w4mm.kernel()
    assert kernel is not None
    gate_up, down = _experts(len(counts), symmetric=len(counts) % 2 == 0)
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = GroupedInt4Experts(kernel, gate_up, down)(x, counts)
    assert got.shape == (sum(counts), HIDDEN) and got.dtype == torch.bfloat16
    path, act, start = W4MMPath(kernel, "direct"), ActAndMul("silu"), 0
    for e, n in enumerate(counts):
        h = act(path.prepare(gate_up[e], None, None)(x[start : start + n]))
        want = path.prepare(down[e], None, None)(h)
        # the same int4 sums; only the fused SiLU's exp may round its bf16 result one step apart
        torch.testing.assert_close(got[start : start + n], want, rtol=2e-2, atol=1e-2)
        start += n


def test_wrong_counts_are_refused_before_the_kernel_reads_anything() -> None:
    kernel = w4mm.kernel()
    assert kernel is not None
    gate_up, down = _experts(2)
    grouped = GroupedInt4Experts(kernel, gate_up, down)
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    for counts in ([4], [3, 3], [5, -1], [1, 1, 2]):
        with pytest.raises(ValueError, match="groups of"):
            grouped(x, counts)
    with pytest.raises(ValueError, match="groups of"):
        grouped(torch.zeros(4, HIDDEN + 8, dtype=torch.bfloat16), [2, 2])


def test_only_chained_int4_experts_of_one_shape_fit() -> None:
    gate_up, down = _experts(2)
    assert GroupedInt4Experts.accepts(gate_up, down)
    assert not GroupedInt4Experts.accepts(gate_up, down[:1])
    assert not GroupedInt4Experts.accepts(gate_up, [int4_weight(HIDDEN, 2 * INNER, GROUP, True)] * 2)  # not chained
    assert not GroupedInt4Experts.accepts([torch.zeros(2 * INNER, HIDDEN)] * 2, down)  # not quantized
    assert not GroupedInt4Linear.accepts([int4_weight(96, HIDDEN, GROUP, True)], silu_mul=True)  # 96 % 64
    assert not GroupedInt4Linear.accepts([gate_up[0], int4_weight(2 * INNER, HIDDEN, 64, True)])  # two group sizes


def test_a_w4a16_deepseek_runs_its_experts_grouped_and_answers_as_with_a_call_per_expert(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quantize(build_deepseek("v2-grouped", tmp_path / "src"), tmp_path / "q", "w4a16", group_size=8)
    cfg = dict(dtype="bfloat16", max_num_seqs=8)
    grouped = make_core(tmp_path / "q", **cfg, gemm_path="bf16mm")  # untimed: the grouped call is taken
    moes = [m for m in grouped.runner.model.modules() if type(m).__name__ == "MoE"]
    assert moes and all(isinstance(m.grouped, GroupedInt4Experts) for m in moes)
    assert all(e.gate_up_proj.plan is None and e.gate_up_proj.quantized is None for e in moes[0].local_experts())
    monkeypatch.setattr(op_choice, "choose_int4_experts", lambda *_: None)
    each = make_core(tmp_path / "q", **cfg, gemm_path="bf16mm")
    assert all(m.grouped is None for m in each.runner.model.modules() if type(m).__name__ == "MoE")
    prompts = mixed_prompts(4)
    for a, b in zip(step_logits(grouped, prompts, 3), step_logits(each, prompts, 3), strict=True):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()
