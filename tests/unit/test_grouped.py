"""engine.kernels.grouped over each kernel with a grouped entry point (amxmm on AMX, bf16mm on AVX512-BF16, both
bf16 math; wbf16 everywhere, float32 math): several experts' rows in one call give what one unfused torch MLP per
expert gives in the kernel's math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import amxmm, bf16mm, wbf16
from engine.kernels.grouped import GroupedExperts, GroupedKernel, GroupedLinear
from tests.kernel_checks import bf16 as _bf16

# name: (whether this CPU can run it, the kernel); wbf16 has a portable build for every CPU
KERNELS = {
    "amxmm": (amxmm.supported, amxmm.kernel),
    "bf16mm": (bf16mm.supported, bf16mm.kernel),
    "bf16mm-noprefetch": (bf16mm.supported, bf16mm.kernel_without_prefetch),
    "bf16fma": (bf16mm.supported, bf16mm.kernel_fma32),
    "wbf16": (lambda: True, wbf16.kernel),
    "wbf16-noprefetch": (lambda: wbf16.kernel_without_prefetch() is not None, wbf16.kernel_without_prefetch),
}


@pytest.fixture(scope="module", params=list(KERNELS))
def kernel(request: pytest.FixtureRequest) -> GroupedKernel:
    supported, build = KERNELS[request.param]
    if not supported():
        pytest.skip(f"this CPU cannot run {request.param}")
    k = build()
    assert k is not None
    return k


def _tolerance(kernel: GroupedKernel) -> dict[str, float]:
    """bf16 math rounds each product's sum, SiLU and the gate product to bf16; float32 math only reorders sums."""
    return {"rtol": 3e-2, "atol": 3e-2} if kernel.dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}


def _experts(e: int, hidden: int, inner: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gate_up = [_bf16(2 * inner, hidden, seed=10 + i) for i in range(e)]
    return gate_up, [_bf16(hidden, inner, seed=50 + i) for i in range(e)]


# counts: every expert a few rows, empty experts between busy ones (one past a 32-row block, one past bf16mm's
# 192-row pass), single rows, none at all
@pytest.mark.parametrize("counts", [[3, 3, 3, 3], [0, 5, 0, 40, 1, 0], [1, 0, 0, 1], [0, 0, 0], [200, 7]])
def test_grouped_experts_equal_one_unfused_torch_mlp_per_expert(kernel: GroupedKernel, counts: list[int]) -> None:
    hidden, inner = 96, 64
    gate_up, down = _experts(len(counts), hidden, inner)
    grouped, dtype = GroupedExperts(kernel, gate_up, down), kernel.dtype
    x = _bf16(sum(counts), hidden, seed=3).to(dtype)
    got, start = grouped(x, counts), 0
    assert got.shape == (sum(counts), hidden) and got.dtype == dtype
    for e, n in enumerate(counts):
        gate, up = F.linear(x[start : start + n], gate_up[e].to(dtype)).chunk(2, dim=-1)  # as torch runs
        want = F.linear(F.silu(gate) * up, down[e].to(dtype))
        torch.testing.assert_close(got[start : start + n].float(), want.float(), **_tolerance(kernel))
        start += n


@pytest.mark.parametrize(("n", "k"), [(32, 64), (70, 96), (130, 33)])
def test_grouped_linear_equals_one_linear_per_group(kernel: GroupedKernel, n: int, k: int) -> None:
    """Column tails and (where the kernel takes it) an odd K: each group exactly its own layer's linear."""
    weights = [_bf16(n, k, seed=i) for i in range(3)]
    if not GroupedLinear.accepts(kernel, weights):
        assert k % kernel.k_multiple != 0
        return
    counts = [4, 0, 9]
    x = _bf16(sum(counts), k, seed=9).to(kernel.dtype)
    got, start = GroupedLinear(kernel, weights)(x, counts), 0
    for w, rows in zip(weights, counts, strict=True):
        want = kernel.linear(x[start : start + rows], kernel.pack(w), n, None)  # type: ignore[attr-defined]
        torch.testing.assert_close(got[start : start + rows], want)
        start += rows


def test_grouped_experts_take_only_bf16_weights_in_whole_steps(kernel: GroupedKernel) -> None:
    gate_up, down = _experts(2, 96, 64)
    assert GroupedExperts.accepts(kernel, gate_up, down)
    assert not GroupedExperts.accepts(kernel, [w.float() for w in gate_up], down)
    assert not GroupedExperts.accepts(kernel, *_experts(2, 96, 48))  # 2I = 96: not whole gate/up block pairs
    assert GroupedExperts.accepts(kernel, *_experts(2, 80, 64)) == (80 % kernel.k_multiple == 0)  # K = 80
    assert not GroupedExperts.accepts(kernel, gate_up, down[:1])


def test_grouped_linear_refuses_counts_that_do_not_match_its_weights_or_rows(kernel: GroupedKernel) -> None:
    weights = [_bf16(32, 64, seed=i) for i in range(3)]
    grouped = GroupedLinear(kernel, weights)
    x = _bf16(5, 64, seed=9).to(kernel.dtype)
    assert grouped(x, [2, 0, 3]).shape == (5, 32)
    for counts in ([2, 3], [2, 0, 4], [1, 1, 1, 2]):  # a group missing, rows past x, a weight missing
        with pytest.raises(ValueError, match="groups"):
            grouped(x, counts)


@pytest.mark.parametrize("n", [64, 320])  # one column block, five
def test_the_same_bits_whatever_the_thread_count(kernel: GroupedKernel, n: int) -> None:
    """Threads split the column blocks (as many threads as blocks or fewer) or take tasks dynamically (more):
    every split computes each output the same way."""
    weights = [_bf16(n, 128, seed=20 + i) for i in range(3)]
    grouped = GroupedLinear(kernel, weights)
    x = _bf16(9, 128, seed=30).to(kernel.dtype)
    counts = [4, 0, 5]
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3, 8):
            torch.set_num_threads(threads)
            outs.append(grouped(x, counts))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
