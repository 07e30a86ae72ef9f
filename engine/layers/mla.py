"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents, not per-head K/V."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.context import AttentionContext, PrefillMeta, get_context
from engine.kernels.decode_attn import runs_at
from engine.layers.linear import Linear, MergedLinear
from engine.layers.norm import RMSNorm
from engine.layers.parallel import column_linear, row_linear, split
from engine.layers.rotary import apply_rotary, apply_rotary_interleaved
from engine.parallel.group import Group, SingleGroup
from engine.quant.absorbed_key import KeyPieces, key_pieces
from engine.quant.weights import Int4Weight

if TYPE_CHECKING:
    from engine.kernels.decode_attn import DecodeAttention
    from engine.kernels.grouped import GroupedLinear, SplitGrouped
    from engine.kernels.kernel_set import CpuKernels
    from engine.quant.absorbed_key import GroupScaledKey
    from engine.quant.grouped import GroupedQuantLinear


class _UnpackedLinear(Linear):
    bf16_storage = False  # decode does float32 math on the plain weight
    packable = False  # NOTE: decode reads kv_b_proj's weight as W_UK / W_UV, so it keeps the plain layout


class MLAttention(nn.Module):
    """Caches, per token, the normalised KV latent c (kv_lora_rank) and the roped shared key (qk_rope_head_dim):
    kv_cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], bound by the runner.

    Prefill up-projects the latents to per-head K/V (kv_b_proj) for SDPA. Decode never does: W_UK is absorbed
    into the query (q_nope W_UK scores against c directly) and W_UV is applied after attending over c.

    Tensor parallel: each rank holds its heads of the query and KV up-projections (column-parallel) and of O
    (row-parallel, one all-reduce); the latent projections are replicated, so every rank caches every token's
    whole latent, as one rank alone would.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        bias: bool,
        scale: float,
        rope_interleave: bool,
        scratch: torch.Tensor | None = None,
        group: Group | None = None,
    ) -> None:
        super().__init__()
        g = self.group = group or SingleGroup()
        all_heads, (_, num_heads) = num_heads, split(num_heads, g, "num_attention_heads")
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.nope, self.rope, self.v_dim, self.scale = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale
        self.interleaved = rope_interleave
        self.rotate = apply_rotary_interleaved if rope_interleave else apply_rotary
        q_size, kv_a_size = all_heads * (qk_nope_head_dim + qk_rope_head_dim), kv_lora_rank + qk_rope_head_dim
        # transformers builds both latent norms with its default eps, not rms_norm_eps
        if q_lora_rank:
            self.qkv_a_proj = MergedLinear(hidden_size, {"q_a": q_lora_rank, "kv_a": kv_a_size}, bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6)
            self.q_b_proj = column_linear(q_lora_rank, q_size, False, g)
        else:
            self.q_proj = column_linear(hidden_size, q_size, False, g)
            self.kv_a_proj_with_mqa = Linear(hidden_size, kv_a_size, bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6)
        kv_b_size = all_heads * (qk_nope_head_dim + v_head_dim)
        self.kv_b_proj = column_linear(kv_lora_rank, kv_b_size, False, g, cls=_UnpackedLinear)
        self.o_proj = row_linear(all_heads * v_head_dim, hidden_size, bias, g)
        self.kv_cache = torch.empty(0)
        # NOTE: gathered cache rows land in one buffer the model's layers share (they run one at a time):
        # a fresh tensor per layer and step costs page faults once it outgrows malloc's mmap threshold
        self.scratch = torch.empty(0) if scratch is None else scratch
        self._absorbed: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None = None
        self.kernel: DecodeAttention | None = None  # decode attends over the paged latents in place
        self.kernel_at: tuple[bool, ...] = ()  # by decode batch class: whether the kernel runs (CpuKernels)
        # W_UK, W_UV as one call each (W_UK over the checkpoint's int4 rows, W_UV over its quantized rows, where
        # those timed faster: engine.kernels.op_choice)
        self.absorbed: (
            tuple[GroupedLinear | GroupScaledKey | SplitGrouped, GroupedLinear | GroupedQuantLinear | SplitGrouped]
            | None
        ) = None

    def bind_kernels(self, kernels: CpuKernels) -> None:
        k = kernels.latent_attn
        width, block = self.kv_lora_rank + self.rope, self.kv_cache.shape[1] if self.kv_cache.dim() == 3 else 16
        self.kernel = k if k is not None and k.takes_latent(self.num_heads, width, self.kv_cache.dtype, block) else None
        self.kernel_at = kernels.latent_attn_at if self.kernel is not None else ()
        self.absorbed = kernels.absorbed(self) if kernels.absorbed is not None else None
        if self.interleaved:  # in place: q_pe and k_pe are slices of fresh projections
            pairs = kernels.rope_pairs
            self.rotate = pairs.rotary_interleaved if pairs is not None else apply_rotary_interleaved

    def in_place(self, rows: int) -> bool:
        """Whether a decode step of `rows` rows attends over the paged latents in place (no mask needed)."""
        return self.kernel is not None and runs_at(self.kernel_at, rows)

    def absorbed_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per head, W_UK as a linear layer's weight ([L, N]: nope → latent) and W_UV ([V, L]: latent → value)."""
        return per_head_absorbed(self._kv_b_heads(), self.nope)

    def absorbed_quantized(self) -> list[object] | None:
        """Per head, W_UV ([V, L]) as the checkpoint quantized it (kv_b_proj's value rows: their groups or channel
        scales run along the latent, W_UV's inputs), for a quantized grouped call; None where kv_b_proj was not
        quantized. W_UK's inputs are kv_b_proj's outputs: absorbed_key_quantized."""
        kept = getattr(self.kv_b_proj, "kept", None)
        if kept is None:
            return None
        per = self.nope + self.v_dim
        return [kept.rows(h * per + self.nope, (h + 1) * per) for h in range(self.num_heads)]

    def absorbed_key_quantized(self) -> KeyPieces | None:
        """W_UK from kv_b_proj's int4 key rows as the checkpoint quantized them (engine.quant.absorbed_key: the
        scales move onto the query, per latent group); None where kv_b_proj is not symmetric W4A16."""
        kept = getattr(self.kv_b_proj, "kept", None)
        if not isinstance(kept, Int4Weight) or kept.shape[1] % kept.group_size:
            return None
        return key_pieces(kept, self.num_heads, self.nope, self.v_dim)

    def _kv_b_heads(self) -> torch.Tensor:
        return self.kv_b_proj.weight.detach().view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]  cos, sin: [T, 1, R]
        t, h, lat = x.shape[0], self.num_heads, self.kv_lora_rank
        if self.q_lora_rank:
            q, kv_a = self.qkv_a_proj(x).split([self.q_lora_rank, lat + self.rope], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q)[0])
        else:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q_nope, q_pe = q.view(t, h, -1).split([self.nope, self.rope], dim=-1)  # [T, H, N], [T, H, R]
        q_pe = self.rotate(q_pe, cos, sin)
        c, k_pe = kv_a.split([lat, self.rope], dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c)[0], self.rotate(k_pe, cos.squeeze(1), sin.squeeze(1))), -1)
        ctx = get_context()
        self.kv_cache.view(-1, lat + self.rope).index_copy_(0, ctx.slot_mapping, latent)  # latent: [T, L + R]

        nd = ctx.num_decodes
        if not ctx.prefills:
            out = self._decode(q_nope, q_pe, ctx)
        else:
            out = q.new_empty(t, h, self.v_dim)
            if nd:
                out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], ctx)
            for p in ctx.prefills:
                out[p.start : p.end] = self._prefill(q_nope[p.start : p.end], q_pe[p.start : p.end], latent, p)
        return self.group.all_reduce(self.o_proj(out.flatten(1)))

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        lat, (b, h) = self.kv_lora_rank, q_nope.shape[:2]
        if self.absorbed is not None:  # per head as row groups of one call: [H * B, N] → [H * B, L]
            heads = [b] * h
            q_lat = self.absorbed[0](q_nope.transpose(0, 1).reshape(h * b, -1), heads).view(h, b, lat).transpose(0, 1)
        else:
            q_lat = torch.bmm(q_nope.transpose(0, 1), self._absorbed_weights()[0]).transpose(0, 1)  # [B, H, L]
        q = torch.cat((q_lat, q_pe), dim=-1)  # [B, H, L + R]
        assert ctx.decode_block_tables is not None
        if self.kernel is not None and ctx.decode_context_lens is not None and self.in_place(b):
            rows = self.kv_cache.unsqueeze(2)  # [blocks, block_size, 1, L + R]: K and V at once
            o = self.kernel(q, rows, rows, ctx.decode_block_tables, ctx.decode_context_lens, self.scale)[..., :lat]
        else:
            assert ctx.decode_mask is not None
            o = latent_attention(q, self._gather(ctx.decode_block_tables.flatten()), ctx.decode_mask, self.scale, lat)
        if self.absorbed is not None:
            return self.absorbed[1](o.transpose(0, 1).reshape(h * b, lat), heads).view(h, b, -1).transpose(0, 1)
        return torch.bmm(o.transpose(0, 1), self._absorbed_weights()[1]).transpose(0, 1)  # [B, H, V]

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, N, L] and W_UV^T [H, L, V], each contiguous, copied from kv_b_proj's weight once (again only
        if the weight changes). NOTE: bmm over the strided views copied them at every call: at one decoded token,
        125 + 275 against 73 + 73 us a layer on a 2-core Xeon (DeepSeek-V2-tiny's heads); the copies cost
        kv_b_proj's size in memory again."""
        w = self.kv_b_proj.weight
        key = (w.data_ptr(), w._version)
        if self._absorbed is None or self._absorbed[0] != key:
            self._absorbed = (key, *bmm_absorbed(self._kv_b_heads(), self.nope))
        return self._absorbed[1], self._absorbed[2]

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, p: PrefillMeta) -> torch.Tensor:
        h, lat = self.num_heads, self.kv_lora_rank
        if p.block_ids is None:  # nothing before this chunk: the fresh latents are the whole context
            ctx_lat = latent[p.start : p.end]
        else:  # earlier tokens (prefix-cache hits or earlier chunks) live in the cache
            ctx_lat = self._gather(p.block_ids).view(-1, lat + self.rope)[: p.context_len]  # [N, L + R]
        n, b = ctx_lat.shape[0], p.num_seqs  # b > 1: whole prompts of one length side by side
        k_nope, v = self.kv_b_proj(ctx_lat[:, :lat]).view(n, h, -1).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, ctx_lat[:, None, lat:].expand(n, h, self.rope)), dim=-1)  # [N, H, N + R]
        q = torch.cat((q_nope, q_pe), dim=-1)  # [S, H, N + R]
        # NOTE: V zero-padded to the query's width: SDPA's fused CPU kernel wants q, k and v one width and otherwise
        # falls back to its math path (DeepSeek-V2-tiny's 32 x 128-token prefill, a layer on a 2-core Zen 4: 120 ms
        # against 44, causal or with a mask); the padding's outputs are zeros, dropped
        width = q.shape[-1]
        vw = F.pad(v, (0, width - self.v_dim)) if self.v_dim < width else v
        out = F.scaled_dot_product_attention(
            q.view(b, -1, h, width).transpose(1, 2),
            k.view(b, -1, h, k.shape[-1]).transpose(1, 2),
            vw.view(b, -1, h, vw.shape[-1]).transpose(1, 2),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=self.scale,
        )  # [b, H, S / b, width of vw]
        return out[..., : self.v_dim].transpose(1, 2).reshape(-1, h, self.v_dim)  # [S, H, V]

    def _gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        out = self.scratch.resize_(block_ids.shape[0], *self.kv_cache.shape[1:])  # keeps its storage when big enough
        return torch.index_select(self.kv_cache, 0, block_ids, out=out)  # [n, block_size, L + R]


