"""engine.kernels.op_choice: a kernel beside the GEMMs is bound only where it beats the torch code."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.kernels import decode_attn, pointwise
from engine.kernels.op_choice import choose_kernels, decode_attention_wins, faster
from engine.kernels.select import PlanCache
from engine.layers.attention import PagedAttention


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
    slow_kernel = choose_kernels(model, pw, None, torch.float32, lambda fn: 1.0, None)
    assert slow_kernel.rms_norm is None  # every call "takes" 1 s: a tie is not a win
    forced = choose_kernels(model, pw, None, torch.float32, None, None)
    assert forced.rms_norm is pw and forced.decode_attn is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_timing_runs_both_paths_to_the_same_answer(dtype: torch.dtype) -> None:
    """The probe decodes through the kernel and through SDPA; both must give the same output, or the
    timing compares different work."""
    k = decode_attn.kernel()
    if k is None:
        pytest.skip("the decode attention kernel did not build here (the warning says why)")
    layer = PagedAttention(8, 2, 64, 64**-0.5)
    outs: list[torch.Tensor] = []

    def record(fn: Callable[[], object]) -> float:
        outs.append(fn())  # type: ignore[arg-type]
        return 0.0

    decode_attention_wins(k, layer, dtype, record, None)
    kernel_out, sdpa_out = outs[0], outs[1]
    torch.testing.assert_close(kernel_out.float(), sdpa_out.float(), rtol=2e-2, atol=2e-2)
