"""A MoE layer's routing and grouping in one C pass (pointwise.c's moe_route, engine.layers.moe.MoE.router):
the experts MoEGate (transformers' DeepSeek-V2 and V3 routers: softmax or sigmoid with its correction bias, greedy
or group-limited) chooses, its weights within float32 rounding, the pairs in the order of a stable argsort, and
the rows the experts read; the MoE layer's output is the torch code's."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import pointwise
from engine.kernels.kernel_set import CpuKernels
from engine.layers.moe import MoE, MoEGate


def _kernels() -> pointwise.PointwiseKernels:
    k = pointwise.kernel()
    assert k is not None, "pointwise.c did not build"
    return k


def _gate(hidden: int, experts: int, top_k: int, seed: int, scale: float = 1.0, **over: object) -> MoEGate:
    args: dict = dict(scoring="softmax", num_groups=1, topk_groups=1, norm_topk_prob=False)
    args.update(over)
    gate = MoEGate(hidden, experts, top_k, routed_scaling_factor=scale, **args)
    g = torch.Generator().manual_seed(seed)
    gate.weight.data = torch.randn(experts, hidden, generator=g) * hidden**-0.5
    if gate.scoring == "sigmoid":
        gate.e_score_correction_bias.data = torch.randn(experts, generator=g) * 0.1
    return gate


ROUTERS = {
    "greedy": {},
    "group-limited": {"num_groups": 4, "topk_groups": 2},
    "v3": {"scoring": "sigmoid", "num_groups": 4, "topk_groups": 2, "norm_topk_prob": True},
    "sigmoid-greedy": {"scoring": "sigmoid"},
}


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "experts", "top_k"), [(1, 1024, 16, 4), (7, 100, 8, 2), (300, 64, 160, 6)]
)
def test_routing_is_moegates_and_the_pairs_are_grouped_as_a_stable_argsort(
    router: str, dtype: torch.dtype, tokens: int, hidden: int, experts: int, top_k: int
) -> None:
    gate = _gate(hidden, experts, top_k, seed=tokens, scale=2.5, **ROUTERS[router])
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    want_w, want_ids = gate(x)
    w, ids, order, counts, xs = _kernels().route(x, gate)
    assert torch.equal(ids, want_ids)  # best first, as topk
    assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-7)
    assert torch.equal(order, want_ids.flatten().argsort(stable=True))
    assert torch.equal(counts, torch.bincount(want_ids.flatten(), minlength=experts))
    assert torch.equal(xs, x[order // top_k])


def test_rows_that_are_not_contiguous_route_as_their_copy() -> None:
    gate = _gate(64, 8, 2, seed=3, scale=1.5, **ROUTERS["v3"])
    wide = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    got, want = _kernels().route(wide[:, ::2], gate), _kernels().route(wide[:, ::2].contiguous(), gate)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_tie_goes_to_the_lower_expert() -> None:
    """Equal scores (a router with two equal rows): the lower-numbered expert comes first, as torch.topk's CPU
    kernel orders equal values by index."""
    gate = _gate(16, 4, 2, seed=0)
    gate.weight.data[3] = gate.weight.data[1]
    gate.weight.data[0] = gate.weight.data[1] * 0.5 - 3  # below both
    gate.weight.data[2] = gate.weight.data[1] * 0.5 - 3
    x = torch.ones(1, 16)
    _, ids, *_ = _kernels().route(x, gate)
    assert ids.tolist() == [[1, 3]]


def _moe(seed: int, **over: object) -> MoE:
    hidden, experts = 32, 8
    moe = MoE(_gate(hidden, experts, 2, seed, scale=1.5, **over), hidden, 16, 1, "silu")
    g = torch.Generator().manual_seed(seed + 1)
    for p in moe.parameters():
        if p is not moe.gate.weight and p.dtype.is_floating_point:
            p.data = torch.randn(p.shape, generator=g) * 0.2
    return moe


@pytest.mark.parametrize("router", list(ROUTERS))
def test_the_moe_layer_routes_in_c_and_gives_the_torch_codes_output(router: str) -> None:
    moe = _moe(3, **ROUTERS[router])
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    want = moe(x)
    moe.bind_kernels(CpuKernels(moe_route=_kernels()))
    assert moe.router is not None and moe.router.routes(x, moe.gate)
    assert torch.allclose(moe(x), want, rtol=1e-5, atol=1e-6)


def test_route_refuses_what_it_does_not_take() -> None:
    k, gate = _kernels(), _gate(16, 4, 2, seed=0)
    assert k.routes(torch.randn(2, 16), gate)
    assert not k.routes(torch.randn(2, 8), gate)  # another width
    assert not k.routes(torch.randn(2, 16).half(), gate)  # a dtype it has no entry for
    gate.top_k = 5
    assert not k.routes(torch.randn(2, 16), gate)  # more choices than experts
    gate.top_k, gate.weight.data = 2, gate.weight.data.bfloat16()
    assert not k.routes(torch.randn(2, 16), gate)  # the router is float32
    lone = _gate(16, 4, 2, seed=0, scoring="sigmoid", num_groups=4, topk_groups=2)
    assert not k.routes(torch.randn(2, 16), lone)  # sigmoid groups ranked by their two best, of one expert each
