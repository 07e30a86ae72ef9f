from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.context import AttentionContext, PrefillMeta, get_context
from engine.kernels.decode_attn import DecodeAttention, runs_at
from engine.kernels.prefill_attn_amx import PrefillAttention

if TYPE_CHECKING:
    from engine.kernels.kernel_set import CpuKernels


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over each sequence's cached context.

    Cache tensors are bound by the runner: [num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # NOTE: K/V rows gathered from the cache land in buffers shared by every layer of the model: a fresh
        # tensor per layer and step costs page faults, which are dear on a VM.
        self.scratch = scratch or (torch.empty(0), torch.empty(0))
        self.kernel: DecodeAttention | None = None  # reads the paged cache in place (engine.kernels.decode_attn)
        self.kernel_at: tuple[bool, ...] = ()  # by decode batch class: whether the kernel runs (CpuKernels)
        self.prefill_in_place = 0  # prompt chunks up to this long go through the kernel too (CpuKernels)
        self.prefill_kernel: PrefillAttention | None = None  # whole prompts' causal attention (CpuKernels)
        self.prefill_up_to = 0  # ... for prompts of up to this many tokens

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1] if self.k_cache.dim() == 4 else 16

    def bind_kernels(self, kernels: CpuKernels) -> None:
        k = kernels.decode_attn
        fits = k is not None and k.takes(
            self.num_heads, self.num_kv_heads, self.head_dim, self.k_cache.dtype, self.block_size
        )
        self.kernel = k if fits else None
        self.kernel_at = kernels.decode_attn_at if fits else ()
        self.prefill_in_place = kernels.prefill_in_place if fits else 0
        p = kernels.prefill_attn
        takes = p is not None and p.takes(self.num_heads, self.num_kv_heads, self.head_dim, self.k_cache.dtype)
        self.prefill_kernel = p if takes else None
        self.prefill_up_to = kernels.prefill_attn_up_to if takes else 0

    def in_place(self, rows: int) -> bool:
        """Whether a decode step of `rows` rows reads the cache in place (no mask needed)."""
        return self.kernel is not None and runs_at(self.kernel_at, rows)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D]  k, v: [T, KV, D]  ->  [T, H * D]
        ctx = get_context()
        kv, d = self.num_kv_heads, self.head_dim
        self.k_cache.view(-1, kv, d).index_copy_(0, ctx.slot_mapping, k)
        self.v_cache.view(-1, kv, d).index_copy_(0, ctx.slot_mapping, v)
        nd = ctx.num_decodes
        if not ctx.prefills:
            return self._decode(q, ctx).flatten(1)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], ctx)
        for p in ctx.prefills:
            out[p.start : p.end] = self._prefill(q[p.start : p.end], k[p.start : p.end], v[p.start : p.end], p)
        return out.flatten(1)

    def _gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks: [n * block_size, KV, D] each, in the shared buffers."""
        shape = (block_ids.shape[0], *self.k_cache.shape[1:])
        k = torch.index_select(self.k_cache, 0, block_ids, out=self.scratch[0].resize_(shape))
        v = torch.index_select(self.v_cache, 0, block_ids, out=self.scratch[1].resize_(shape))
        return k.view(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads, self.head_dim)

    def _decode(self, q: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        block_tables, mask = ctx.decode_block_tables, ctx.decode_mask
        assert block_tables is not None
        if self.kernel is not None and ctx.decode_context_lens is not None and self.in_place(q.shape[0]):
            return self.kernel(q, self.k_cache, self.v_cache, block_tables, ctx.decode_context_lens, self.scale)
        assert mask is not None
        b, kv, d = q.shape[0], self.num_kv_heads, self.head_dim
        k, v = self._gather(block_tables.flatten())
        # NOTE: a query's G = H / KV heads sharing one KV head play the role of G query positions, so
        # SDPA runs without repeating K/V; the additive mask hides padding past each context's length.
        k = k.view(b, -1, kv, d).transpose(1, 2)  # [B, KV, L, D]
        v = v.view(b, -1, kv, d).transpose(1, 2)
        qg = q.view(b, kv, -1, d)  # [B, KV, G, D]
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(b, self.num_heads, d)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: PrefillMeta) -> torch.Tensor:
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        gqa = h != kv
        if p.block_ids is None:  # whole prompts: each attends to its own fresh K/V
            n = p.num_seqs
            if self.prefill_kernel is not None and (p.end - p.start) // n <= self.prefill_up_to:
                return self.prefill_kernel(q, k, v, n, self.scale)
            out = F.scaled_dot_product_attention(
                q.view(n, -1, h, d).transpose(1, 2),
                k.view(n, -1, kv, d).transpose(1, 2),
                v.view(n, -1, kv, d).transpose(1, 2),
                is_causal=True,
                scale=self.scale,
                enable_gqa=gqa,
            )  # [n, H, S, D]
            return out.transpose(1, 2).reshape(-1, h, d)
        # earlier tokens (prefix-cache hits or earlier chunks) live in the cache
        # NOTE: the kernel's limit was measured on whole prompts; a chunk after cached tokens is the same work plus
        # their keys, which the kernel reads in place where SDPA needs them gathered first
        if self.prefill_kernel is not None and p.end - p.start <= self.prefill_up_to and self.block_size % 16 == 0:
            return self.prefill_kernel.paged(q, self.k_cache, self.v_cache, p.block_ids, p.context_len, self.scale)
        kc, vc = self._gather(p.block_ids)
        # NOTE: 4-D [1, H, S, D], not 3-D: torch's CPU SDPA takes its flash kernel for a masked 4-D call, and
        # the math fallback for the 3-D one, 4-7x slower (a 150-token chunk after 30 cached tokens, SmolLM2's
        # heads: 157 against 1,059 us a layer, measured on a 2-core Xeon)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            kc[: p.context_len].transpose(0, 1)[None],
            vc[: p.context_len].transpose(0, 1)[None],
            attn_mask=p.mask,
            scale=self.scale,
            enable_gqa=gqa,
        )
        return out[0].transpose(0, 1)  # [S, H, D]
