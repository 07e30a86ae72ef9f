"""The pre-norm decoder both model families share: what differs is how a layer's parts are built, not how
they run. Subclasses set the attributes; the forward passes live here once."""

from __future__ import annotations

import torch
from torch import nn

from engine.context import current_context
from engine.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """norm → attention → norm → MLP, the residual add fused into each RMSNorm."""

    input_layernorm: RMSNorm
    self_attn: nn.Module
    post_attention_layernorm: RMSNorm
    mlp: nn.Module

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`keep`: only these rows go on past the attention (which writes every row's K/V to the cache)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin)
        if keep is not None:
            h, residual = h[keep], residual[keep]
            if not keep.numel():  # nothing is read from this step (a prompt chunk that samples nothing)
                return h, residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """Token embeddings → decoder layers → final norm: [T] ids to [T, hidden] states."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, hidden], or the context's keep_rows of it where it names some (a step with prompt rows that are not
        sampled): the last layer's MLP and the final norm run on those rows only.

        WHY: a prompt's rows but its last only fill the cache, which the last layer's attention has done; its MLP
        over the rest was ~4% of a 24-layer model's prefill arithmetic for nothing."""
        # NOTE: the table may be stored as bf16 under float32 math (engine.kernels.wbf16); widening is exact
        x, residual = self.embed_tokens(input_ids).to(self.norm.weight.dtype), None  # [T, hidden]
        keep = _keep_rows()
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, keep if i == last else None)
        return self.norm(x, residual)[0]


def _keep_rows() -> torch.Tensor | None:
    ctx = current_context()
    return ctx.keep_rows if ctx is not None else None
