"""How closely a quantized model follows the one it came from: both run through our engine over the start of
Python's pydoc topics (the calibration runs read them from the end), float32, by the reference math (quantized
layers dequantized, W8A8's activations quantized per token as at run time); at every position we compare the
next-token choice (top-1 agreement) and each model's perplexity on the text."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.loader import DirectoryFiles
from engine.quant.calibrate import float_core, prefill, pydoc_topics
from engine.tokenizer import Tokenizer

FIDELITY_TOKENS = 2048
ROWS = 256  # positions per LM-head call: [ROWS, vocab] float32 logits at a time, not [tokens, vocab]


def fidelity_text() -> str:
    """The pydoc topics in order from the start (calibration reads them from the end)."""
    return pydoc_topics(reverse=False)


def fidelity_ids(model: str | Path, positions: int = FIDELITY_TOKENS) -> list[int]:
    """positions + 1 tokens of the fidelity text: each position's logits predict the token after it."""
    ids = Tokenizer.from_files(DirectoryFiles(model).read).encode(fidelity_text(), add_special_tokens=False)
    if len(ids) <= positions:
        raise ModelLoadError(f"the fidelity text has {len(ids)} tokens; {positions} positions need one more")
    return ids[: positions + 1]


@dataclass(slots=True)
class Scores:
    """One model on the fidelity text: its top-1 next token, the log-probability it gives the actual next token
    and how far its top logit leads the second, at each position."""

    top1: torch.Tensor  # [positions] int64
    logprob: torch.Tensor  # [positions] float64
    margin: torch.Tensor  # [positions] float64: top-1 logit minus top-2 (a small one flips at any perturbation)

    @property
    def perplexity(self) -> float:
        return math.exp(-float(self.logprob.mean()))


def score(model: str | Path, ids: list[int], dtype: str = "float32") -> Scores:
    """Run `ids` through `model` in one prefill and score every position but the last. `dtype` bfloat16: the
    same in bf16 math (what bf16 rounding alone moves, the yardstick for a quantized copy's agreement)."""
    # the reference math: the oneDNN int8 GEMM is exact too but takes ~20 s a prompt-sized call on some CPUs
    core = float_core(model, len(ids), gemm_path="torch", dtype=dtype)
    net = core.runner.model
    hidden: list[torch.Tensor] = []
    net.register_forward_hook(lambda _m, _args, out: hidden.append(out.detach()))  # [T, hidden], every position
    prefill(core, ids)
    h = hidden[0] if hidden else torch.empty(0)
    if h.shape[0] != len(ids):
        raise ModelLoadError(f"expected one prefill of {len(ids)} positions; the first forward had {h.shape[0]}")
    h = h[: len(ids) - 1]  # the last position predicts past the text
    with torch.inference_mode():
        return scores((net.compute_logits(h[i : i + ROWS]) for i in range(0, len(h), ROWS)), ids)


def scores(logits: Iterable[torch.Tensor], ids: list[int]) -> Scores:
    """Scores from a model's logits over `ids`, given in consecutive slices of positions (each [rows, vocab],
    covering every position but the last), each slice taken to float64 on its own."""
    target = torch.tensor(ids[1:])
    top1, logprob, margin = [], [], []
    at = 0
    for chunk in logits:
        chunk = chunk.double()
        top1.append(chunk.argmax(dim=-1))  # a tie (frequent in bf16 logits) goes to the lowest id, as greedy's
        top2 = chunk.topk(2, dim=-1).values
        margin.append(top2[:, 0] - top2[:, 1])
        logprob.append(torch.log_softmax(chunk, dim=-1).gather(1, target[at : at + chunk.shape[0], None])[:, 0])
        at += chunk.shape[0]
    if at != len(target):
        raise ValueError(f"logits for {at} positions; {len(target)} expected")
    return Scores(torch.cat(top1), torch.cat(logprob), torch.cat(margin))


@dataclass(slots=True, frozen=True)
class Fidelity:
    """A candidate against its reference over the same positions."""

    positions: int
    top1_agreement: float  # the share of positions where both pick the same next token
    perplexity_reference: float
    perplexity_candidate: float

    @property
    def perplexity_change(self) -> float:
        """Relative: 0.03 is 3% higher than the reference's."""
        return self.perplexity_candidate / self.perplexity_reference - 1


def compare(reference: Scores, candidate: Scores) -> Fidelity:
    if reference.top1.shape != candidate.top1.shape:
        raise ValueError("the two models were scored over different positions")
    agree = float((reference.top1 == candidate.top1).double().mean())
    return Fidelity(len(reference.top1), agree, reference.perplexity, candidate.perplexity)


def fidelity(reference: str | Path, candidate: str | Path, positions: int = FIDELITY_TOKENS) -> Fidelity:
    """`candidate` (e.g. a quantized copy of `reference`) against `reference` over `positions` positions of
    the fidelity text, tokenized by the reference's tokenizer."""
    ids = fidelity_ids(reference, positions)
    return compare(score(reference, ids), score(candidate, ids))
