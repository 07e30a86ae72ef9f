"""GPTQ over a whole model (engine.quant.gptq per linear layer): our float engine runs the calibration text once
with every decoder linear layer taken over, so that each sees its inputs X in one call and accumulates its
Hessian from them.

Sequential (the default): a layer is quantized the moment its inputs arrive, and from then on computes with its
quantized weight (and, W8A8, per-token int8 activations, as at run time), so every later layer is calibrated on
what the quantized model feeds it; one Hessian lives at a time. Otherwise all Hessians are collected on the float
model first (Σ in_features² · 4 bytes: ~400 MB for SmolLM2-135M) and each layer quantized afterwards.

With SmoothQuant factors s (engine.quant.smooth), a layer's weight is W·s and its inputs X/s: the Hessian is
that of the smoothed model, which is the one stored. A layer whose inputs are rotated online (engine.quant.
transform) is quantized as W·H from inputs X·H, as it will run.

4-bit layers aim at the float model (GPTAQ, Li et al. 2025): sequential GPTQ makes each layer reproduce, on the
quantized model's inputs X̃, what the layer itself would compute on them, so every layer's error is carried into
the next. With `float_target`, a float run first records every 4-bit layer's inputs X; then each layer is asked
for W·X (what the float model computes) from X̃, and the weight GPTQ rounds is the unconstrained answer
Ŵ = W + W·(X − X̃)ᵀX̃·(X̃ᵀX̃ + λI)⁻¹. Demo model, W4A16 group 32 asymmetric, rotated, 2,048 calibration tokens:
top-1 agreement 89.3 → 90.4% and perplexity change +5.7 → +4.2% on a Zen 4, 90.5% / +5.4% on a Zen 3. On W8A8 it
measured as noise or worse (its per-token int8 activations are most of what differs), so 8-bit layers keep the
plain target. It costs the float inputs of every 4-bit layer, T · Σ in_features · 4 bytes (0.8 GB for
SmolLM2-135M at 2,048 tokens; ~6 GB for a 7B Llama), and a second float run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.linear import Linear
from engine.layers.mlp import GatedMLP
from engine.loader import DirectoryFiles
from engine.quant.calibrate import CheckpointTensors, calibration_ids, float_core, prefill
from engine.quant.gptq import BLOCK, DAMP, Grid, Hessian, gptq
from engine.quant.grid import from_grid
from engine.quant.transform import InputRotation, rotate_blocks
from engine.quant.weights import quantize_tokens

GPTQ_MODELS = ("llama", "qwen2", "mistral")
GPTQ_TOKENS = 2048
GridFor = Callable[[torch.dtype], Grid]  # the checkpoint weight's dtype → where its values go
Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # values, scales, zero points (rtn's form)


@dataclass(slots=True)
class GptqSettings:
    """How GPTQ calibrates (recorded in tianmen-quant.json)."""

    tokens: int = GPTQ_TOKENS
    sequential: bool = True
    damp: float = DAMP
    block: int = BLOCK
    # 4-bit groups' ranges searched for the least squared error (engine.quant.grid.clipped_group_params): on the
    # demo model W4A16 group 32 asymmetric 82.5 → 83.6% top-1 unrotated, 88.9 → 89.3% rotated
    clip: bool = True
    # 4-bit layers: target the float model's outputs W·X, not W·X̃ (see the module's docstring)
    float_target: bool = True


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """What the loader makes of rtn_int8 / rtn_int4 / gptq's output: the float32 weight [N, K]."""
    n, k = q.shape
    g = k // scale.shape[1]
    z = None if zero is None else zero.float()[..., None]
    return from_grid(q.view(n, -1, g), scale[..., None], z).view(n, k)


