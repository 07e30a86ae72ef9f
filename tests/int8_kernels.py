"""What the tests of our W8A8 kernels (i8mm, i8amx, i8avx2) share: a random weight, and the checks every kernel
must pass whatever its instructions: exact int32 sums at the int8 extremes (-128 x -128 included), no rows in, no
rows out, and an all-zero row that gives zero without disturbing its neighbours."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.quant.weights import Int8Weight, quantize_tokens

Linear = Callable[[torch.Tensor, Any], torch.Tensor]  # kernel.linear(x, packed)
Pack = Callable[..., Any]  # pack(q, scale) → the kernel's packed weight


def int8_weight(n: int, k: int, seed: int = 0) -> Int8Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return Int8Weight(q, torch.rand(n, generator=g) * 0.02 + 1e-3)


def assert_products_at_the_int8_extremes_are_exact(linear: Linear, pack: Pack) -> None:
    """-128 x -128 and 127 x -128 in every pair of k: a u8 x s8 pair sum in int16 (VPMADDUBSW) would saturate;
    the kernels' int32 sums must not."""
    q = torch.full((32, 64), -128, dtype=torch.int8)
    q[:, 1::2] = 127
    w = Int8Weight(q, torch.ones(32))
    x = torch.tensor([[127.0, -127.0] * 32, [-128.0, 127.0] * 32, [-128.0, -128.0] * 32, [1.0] * 64])
    got = linear(x, pack(w.q, w.scale)).double()
    xq, xs = quantize_tokens(x)  # these rows quantize to exactly these steps
    assert int(xq.min()) == -128
    exact = (xq.long() @ w.q.long().t()).double() * xs.double()  # integer sums, then the scales
    assert torch.allclose(got, exact, rtol=1e-6, atol=0)


def assert_no_rows_give_no_rows(linear: Linear, pack: Pack) -> None:
    w = int8_weight(64, 128)
    assert linear(torch.empty(0, 128), pack(w.q, w.scale)).shape == (0, 64)


def assert_an_all_zero_row_gives_zero_alone(linear: Linear, pack: Pack) -> None:
    w = int8_weight(64, 128)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    x[1] = 0
    got = linear(x, pack(w.q, w.scale))
    want = w.reference(x[[0, 2]], None)
    assert bool((got[1] == 0).all()) and (got[[0, 2]] - want).abs().max() <= 1e-5 * want.abs().max()
