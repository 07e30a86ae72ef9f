"""The pre-norm decoder both model families share: what differs is how a layer's parts are built, not how
they run. Subclasses set the attributes; the forward passes live here once."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """norm → attention → norm → MLP, the residual add fused into each RMSNorm."""

    input_layernorm: RMSNorm
    self_attn: nn.Module
    post_attention_layernorm: RMSNorm
    mlp: nn.Module

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """Token embeddings → decoder layers → final norm: [T] ids to [T, hidden] states."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # NOTE: the table may be stored as bf16 under float32 math (engine.kernels.wbf16); widening is exact
        x, residual = self.embed_tokens(input_ids).to(self.norm.weight.dtype), None  # [T, hidden]
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        return self.norm(x, residual)[0]
