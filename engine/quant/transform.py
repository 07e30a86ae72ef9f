"""An online Hadamard rotation of a linear layer's inputs, as compressed-tensors' `transform_config` describes it
(what llm-compressor's SpinQuant writes as its R4, and vLLM loads): the layer computes (x·H)(W·H)ᵀ = x·Wᵀ, with H
block-diagonal of normalized Sylvester Hadamard blocks. Its weight is stored already multiplied by H; the
activations are rotated at run time, just before they are quantized per token. A rotated vector spreads one
channel's spike over the whole block, so the per-token int8 scale no longer follows a single outlier (on the demo
model, down_proj's inputs peak at ~38x their RMS at every layer).

Accepted: type "hadamard" (deterministic), randomize false, on the input of a linear layer, with the matching
inverse on its weight input; anything else in a transform_config is refused by name."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from engine.errors import ModelLoadError

ROTATABLE = ("llama", "qwen2", "mistral")  # whose linear layers all run through their own forward (no MoE)


@cache
def hadamard(n: int, dtype: torch.dtype = torch.float64, device: torch.device | None = None) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of order n (a power of two): orthogonal, symmetric; one copy
    kept per device, so a forward pass on a GPU copies nothing from the host."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two; got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def rotate_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] times the block-diagonal H (K / block blocks): each block of channels mixed on its own."""
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"{k} channels are not whole blocks of {block}")
    h = hadamard(block, x.dtype if x.is_floating_point() else torch.float32, x.device)
    return (x.reshape(*x.shape[:-1], k // block, block) @ h).reshape(x.shape)


def matches(pattern: str, name: str) -> bool:
    """compressed-tensors' layer patterns: a checkpoint name (or its last parts), or `re:` and a regex."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


@dataclass(frozen=True, slots=True)
class InputRotation:
    """Which layers have their inputs rotated online (checkpoint names or `re:` patterns), in blocks of `block`."""

    targets: tuple[str, ...]
    block: int

    def applies_to(self, name: str) -> bool:
        return any(matches(p, name) for p in self.targets)


def transform_config(rotation: InputRotation) -> dict[str, Any]:
    """The transform_config entry of quantization_config, in compressed-tensors' schema (TransformConfig)."""
    apply = [
        {"targets": list(rotation.targets), "location": "input", "inverse": False, "ignore": []},
        {"targets": list(rotation.targets), "location": "weight_input", "inverse": True, "ignore": []},
    ]
    scheme = {"type": "hadamard", "apply": apply, "randomize": False, "requires_grad": False}
    return {"config_groups": {"R4": {**scheme, "head_dim": rotation.block, "precision": "float32"}}}


def _refuse(what: str) -> ModelLoadError:
    return ModelLoadError(
        f"unsupported transform_config: {what}; supported: a deterministic hadamard (randomize false) on a linear "
        "layer's input, block size a power of two, with its inverse fused into the stored weight (weight_input)"
    )


def input_rotations(tc: Any, model_type: str | None) -> list[InputRotation]:
    """quantization_config's transform_config → the online input rotations it asks for ([] when absent)."""
    if not tc:
        return []
    if model_type not in ROTATABLE:
        raise _refuse(f"on a {model_type!r} model (rotations are supported for {', '.join(ROTATABLE)})")
    groups = tc.get("config_groups") if isinstance(tc, dict) else None
    if not isinstance(groups, dict) or not groups:
        raise _refuse("no config_groups")
    found = []
    for name, scheme in groups.items():
        if not isinstance(scheme, dict) or scheme.get("type") != "hadamard" or scheme.get("randomize"):
            raise _refuse(f"group {name!r} is not a deterministic hadamard")
        apply = scheme.get("apply") or []
        where = {(a.get("location"), bool(a.get("inverse"))): a for a in apply if isinstance(a, dict)}
        online, fused = where.get(("input", False)), where.get(("weight_input", True))
        if len(apply) != 2 or online is None or fused is None or online.get("ignore") or fused.get("ignore"):
            raise _refuse(f"group {name!r} applies {apply!r}")
        targets = online.get("targets")
        if isinstance(targets, str):
            targets = [targets]
        names = isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)
        if not names or targets != fused.get("targets") or "Linear" in targets:
            raise _refuse(f"group {name!r} with targets {targets!r}")
        block = scheme.get("head_dim")
        if not isinstance(block, int) or block < 2 or block & (block - 1):
            raise _refuse(f"group {name!r} with block size (head_dim) {block!r}")
        found.append(InputRotation(tuple(targets), block))
    return found