def latent_attention(q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, scale: float, lat: int) -> torch.Tensor:
    """Decode attention of q [B, H, L + R] over each sequence's gathered latent rows ([B * blocks, block_size,
    L + R], padding masked by `mask`) → [B, H, L]: SDPA's path where no kernel reads the paged cache in place.

    NOTE: one latent "KV head" shared by all H query heads, which SDPA sees as H query positions. The values are
    the latents c; passing the whole cached row (c | k_pe) and dropping the rope columns after keeps q, k and v
    one width, which SDPA's fused CPU kernel needs (~2x faster than its fallback)."""
    b, width = q.shape[0], q.shape[-1]
    kv = rows.view(b, 1, -1, width)  # [B, 1, S, L + R]
    return F.scaled_dot_product_attention(q.unsqueeze(1), kv, kv, attn_mask=mask, scale=scale)[:, 0, :, :lat]


def bmm_absorbed(w3: torch.Tensor, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight by heads, [H, N + V, L] → W_UK [H, N, L] and W_UV^T [H, L, V], contiguous, for bmm."""
    return w3[:, :nope].contiguous(), w3[:, nope:].transpose(1, 2).contiguous()


def per_head_absorbed(w3: torch.Tensor, nope: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """kv_b_proj's weight by heads → per head W_UK as a linear weight [L, N] and W_UV [V, L] (views)."""
    return [w.t() for w in w3[:, :nope]], list(w3[:, nope:])
