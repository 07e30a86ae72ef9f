from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.kernels.pointwise import apply_rotary as apply_rotary  # the definitions live beside their CPU kernels
from engine.kernels.pointwise import apply_rotary_interleaved as apply_rotary_interleaved


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """rope settings from config.json, old style (rope_theta + rope_scaling) or new (rope_parameters)."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(head_dim: int, base: float, max_position: int, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (as transformers' _compute_yarn_parameters): ramped inv_freq and the cos/sin attention factor."""
    old_len = p.get("original_max_position_embeddings") or max_position
    factor = p.get("factor") or max_position / old_len
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low)
    extrapolate = 1 - ramp.clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position, laid out for rotate_half (HF Llama); `apply_rotary_interleaved` reads half of them."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        kind = params["rope_type"]
        scale = 1.0
        if kind == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif kind == "yarn":
            inv_freq, scale = _yarn_inv_freq(head_dim, base, max_position, params)
        elif kind != "default":
            raise ModelLoadError(f"unsupported rope_scaling type {kind!r}: supported are default, linear, llama3, yarn")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)  # [T, 1, D]
