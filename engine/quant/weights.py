"""The in-memory form of a quantized weight, whatever checkpoint format it came from, and its torch reference
math (dequantize, then matmul): the definition every faster path (engine.quant.paths) is checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per token (row) for W8A8, x ≈ q * scale, as compressed-tensors defines it (the
    largest magnitude maps to 127.5 steps, then clamps to 127; vLLM's kernels divide by 127 instead)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.5).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(x / scale).clamp_(-128, 127).to(torch.int8), scale


@dataclass(slots=True)
class Int8Weight:
    """W8A8: int8 [N, K] with a float32 scale per output channel [N]; activations are quantized per token."""

    q: torch.Tensor
    scale: torch.Tensor
    tag = "w8a8"

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def float(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] → [..., N] in float32: the quantized activations times the dequantized weight."""
        xq, xs = quantize_tokens(x.reshape(-1, x.shape[-1]))
        y = F.linear(xq.float() * xs, self.float(), bias.float() if bias is not None else None)
        return y.view(*x.shape[:-1], -1)

    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def rows(self, start: int, stop: int) -> Int8Weight:
        """Output channels [start, stop) (views)."""
        return Int8Weight(self.q[start:stop], self.scale[start:stop])


@dataclass(slots=True)
class Int4Weight:
    """W4A16: unsigned 4-bit values two to a byte [N, K/2] (even k in the low nibble), a float32 scale and a
    zero point (0..15; 8 when symmetric) per output channel and group of `group_size` inputs [N, K/G]."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    tag = "w4a16"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * 2))

    def values(self) -> torch.Tensor:
        """The unsigned 4-bit values, int32 [N, K]."""
        p = self.packed.to(torch.int32)
        return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)

    def float(self) -> torch.Tensor:
        g = self.group_size
        q = self.values().float().view(self.shape[0], -1, g)
        return ((q - self.zero.float()[..., None]) * self.scale[..., None]).flatten(1)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x.float(), self.float(), bias.float() if bias is not None else None)

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.zero.nbytes

    def rows(self, start: int, stop: int) -> Int4Weight:
        """Output channels [start, stop) (views)."""
        return Int4Weight(self.packed[start:stop], self.scale[start:stop], self.zero[start:stop], self.group_size)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values [N, K] (any int dtype) → uint8 [N, K/2], even k in the low nibble."""
    v = values.to(torch.uint8).view(values.shape[0], -1, 2)
    return v[..., 0] | (v[..., 1] << 4)


QuantWeight = Int8Weight | Int4Weight
