from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.context import get_context


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over each sequence's cached context.

    Cache tensors are bound by the runner: [num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D]  k, v: [T, KV, D]  ->  [T, H * D]
        ctx = get_context()
        kv, d = self.num_kv_heads, self.head_dim
        self.k_cache.view(-1, kv, d).index_copy_(0, ctx.slot_mapping, k)
        self.v_cache.view(-1, kv, d).index_copy_(0, ctx.slot_mapping, v)
        nd = ctx.num_decodes
        if not ctx.prefills:
            return self._decode(q, ctx.decode_block_tables, ctx.decode_mask).flatten(1)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], ctx.decode_block_tables, ctx.decode_mask)
        for p in ctx.prefills:
            out[p.start : p.end] = self._prefill(q[p.start : p.end], k[p.start : p.end], v[p.start : p.end], p)
        return out.flatten(1)

    def _decode(self, q: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, kv, d = q.shape[0], self.num_kv_heads, self.head_dim
        # NOTE: a query's G = H / KV heads sharing one KV head play the role of G query positions, so
        # SDPA runs without repeating K/V; the mask hides padding past each context's length.
        k = self.k_cache[block_tables].view(b, -1, kv, d).transpose(1, 2)  # [B, KV, L, D]
        v = self.v_cache[block_tables].view(b, -1, kv, d).transpose(1, 2)
        qg = q.view(b, kv, -1, d)  # [B, KV, G, D]
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(b, self.num_heads, d)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p) -> torch.Tensor:
        kv, d = self.num_kv_heads, self.head_dim
        gqa = self.num_heads != kv
        if p.block_ids is None:  # nothing before this chunk: attend to the fresh K/V
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                is_causal=True,
                scale=self.scale,
                enable_gqa=gqa,
            )
        else:  # earlier tokens (prefix-cache hits or earlier chunks) live in the cache
            n = p.context_len
            kc = self.k_cache[p.block_ids].view(-1, kv, d)[:n].transpose(0, 1)  # [KV, N, D]
            vc = self.v_cache[p.block_ids].view(-1, kv, d)[:n].transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), kc, vc, attn_mask=p.mask, scale=self.scale, enable_gqa=gqa
            )
        return out.transpose(0, 1)  # [S, H, D]
