"""SmoothQuant for W8A8 (Xiao et al., 2023): per input channel j, activations are divided and the weights that
read them multiplied by s_j = max|X_j|^α / max|W_j|^(1-α), folded into the RMSNorm before them, so the float
model is unchanged while activation outliers shrink before per-token int8 quantization. The activation maxima
come from running the float model (our engine) over a calibration text that ships with Python."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.errors import ModelLoadError
from engine.loader import DirectoryFiles
from engine.quant.calibrate import CheckpointTensors, calibration_ids, calibration_text, float_core, prefill

# where a smoothed activation comes from → the projections that read it, by checkpoint name within a layer
# (Llama family: Llama, Qwen2, Mistral). A norm's weight divides its output by s; so do up_proj's rows, as
# down_proj reads act(gate) · up, linear in up (llm-compressor's SmoothQuant maps these three too)
GROUPS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.up_proj": ("mlp.down_proj",)}  # fmt: skip
LAYER = re.compile(r"(model\.layers\.\d+)\.(.+)")  # a source's layer, and its name within the layer
CALIBRATION_TOKENS = 1024
__all__ = ["SMOOTHABLE", "activation_maxima", "calibration_text", "smoothing", "smoothing_scales"]


def activation_maxima(src: str, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """max |x_j| over the calibration tokens of each group's activations, by layer and source
    (model.layers.0.input_layernorm, model.layers.0.mlp.up_proj)."""
    core = float_core(src, len(token_ids))
    maxima: dict[str, torch.Tensor] = {}

    def keep(name: str, x: torch.Tensor) -> None:
        m = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        maxima[name] = torch.maximum(maxima[name], m) if name in maxima else m

    layers = core.runner.model.model.layers
    for i, layer in enumerate(layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):  # their output: (normed, residual)
            getattr(layer, norm).register_forward_hook(
                partial(lambda n, _m, _a, out: keep(n, out[0]), f"model.layers.{i}.{norm}")
            )
        layer.mlp.down_proj.register_forward_pre_hook(
            partial(lambda n, _m, args: keep(n, args[0]), f"model.layers.{i}.mlp.up_proj")
        )
    prefill(core, token_ids)
    if len(maxima) != len(GROUPS) * len(layers):
        raise ModelLoadError("the calibration run did not reach every layer")
    return maxima


def smoothing_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s_j for one norm's output channels; 1 where a channel never fires."""
    w_max = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    s = act_max.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)
    return torch.where(act_max > 0, s, torch.ones_like(s)).clamp(1e-2, 1e2)


SMOOTHABLE = ("llama", "qwen2", "mistral")


def smoothing(src: Path, hf: dict[str, Any], alpha: float) -> dict[str, torch.Tensor]:
    """Per checkpoint tensor name, the factor it is multiplied by: 1/s for each norm's weight (and each row of
    up_proj), s (per input column) for the projections that read them. The float model's outputs do not change."""
    if hf.get("model_type") not in SMOOTHABLE:
        raise ModelLoadError(f"smoothing supports {', '.join(SMOOTHABLE)} models; got {hf.get('model_type')!r}")
    if not 0 < alpha < 1:
        raise ModelLoadError(f"the smoothing strength must be between 0 and 1; got {alpha}")
    maxima = activation_maxima(str(src), calibration_ids(DirectoryFiles(src), hf, CALIBRATION_TOKENS))
    tensors = CheckpointTensors(src)
    factors: dict[str, torch.Tensor] = {}

    def scale(name: str, f: torch.Tensor) -> None:  # up_proj is smoothed twice: its columns, then its rows
        factors[name] = factors[name] * f if name in factors else f

    for source, act_max in maxima.items():
        layer, kind = LAYER.fullmatch(source).groups()  # type: ignore[union-attr]
        names = [f"{layer}.{p}.weight" for p in GROUPS[kind]]
        s = smoothing_scales(act_max, [tensors.get(name) for name in names], alpha)
        scale(f"{source}.weight", 1 / s if kind != "mlp.up_proj" else (1 / s)[:, None])
        for name in names:
            scale(name, s[None, :])
    return factors
