"""How closely a quantized model follows the one it came from: both run through our engine over the start of
Python's pydoc topics (the calibration runs read them from the end), float32, by the reference math (quantized
layers dequantized, W8A8's activations quantized per token as at run time); at every position we compare the
next-token choice (top-1 agreement) and each model's perplexity on the text."""

from __future__ import annotations

import math
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
    """One model on the fidelity text: its top-1 next token and the log-probability it gives the actual next
    token, at each position."""

    top1: torch.Tensor  # [positions] int64
    logprob: torch.Tensor  # [positions] float64

    @property
    def perplexity(self) -> float:
        return math.exp(-float(self.logprob.mean()))


def score(model: str | Path, ids: list[int]) -> Scores:
    """Run `ids` through `model` in one prefill and score every position but the last."""
    # the reference math: the oneDNN int8 GEMM is exact too but takes ~20 s a prompt-sized call on some CPUs
    core = float_core(model, len(ids), gemm_path="torch")
    net = core.runner.model
    hidden: list[torch.Tensor] = []
    net.register_forward_hook(lambda _m, _args, out: hidden.append(out.detach()))  # [T, hidden], every position
    prefill(core, ids)
    h = hidden[0] if hidden else torch.empty(0)
    if h.shape[0] != len(ids):
        raise ModelLoadError(f"expected one prefill of {len(ids)} positions; the first forward had {h.shape[0]}")
    target = torch.tensor(ids[1:])
    top1, logprob = [], []
    with torch.inference_mode():
        for i in range(0, len(ids) - 1, ROWS):
            logits = net.compute_logits(h[i : min(i + ROWS, len(ids) - 1)]).double()
            top1.append(logits.argmax(dim=-1))
            lp = torch.log_softmax(logits, dim=-1)
            logprob.append(lp.gather(1, target[i : i + logits.shape[0], None])[:, 0])
    return Scores(torch.cat(top1), torch.cat(logprob))


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
