"""Token bitmasks: one int32 word per 32 tokens, bit set = allowed. Filled per step for the constrained rows of
the batch (llguidance, GIL released), applied to the logits by the sampler before anything else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from engine.kernels import bitmask as kernel


@dataclass(slots=True)
class GrammarMask:
    """The allowed tokens of some rows of a batch: `words[j]` is row `rows[j]`'s mask."""

    rows: list[int]
    words: torch.Tensor  # [len(rows), ceil(V / 32)] int32
    failed: bool = False  # the fill raised: these rows have no mask

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` [B, V] with every token a row's grammar forbids at -inf."""
        out = logits.clone()
        k = kernel.kernel()
        if k is not None and k.takes(out, self.words):
            k.apply(out, self.rows, self.words)
            return out
        return apply_torch(out, self.rows, self.words)

    def select(self, row: int) -> GrammarMask | None:
        """The mask of batch row `row` alone (as row 0), or None if that row is unconstrained."""
        if row not in self.rows:
            return None
        j = self.rows.index(row)
        return GrammarMask([0], self.words[j : j + 1])


def apply_torch(logits: torch.Tensor, rows: list[int], words: torch.Tensor) -> torch.Tensor:
    """The definition (and the path without a C compiler): unpack the bits, fill the forbidden with -inf."""
    vocab = logits.shape[1]
    bits = np.unpackbits(words.contiguous().numpy().view(np.uint8), axis=1, bitorder="little", count=vocab)
    allowed = torch.from_numpy(bits.view(np.bool_)).to(logits.device)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = torch.where(allowed, logits[index], float("-inf"))
    return logits


def fill_masks(
    executor: llguidance.LLExecutor, matchers: Sequence[tuple[int, llguidance.LLMatcher]], vocab_size: int
) -> GrammarMask:
    """Each (row, matcher)'s next-token mask, computed in parallel by llguidance's executor."""
    words = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    executor.unsafe_compute_mask_ptr(
        [(m, j) for j, (_, m) in enumerate(matchers)], words.data_ptr(), words.shape[1] * 4, len(matchers)
    )
    return GrammarMask([row for row, _ in matchers], words)
