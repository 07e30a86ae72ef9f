"""A MoE layer's routing and grouping in one C pass (pointwise.c's moe_route, engine.layers.moe.MoE.router):
the experts MoEGate (transformers' greedy softmax router) chooses, its weights within float32 rounding, the pairs
in the order of a stable argsort, and the rows the experts read; the MoE layer's output is the torch code's; other
routers keep the torch code."""

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
    gate.weight.data = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(seed)) * hidden**-0.5
    return gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "experts", "top_k"), [(1, 1024, 16, 4), (7, 100, 8, 2), (300, 64, 160, 6)]
)
def test_routing_is_moegates_and_the_pairs_are_grouped_as_a_stable_argsort(
    dtype: torch.dtype, tokens: int, hidden: int, experts: int, top_k: int
) -> None:
    gate = _gate(hidden, experts, top_k, seed=tokens, scale=2.5)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    want_w, want_ids = gate(x)
    w, ids, order, counts, xs = _kernels().route(x, gate.weight, top_k, 2.5)
    assert torch.equal(ids, want_ids)  # best first, as topk
    assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-7)
    assert torch.equal(order, want_ids.flatten().argsort(stable=True))
    assert torch.equal(counts, torch.bincount(want_ids.flatten(), minlength=experts))
    assert torch.equal(xs, x[order // top_k])


def test_a_tie_goes_to_the_lower_expert() -> None:
    """Equal scores (a router with two equal rows): the lower-numbered expert comes first, as torch.topk's CPU
    kernel orders equal values by index."""
    gate = _gate(16, 4, 2, seed=0)
    gate.weight.data[3] = gate.weight.data[1]
    gate.weight.data[0] = gate.weight.data[1] * 0.5 - 3  # below both
    gate.weight.data[2] = gate.weight.data[1] * 0.5 - 3
    x = torch.ones(1, 16)
    _, ids, *_ = _kernels().route(x, gate.weight, 2, 1.0)
    assert ids.tolist() == [[1, 3]]


def _moe(seed: int, **over: object) -> MoE:
    hidden, experts = 32, 8
    moe = MoE(_gate(hidden, experts, 2, seed, scale=1.5, **over), hidden, 16, 1, "silu")
    g = torch.Generator().manual_seed(seed + 1)
    for p in moe.parameters():
        if p is not moe.gate.weight and p.dtype.is_floating_point:
            p.data = torch.randn(p.shape, generator=g) * 0.2
    return moe


def test_the_moe_layer_routes_in_c_and_gives_the_torch_codes_output() -> None:
    moe = _moe(3)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    want = moe(x)
    moe.bind_kernels(CpuKernels(moe_route=_kernels()))
    assert moe.router is not None
    assert torch.allclose(moe(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "over", [{"scoring": "sigmoid"}, {"num_groups": 2, "topk_groups": 1}], ids=["sigmoid", "group-limited"]
)
def test_other_routers_keep_the_torch_code(over: dict) -> None:
    moe = _moe(5, **over)
    if over.get("scoring") == "sigmoid":
        moe.gate.e_score_correction_bias.data = torch.zeros(8)
    assert not moe.routes_in_c()
    moe.bind_kernels(CpuKernels(moe_route=_kernels()))
    assert moe.router is None
    x = torch.randn(3, 32)
    assert moe(x).shape == (3, 32)


def test_route_refuses_what_it_does_not_take() -> None:
    k, gate = _kernels(), _gate(16, 4, 2, seed=0)
    assert k.routes(torch.randn(2, 16), gate.weight, 2)
    assert not k.routes(torch.randn(2, 8), gate.weight, 2)  # another width
    assert not k.routes(torch.randn(2, 16).half(), gate.weight, 2)  # a dtype it has no entry for
    assert not k.routes(torch.randn(2, 16), gate.weight.bfloat16(), 2)  # the router is float32
    assert not k.routes(torch.randn(2, 16), gate.weight, 5)  # more choices than experts
