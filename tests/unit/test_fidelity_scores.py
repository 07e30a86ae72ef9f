"""engine.quant.fidelity.scores: top-1, the log-probability of the actual next token and the top-two margin from
logits given in slices, and its refusal of logits that do not cover the text."""

from __future__ import annotations

import math

import pytest
import torch

from engine.quant.fidelity import compare, scores


def test_scores_from_slices() -> None:
    ids = [5, 2, 0, 1]  # three positions predict 2, 0, 1
    logits = torch.tensor([[0.0, 1.0, 3.0], [2.0, 1.9, -1.0], [0.0, 0.5, 0.25]])
    s = scores(logits.split(2), ids)
    assert s.top1.tolist() == [2, 0, 1]
    assert torch.allclose(s.margin, torch.tensor([2.0, 0.1, 0.25], dtype=torch.float64))
    want = torch.log_softmax(logits.double(), -1)[[0, 1, 2], [2, 0, 1]]
    assert torch.allclose(s.logprob, want)
    assert s.perplexity == pytest.approx(math.exp(-float(want.mean())))


def test_compare_counts_agreeing_positions() -> None:
    ids = [0, 1, 2, 0]
    a = scores([torch.eye(3)], ids)
    b = scores([torch.eye(3)[[0, 2, 2]]], ids)  # the second position picks 2, not 1
    f = compare(a, b)
    assert f.positions == 3 and f.top1_agreement == pytest.approx(2 / 3)


def test_scores_refuse_logits_that_miss_positions() -> None:
    with pytest.raises(ValueError, match="2 positions; 3 expected"):
        scores([torch.zeros(2, 4)], [0, 1, 2, 3])