@dataclass(slots=True)
class TakenLayer:
    """One of the engine's linear layers (q/k/v or gate/up merged into one) under calibration: its checkpoint
    rows, the weight it is quantized from (smoothed), and what it computes with."""

    rows: list[tuple[str, int, int]]  # checkpoint module, first row, rows
    weight: torch.Tensor  # [N, K] float32, smoothed
    bias: torch.Tensor | None
    smooth: torch.Tensor | None  # s [K]: the stored model's inputs are X / s
    grid: Grid
    settings: GptqSettings
    w8a8: bool
    input_block: int | None = None  # its inputs are rotated online in blocks of this size
    recording: bool = False  # the float run: keep the inputs (4-bit layers), no Hessian
    hessian: Hessian | None = None
    reference: torch.Tensor | None = None  # [T, K]: the float model's inputs, from the recording run
    cross: torch.Tensor | None = None  # 2 (X − X̃)ᵀX̃ / T, beside the Hessian 2 X̃ᵀX̃ / T
    result: Quantized | None = None
    calls: int = 0
    used: torch.Tensor = field(init=False)  # the weight the forward multiplies by

    def __post_init__(self) -> None:
        self.hessian = None if self.recording else Hessian(self.weight.shape[1])
        self.used = self.weight

    def quantize(self) -> None:
        assert self.hessian is not None
        s = self.settings
        w = self.weight
        if self.cross is not None:
            h = self.hessian.h.double()
            h.diagonal().add_(s.damp * h.diagonal().mean())  # the same dampening GPTQ's inverse gets
            w = w + (w.double() @ torch.linalg.solve(h, self.cross.double().T).T).float()
            self.cross = None
        self.result = gptq(w, self.hessian.h, self.grid, s.block, s.damp)
        self.used = dequantize(*self.result)
        self.hessian = None  # at most one [K, K] per layer lives past its quantization: none

    def observe(self, x: torch.Tensor) -> torch.Tensor:
        """Add the inputs x [..., K] to the Hessian; they are returned as the stored model's ([T, K], X / s)."""
        self.calls += 1
        if self.calls > 1:
            raise ModelLoadError("GPTQ calibration ran a layer twice: the prompt was not prefilled in one step")
        flat = x.reshape(-1, x.shape[-1]).float()
        if self.smooth is not None:
            flat = flat / self.smooth
        if self.input_block is not None:
            flat = rotate_blocks(flat, self.input_block)
        if self.recording:
            if not self.w8a8:
                self.reference = flat.clone()  # x may be a buffer the engine reuses
            return flat
        assert self.hessian is not None
        self.hessian.add(flat)
        if self.reference is not None:
            scaled = flat * (2 / flat.shape[0]) ** 0.5
            self.cross = ((self.reference - flat) * (2 / flat.shape[0]) ** 0.5).T @ scaled
            self.reference = None
        return flat

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.observe(x)
        if self.settings.sequential and not self.recording:
            self.quantize()
            if self.w8a8:  # the activations as the quantized model sees them
                xq, xs = quantize_tokens(flat)
                flat = xq.float() * xs
        y = F.linear(flat, self.used, self.bias)
        return y.to(x.dtype).view(*x.shape[:-1], -1)


def _take_over(
    model: nn.Module,
    tensors: CheckpointTensors,
    grid_for: GridFor,
    factors: dict[str, torch.Tensor],
    settings: GptqSettings,
    rotation: InputRotation | None = None,
    recording: bool = False,
) -> list[TakenLayer]:
    """Every decoder linear layer of `model` now runs through a TakenLayer (and every gated MLP unfused, so its
    gate/up layer is called on its own); `recording`: layers that keep their float inputs and compute in float."""
    names = {(ours, shard): ckpt for ckpt, (ours, shard) in getattr(model, "packed_modules_mapping", {}).items()}
    taken = []
    for m in model.modules():
        if isinstance(m, GatedMLP):
            m.gate_up_act = None  # its plan computes act(gate_up(x)): the taken gate/up layer computes gate_up(x)
    for full, lin in model.named_modules():
        if not isinstance(lin, Linear) or ".layers." not in f".{full}":
            continue
        parent, _, leaf = full.rpartition(".")
        shards = getattr(lin, "shard_offsets", None) or {"": (0, lin.out_features)}
        rows = [(f"{parent}.{names.get((leaf, s), leaf)}" if s else full, off, n) for s, (off, n) in shards.items()]
        w = torch.cat([tensors.get(f"{ckpt}.weight").float() * factors.get(f"{ckpt}.weight", 1) for ckpt, _, _ in rows])
        # the first projection's factor is its input's s [1, K] alone (q of qkv, gate of gate_up; up_proj's rows
        # are smoothed too, for down_proj)
        smooth = factors.get(f"{rows[0][0]}.weight")
        if smooth is not None:
            assert smooth.shape == (1, w.shape[1]), f"{rows[0][0]}: a smoothing factor per input, not {smooth.shape}"
            smooth = smooth[0]
        bias = lin.bias.data.float() if lin.bias is not None else None
        grid = grid_for(tensors.get(f"{rows[0][0]}.weight").dtype if smooth is None else torch.float32)
        if grid.group_size is not None and lin.in_features % grid.group_size:
            what, g = ", ".join(ckpt for ckpt, _, _ in rows), grid.group_size
            raise ModelLoadError(f"{what}: in_features {lin.in_features} is not a multiple of the group size {g}")
        block = rotation.block if rotation is not None and rotation.applies_to(rows[0][0]) else None
        if block is not None:
            w = rotate_blocks(w.double(), block).float()
        t = TakenLayer(rows, w, bias, smooth, grid, settings, grid.group_size is None, block, recording)
        lin.plan = t  # type: ignore[assignment]  # Linear.forward calls its plan
        taken.append(t)
    return taken


