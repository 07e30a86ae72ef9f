"""Tensor-parallel pieces: which part of each checkpoint tensor a rank holds, and the layers that shard.

A column-parallel linear layer holds a slice of the output rows (QKV, gate/up: no communication); a row-parallel
one a slice of the input columns, so its partial outputs are summed by one all-reduce, which the model's forward
calls where the data flow needs it (after O and after down). The vocabulary is split in rank order for the
embedding (masked lookup + all-reduce) and the LM head (local logits + all-gather). The loader reads only the
slice a module's `tp_slices` names (engine.loader), so a rank never holds another rank's weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ConfigError
from engine.layers.linear import Linear
from engine.parallel.group import Group, SingleGroup


@dataclass(frozen=True, slots=True)
class Part:
    """Checkpoint elements [start, start + length) along `dim`; a parameter longer than that is zero-padded."""

    dim: int
    start: int
    length: int
    zero: bool = False  # this rank holds zeros, whatever the checkpoint says


ZERO = Part(0, 0, 0, zero=True)  # a row-parallel bias is added once, by rank 0, before the all-reduce


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split(total: int, group: Group, what: str) -> tuple[int, int]:
    """This rank's (start, length) of `total` units split evenly; ConfigError when they do not divide."""
    if total % group.size:
        raise ConfigError(f"tensor_parallel_size={group.size} must divide {what} ({total})")
    n = total // group.size
    return group.rank * n, n


def column_linear(
    in_features: int, out_features: int, bias: bool, group: Group, what: str = "", cls: type[Linear] = Linear
) -> Linear:
    """This rank's rows of the output: y[:, rows] = x W[rows]^T (+ b[rows])."""
    start, n = split(out_features, group, what or f"the output size {out_features}")
    lin = cls(in_features, n, bias)
    if group.size > 1:
        lin.tp_slices = {"weight": Part(0, start, n), "bias": Part(0, start, n)}  # type: ignore[attr-defined]
    return lin


def row_linear(in_features: int, out_features: int, bias: bool, group: Group, what: str = "") -> Linear:
    """This rank's columns of the input: a partial y that the caller all-reduces. The bias is rank 0's."""
    start, n = split(in_features, group, what or f"the input size {in_features}")
    lin = Linear(n, out_features, bias)
    if group.size > 1:
        lin.tp_slices = {"weight": Part(1, start, n), "bias": Part(0, 0, out_features) if group.rank == 0 else ZERO}  # type: ignore[attr-defined]
    return lin


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """A rank's attention heads: query heads [q_start, q_start + num_heads), KV heads [kv_start, ...)."""

    num_heads: int
    q_start: int
    num_kv_heads: int
    kv_start: int


def split_heads(num_heads: int, num_kv_heads: int, group: Group) -> HeadSplit:
    """Query heads split evenly; KV heads too, or, with fewer KV heads than ranks, the one a rank's queries use
    replicated on every rank that needs it (its query heads then all map to that KV head)."""
    p, r = group.size, group.rank
    q_start, h = split(num_heads, group, "num_attention_heads")
    if num_kv_heads >= p:
        kv_start, kv = split(num_kv_heads, group, "num_key_value_heads")
    elif p % num_kv_heads == 0:
        kv_start, kv = r * num_kv_heads // p, 1
    else:
        raise ConfigError(
            f"tensor_parallel_size={p} must divide num_key_value_heads ({num_kv_heads}) or be a multiple of it"
        )
    return HeadSplit(h, q_start, kv, kv_start)


class VocabEmbedding(nn.Embedding):
    """Rows [start, start + ceil(V / ranks)) of the token table; ids outside them look up zeros, and the
    all-reduce puts each id's row together. The last rank's rows past V are zero padding."""

    def __init__(self, vocab_size: int, hidden_size: int, group: Group | None = None) -> None:
        g = group or SingleGroup()
        per = cdiv(vocab_size, g.size)
        start = g.rank * per
        # NOTE: a frozen, uninitialised table: the checkpoint fills it, so random init would only touch memory
        table = nn.Parameter(torch.empty(per, hidden_size), requires_grad=False)
        super().__init__(per, hidden_size, _weight=table, _freeze=True)
        self.group, self.vocab_start, self.vocab_local = g, start, max(0, min(per, vocab_size - start))
        self.out_dtype = torch.get_default_dtype()  # the model's math dtype: the table may be stored as bf16
        if g.size > 1:
            self.tp_slices = {"weight": Part(0, start, self.vocab_local)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).to(self.out_dtype)
        return self.group.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def vocab_head(hidden_size: int, vocab_size: int, group: Group) -> Linear:
    """The LM head's rows for this rank's vocabulary slice, as VocabEmbedding splits it (so a tied head shares
    the table); `gather_logits` puts the vocabulary back together."""
    per = cdiv(vocab_size, group.size)
    head = Linear(hidden_size, per)
    if group.size > 1:
        start = group.rank * per
        head.tp_slices = {"weight": Part(0, start, max(0, min(per, vocab_size - start)))}  # type: ignore[attr-defined]
    return head


def gather_logits(local: torch.Tensor, vocab_size: int, group: Group) -> torch.Tensor:
    """[B, V / ranks] on each rank → [B, V] on each, the padding dropped."""
    if group.size == 1:
        return local
    return group.all_gather(local)[:, :vocab_size]
