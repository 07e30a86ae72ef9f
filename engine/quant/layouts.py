"""How each checkpoint format stores one quantized linear layer, and its conversion to the in-memory form
(engine.quant.weights). The tensors keep the checkpoint's names, so the loader stays a name map.

compressed-tensors: `weight` int8 [N, K] + `weight_scale` [N, 1] (int-quantized); `weight_packed` int32 [N, K/8]
(eight 4-bit values offset by 8, element i in bits 4i), `weight_scale` [N, K/G], `weight_shape`, and when
asymmetric `weight_zero_point` int32 [N/8, K/G] packed along the output dimension (pack-quantized).
GPTQ: `qweight` int32 [K/8, N] packed along the input, `qzeros` int32 [K/G, N/8], `scales` [K/G, N] (v1 stores
zero points minus one). AWQ (GEMM): `qweight` int32 [K, N/8] with columns in the order 0 2 4 6 1 3 5 7 inside
each word, `qzeros` int32 [K/G, N/8] in the same order, `scales` [K/G, N]."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from engine.errors import ModelLoadError
from engine.quant.spec import QuantSpec
from engine.quant.weights import Int4Weight, Int8Weight, QuantWeight, pack_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its eight
AWQ_REVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j is in nibble AWQ_REVERSE[j]


@dataclass(slots=True, frozen=True)
class StoredTensor:
    """One checkpoint tensor of a layer: shape for [N, K], and which dimension runs over output channels
    (None: not per channel) with how many channels each index holds (8 where packed along it); the same for the
    input channels (`in_dim`, `per_in`: 8 where packed, the group size for per-group tensors), which is how a
    tensor-parallel rank finds its part of either."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dim: int | None = 0
    per_index: int = 1
    in_dim: int | None = None
    per_in: int = 1


def stored_tensors(spec: QuantSpec, n: int, k: int) -> list[StoredTensor]:
    """The tensors a layer of N outputs and K inputs has in this checkpoint; ModelLoadError if the shape cannot
    be stored so (K not a multiple of the group size, ...)."""
    g = spec.group_size
    if spec.scheme == "w8a8":
        return [
            StoredTensor("weight", (n, k), torch.int8, in_dim=1),
            StoredTensor("weight_scale", (n, 1), torch.float32),  # per output channel: every rank's K shares it
        ]
    if k % g or k % 8 or n % 8:
        raise ModelLoadError(f"a {n}x{k} weight cannot hold 4-bit groups of {g} (K must be a multiple of it and 8)")
    f32, i32 = torch.float32, torch.int32
    if spec.fmt == "compressed-tensors":
        out = [
            StoredTensor("weight_packed", (n, k // 8), i32, in_dim=1, per_in=8),
            StoredTensor("weight_scale", (n, k // g), f32, in_dim=1, per_in=g),
            StoredTensor("weight_shape", (2,), torch.int64, None),
        ]
        if not spec.symmetric:
            out.append(StoredTensor("weight_zero_point", (n // 8, k // g), i32, 0, 8, in_dim=1, per_in=g))
        return out
    if spec.fmt == "gptq":
        qweight = StoredTensor("qweight", (k // 8, n), i32, 1, in_dim=0, per_in=8)
    else:
        qweight = StoredTensor("qweight", (k, n // 8), i32, 1, 8, in_dim=0)
    return [
        qweight,
        StoredTensor("qzeros", (k // g, n // 8), i32, 1, 8, in_dim=0, per_in=g),
        StoredTensor("scales", (k // g, n), f32, 1, in_dim=0, per_in=g),
    ]


def unpack_int32(words: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words holding eight 4-bit values each (value i in bits 4i) → int32 values, `dim` eight times longer;
    `order`: which nibble holds the j-th value (AWQ's interleave)."""
    nibbles = range(8) if order is None else order
    shifts = torch.tensor(nibbles, dtype=torch.int32, device=words.device) * 4
    w = words.to(torch.int32).unsqueeze(-1)
    vals = (w >> shifts) & 0xF  # [..., 8] along a new last dimension
    if dim in (-1, words.dim() - 1):
        return vals.flatten(-2)
    return vals.movedim(-1, dim + 1).flatten(dim, dim + 1)


def to_weight(spec: QuantSpec, t: dict[str, torch.Tensor], n: int, k: int) -> QuantWeight:
    """The layer's checkpoint tensors (named as in stored_tensors) → its in-memory form."""
    if spec.scheme == "w8a8":
        return Int8Weight(t["weight"].contiguous(), t["weight_scale"].reshape(n).float().contiguous())
    g = spec.group_size
    if spec.fmt == "compressed-tensors":
        shape = tuple(int(v) for v in t["weight_shape"].tolist())
        if shape != (n, k):
            raise ModelLoadError(f"weight_shape {shape} does not match the layer's {(n, k)}")
        words = t["weight_packed"].contiguous()
        packed = words.view(torch.uint8) if sys.byteorder == "little" else pack_nibbles(unpack_int32(words, 1))
        if spec.symmetric:
            zero = torch.full((n, k // g), 8, dtype=torch.uint8, device=words.device)
        else:
            zero = unpack_int32(t["weight_zero_point"], 0).to(torch.uint8)
        return Int4Weight(packed.clone(), t["weight_scale"].float().contiguous(), zero, g)
    if spec.fmt == "gptq":
        values = unpack_int32(t["qweight"], 0).T  # [N, K]
        zeros = unpack_int32(t["qzeros"], 1) + spec.zero_offset
    else:
        values = unpack_int32(t["qweight"], 1, AWQ_REVERSE).T
        zeros = unpack_int32(t["qzeros"], 1, AWQ_REVERSE)
    if bool((zeros > 15).any()):
        raise ModelLoadError("a GPTQ zero point is out of the 4-bit range (is checkpoint_format right?)")
    zero = zeros.T.to(torch.uint8).contiguous()
    return Int4Weight(pack_nibbles(values.contiguous()), t["scales"].T.float().contiguous(), zero, g)
