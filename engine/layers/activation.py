from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class ActAndMul:
    """The gated MLP's act(gate) * up over a merged [T, 2I] projection."""

    def __init__(self, name: str) -> None:
        if name not in _ACTIVATIONS:
            raise ModelLoadError(f"unsupported hidden_act {name!r}; supported: {', '.join(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[name]
        self.is_silu_and_mul = name in ("silu", "swish")  # a fused GEMM epilogue may replace it (engine.kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # [T, 2I] -> [T, I]
        return self.act(gate).mul_(up)  # in place: one [T, I] allocation instead of two
