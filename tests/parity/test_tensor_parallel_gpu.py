"""Tensor parallel over NCCL: TP=2 on two CUDA devices against TP=1 on one (run on a machine with two GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parity.conftest import build_llama, make_core, mixed_prompts, run_core, step_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one rank per device)"),
]


def test_tp2_over_nccl_matches_tp1(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "m")
    prompts = mixed_prompts(4)
    cfg = dict(device="cuda", max_num_seqs=4, block_size=8, enable_prefix_caching=False)
    one = make_core(model, **cfg)
    tokens1 = run_core(one, prompts, 16)
    logits1 = step_logits(make_core(model, **cfg), prompts, 4)
    two = make_core(model, **cfg, tensor_parallel_size=2)
    try:
        tokens2 = run_core(two, prompts, 16)
        logits2 = step_logits(two, {f"again-{r}": p for r, p in prompts.items()}, 4)
        ranks = two.stats()["ranks"]
    finally:
        two.close()
    assert tokens2 == tokens1
    for a, b in zip(logits1, logits2):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert ranks[0]["comm_seconds"] > 0
