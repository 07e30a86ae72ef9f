"""Per-step attention metadata, set by the runner before the forward pass and read by attention layers."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillMeta:
    """Prefill query rows [start, end) of the step's tokens: a chunk of >= 2 tokens of one sequence, or
    `num_seqs` whole prompts of one length side by side, which attention runs as one batch."""

    start: int
    end: int
    context_len: int  # tokens of the sequence in the cache after this step's write
    block_ids: torch.Tensor | None  # [num_blocks] int64, only when earlier tokens must be read from the cache
    mask: torch.Tensor | None  # [q_len, context_len] bool (True = attend), with block_ids
    num_seqs: int = 1  # > 1 only for whole prompts (block_ids None): rows hold num_seqs x context_len tokens


@dataclass(slots=True)
class AttentionContext:
    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V go in the flattened cache
    num_decodes: int  # rows [0, num_decodes) are single-token queries, one per sequence
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int64
    # [D, 1, 1, max_blocks * block_size] in the model's dtype, added to the scores: 0 attends, -inf hides padding.
    # NOTE: additive, built once per step: SDPA turns a bool mask into this in every layer otherwise.
    decode_mask: torch.Tensor | None
    prefills: list[PrefillMeta]
    decode_context_lens: torch.Tensor | None = None  # [D] int64: cached tokens per decode, this step's included
    # the rows whose final hidden state is read (the sampled ones, in the order they are read), where that is fewer
    # than all: the last decoder layer runs its MLP (and the final norm) on those only. None: every row.
    keep_rows: torch.Tensor | None = None


class _Current(threading.local):
    ctx: AttentionContext | None = None


# NOTE: per thread: data-parallel replicas step their models at the same time, each in its own thread
_CURRENT = _Current()


def set_context(ctx: AttentionContext) -> None:
    _CURRENT.ctx = ctx


def get_context() -> AttentionContext:
    ctx = _CURRENT.ctx
    assert ctx is not None, "attention ran outside ModelRunner.execute"
    return ctx


def current_context() -> AttentionContext | None:
    """The step's context, or None outside ModelRunner.execute (a model called on its own)."""
    return _CURRENT.ctx


def reset_context() -> None:
    _CURRENT.ctx = None
