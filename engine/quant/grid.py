"""The integer grids `tianmen quantize` stores, as compressed-tensors' min-max observer defines them: per-channel
symmetric int8 (W8A8) and per-group 4-bit, symmetric or with a zero point (W4A16). Round-to-nearest and GPTQ both
quantize through these functions, so whatever method chose the values, the loader dequantizes them the same way
(engine.quant.weights: q · scale, or (q - zero) · scale)."""

from __future__ import annotations

import torch

INT8 = (-128, 127)
INT4 = (-8, 7)


def channel_scale(w: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """[N, K] → the int8 scale per output channel [N, 1] in `scale_dtype`: the largest magnitude maps to 127.5
    steps (then clamps to 127)."""
    return (w.float().abs().amax(dim=1, keepdim=True) / 127.5).clamp_min(1e-12).to(scale_dtype)


def group_params(
    g: torch.Tensor, scale_dtype: torch.dtype, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., G] → the 4-bit scale [...] in `scale_dtype` and, asymmetric, the zero point [...] (float, an integer
    in -8..7): symmetric maps the largest magnitude to 7.5 steps; asymmetric spans [min, max] (0 included) in 15."""
    lo, hi = g.float().amin(dim=-1).clamp(max=0), g.float().amax(dim=-1).clamp(min=0)
    if symmetric:
        return (torch.maximum(-lo, hi) / 7.5).clamp_min(1e-12).to(scale_dtype), None
    scale = ((hi - lo) / 15).to(scale_dtype)
    scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale)
    return scale, torch.round((-8 - lo / scale.float()).clamp(-8, 7))


CLIP_STEPS = tuple(1 - 0.025 * i for i in range(13))  # the range shrunk by 0% .. 30%


def clipped_group_params(
    g: torch.Tensor, scale_dtype: torch.dtype, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """group_params with each group's range shrunk by whichever of CLIP_STEPS gives the least squared error
    (llm-compressor's "mse" observer does the same search): the few largest values clip, the rest land on a finer
    grid."""
    best_scale, best_zero = group_params(g, scale_dtype, symmetric)
    best_err = _group_error(g, best_scale, best_zero)
    for f in CLIP_STEPS[1:]:
        scale, zero = group_params(g * f, scale_dtype, symmetric)
        err = _group_error(g, scale, zero)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if zero is not None and best_zero is not None:
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def _group_error(g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    z = None if zero is None else zero[..., None]
    q = to_grid(g, scale[..., None], z, INT4)
    return (from_grid(q, scale[..., None], z) - g.float()).pow(2).sum(dim=-1)


def to_grid(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bounds: tuple[int, int]) -> torch.Tensor:
    """round(x / scale + zero), clamped to `bounds`: the integer values (as float32) x is stored as; `scale` and
    `zero` broadcast against x."""
    y = x.float() / scale.float()
    if zero is not None:
        y = y + zero
    return torch.round(y).clamp_(*bounds)


def from_grid(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """The float32 value the loader reads back for integer values `q`."""
    return (q.float() - zero if zero is not None else q.float()) * scale.float()


def rtn_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] → int8 [N, K] and its per-channel scale [N, 1] (stored in `scale_dtype`, quantized with that one)."""
    scale = channel_scale(w, scale_dtype)
    return to_grid(w, scale, None, INT8).to(torch.int8), scale


def rtn_int4(
    w: torch.Tensor, group: int, scale_dtype: torch.dtype, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[N, K] → signed 4-bit values int8 [N, K] in -8..7, per-group scales [N, K/G] and (asymmetric) signed zero
    points int8 [N, K/G]; x ≈ (q - zero) · scale."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    scale, zero = group_params(g, scale_dtype, symmetric)
    q = to_grid(g, scale[..., None], None if zero is None else zero[..., None], INT4).to(torch.int8)
    return q.view(n, k), scale, None if zero is None else zero.to(torch.int8)
