"""Rotations that leave a float model's outputs unchanged and its activations easier to quantize (QuaRot, SpinQuant
without learning): `tianmen quantize --rotate` runs this on a copy of the float checkpoint before quantizing it.

- R1, the residual stream: every RMSNorm's weight is folded into the layers that read its output (they become
  all ones, and an RMSNorm with unit weights commutes with an orthogonal Q), then the embeddings and every
  reader's input side are multiplied by Q and every writer's output side (o_proj, down_proj) by Qᵀ. Q is a
  seeded random orthogonal matrix: hidden sizes are rarely a power of two (SmolLM2's 576).
- R2, per attention head: v_proj's output rows and o_proj's input columns by a Hadamard of the head size.
- The LM head gets the final norm folded in and Q: it can no longer be the embedding matrix, so a tied head
  becomes a float matrix of its own (tie_word_embeddings false; the head stays unquantized by default).

R4 (down_proj's inputs, which no weight can absorb) is an online rotation applied when quantizing
(engine.quant.transform). On the demo model, W8A8 with SmoothQuant: top-1 agreement 95.1% unrotated, 96.3% with
R1 + R2 (docs/PERFORMANCE.md has the rest)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.errors import ModelLoadError
from engine.loader import DirectoryFiles, copy_side_files, read_json
from engine.quant.calibrate import CheckpointTensors
from engine.quant.transform import ROTATABLE, hadamard

READERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}  # fmt: skip
WRITERS = ("self_attn.o_proj", "mlp.down_proj")
SEED = 0


@dataclass(frozen=True, slots=True)
class Rotation:
    """What was done (recorded in tianmen-quant.json)."""

    seed: int
    hidden: int  # R1's order
    head: int | None  # R2's order; None where the head size is not a power of two


def orthogonal(n: int, seed: int) -> torch.Tensor:
    """A random orthogonal n x n matrix (float64), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]  # Haar-distributed, not biased by QR's sign choice


def rotate_checkpoint(src: Path, dst: Path, seed: int = SEED) -> Rotation:
    """Write the rotated copy of the Llama-family checkpoint `src` into the new directory `dst` (its linear
    layers' weights in float32, for the quantizer; the rest in the checkpoint's own type)."""
    files = DirectoryFiles(src)
    hf: dict[str, Any] = read_json(files, "config.json")
    if hf.get("model_type") not in ROTATABLE:
        raise ModelLoadError(f"rotation supports {', '.join(ROTATABLE)} models; got {hf.get('model_type')!r}")
    missing_keys = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if k not in hf]
    if missing_keys:
        raise ModelLoadError(f"config.json has no {missing_keys[0]}; rotation needs it to know the model's shape")
    d, layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    head = int(hf.get("head_dim") or d // int(hf["num_attention_heads"]))
    r2 = hadamard(head) if head & (head - 1) == 0 else None
    q = orthogonal(d, seed)
    tensors = CheckpointTensors(files.path)
    out: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        return tensors.get(name).double()

    kept = tensors.get("model.embed_tokens.weight").dtype

    def put(name: str, t: torch.Tensor) -> None:
        # what is quantized next stays float32; what is kept (embeddings, head, norms, biases) its own type
        out[name] = t.to(torch.float32 if name.endswith("proj.weight") else kept).contiguous()

    embed = get("model.embed_tokens.weight")
    lm = get("lm_head.weight") if "lm_head.weight" in tensors else embed
    put("lm_head.weight", (lm * get("model.norm.weight")[None, :]) @ q)
    put("model.embed_tokens.weight", embed @ q)
    put("model.norm.weight", torch.ones(d))
    for i in range(layers):
        p = f"model.layers.{i}."
        for norm, readers in READERS.items():
            gamma = get(f"{p}{norm}.weight")
            for r in readers:
                put(f"{p}{r}.weight", (get(f"{p}{r}.weight") * gamma[None, :]) @ q)
                if f"{p}{r}.bias" in tensors:  # on the output side: R1 leaves it
                    put(f"{p}{r}.bias", get(f"{p}{r}.bias"))
            put(f"{p}{norm}.weight", torch.ones(d))
        for w in WRITERS:
            put(f"{p}{w}.weight", q.T @ get(f"{p}{w}.weight"))
            if f"{p}{w}.bias" in tensors:
                put(f"{p}{w}.bias", get(f"{p}{w}.bias") @ q)
        if r2 is not None:  # V's heads and o_proj's matching columns; RoPE'd q and k are left alone
            v, o = out[f"{p}self_attn.v_proj.weight"].double(), out[f"{p}self_attn.o_proj.weight"].double()
            put(f"{p}self_attn.v_proj.weight", (r2.T @ v.view(-1, head, d)).reshape(v.shape))
            put(f"{p}self_attn.o_proj.weight", (o.view(d, -1, head) @ r2).reshape(o.shape))
            if f"{p}self_attn.v_proj.bias" in out:
                b = out[f"{p}self_attn.v_proj.bias"].double()
                put(f"{p}self_attn.v_proj.bias", (b.view(-1, head) @ r2).reshape(b.shape))
    missing = [n for n in tensors.where if n not in out and "rotary_emb" not in n]
    if missing:
        raise ModelLoadError(f"rotation does not know what to do with {missing[0]} (and {len(missing) - 1} more)")
    dst.mkdir(parents=True)
    copy_side_files(files.path, dst)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**hf, "tie_word_embeddings": False}))
    return Rotation(seed, d, head if r2 is not None else None)