def _observe_head(
    model: nn.Module, tensors: CheckpointTensors, grid_for: GridFor, settings: GptqSettings
) -> TakenLayer:
    """The LM head (an untied one): its Hessian from the final norm's output at every position (the engine
    computes logits only where it samples); quantized after the run, as the last layer nothing follows."""
    w = tensors.get("lm_head.weight")
    t = TakenLayer([("lm_head", 0, w.shape[0])], w.float(), None, None, grid_for(w.dtype), settings, False)

    def hook(_m: nn.Module, _args: object, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        t.observe(out[0])

    model.model.norm.register_forward_hook(hook)
    return t


def gptq_model(
    src: Path,
    hf: dict[str, Any],
    grid_for: GridFor,
    factors: dict[str, torch.Tensor] | None = None,
    settings: GptqSettings | None = None,
    lm_head: bool = False,
    rotation: InputRotation | None = None,
) -> dict[str, Quantized]:
    """Per checkpoint module (model.layers.0.self_attn.q_proj), its GPTQ values, scales and zero points.
    `grid_for(the checkpoint weight's dtype)`: the Grid to quantize onto; `factors`: SmoothQuant's, by tensor;
    `lm_head`: the LM head too, where the checkpoint has one of its own (not tied to the embeddings); `rotation`:
    the layers whose inputs the quantized model rotates online."""
    if hf.get("model_type") not in GPTQ_MODELS:
        raise ModelLoadError(f"GPTQ supports {', '.join(GPTQ_MODELS)} models; got {hf.get('model_type')!r}")
    settings = settings or GptqSettings()
    ids = calibration_ids(DirectoryFiles(src), hf, settings.tokens)
    tensors = CheckpointTensors(src)
    references: list[torch.Tensor | None] = []
    four_bit = grid_for(torch.float32).group_size is not None  # a W8A8 model has no layer to record for
    if settings.float_target and settings.sequential and four_bit:
        core = float_core(src, len(ids))
        recorded = _take_over(core.runner.model, tensors, grid_for, factors or {}, settings, rotation, True)
        prefill(core, ids)
        del core
        references = [t.reference for t in recorded]
        del recorded
    core = float_core(src, len(ids))
    taken = _take_over(core.runner.model, tensors, grid_for, factors or {}, settings, rotation)
    for t, ref in zip(taken, references, strict=False):
        t.reference = ref
    del references
    if lm_head and "lm_head.weight" in tensors:
        taken.append(_observe_head(core.runner.model, tensors, grid_for, settings))
    prefill(core, ids)
    del core
    out: dict[str, Quantized] = {}
    for t in taken:
        if t.calls != 1:
            raise ModelLoadError("the GPTQ calibration run did not reach every layer")
        if t.result is None:
            t.quantize()
        assert t.result is not None
        q, scale, zero = t.result
        for ckpt, first, n in t.rows:
            out[ckpt] = (
                q[first : first + n],
                scale[first : first + n],
                None if zero is None else zero[first : first + n],
            )
    return out
