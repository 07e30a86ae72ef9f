"""Tensors straight out of a decrypted safetensors image in memory, as zero-copy views of its buffer.

`safetensors.torch.load` needs `bytes` (a copy of a bytearray) and copies every tensor out again:
three times the weights in memory at the peak. This parses the same format and checks it as strictly.
"""

from __future__ import annotations

import json
import math
import mmap
import struct

import torch

from security.manifest import SealError

MAX_HEADER = 100 << 20  # as safetensors itself
Buffer = bytearray | mmap.mmap  # writable, so torch.frombuffer shares it without a copy or a warning
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}  # fmt: skip


def tensors_from_buffer(buf: Buffer, name: str) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy tensor views into a safetensors image, checked as strictly as safetensors' own loader."""
    try:
        (n,) = struct.unpack_from("<Q", buf, 0)
        if n > min(len(buf) - 8, MAX_HEADER):
            raise ValueError("header length out of range")
        meta = json.loads(bytes(memoryview(buf)[8 : 8 + n]))
        entries = sorted(((k, v) for k, v in meta.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])
        out: list[tuple[str, torch.Tensor]] = []
        base, pos = 8 + n, 0
        for key, v in entries:
            dtype, shape, (begin, end) = _DTYPES[v["dtype"]], v["shape"], v["data_offsets"]
            if not all(type(d) is int and d >= 0 for d in shape) or type(begin) is not int or type(end) is not int:
                raise ValueError(f"{key}: bad shape or offsets")
            numel = math.prod(shape)
            if begin != pos or end - begin != numel * dtype.itemsize:
                raise ValueError(f"{key}: offsets {begin}..{end} do not fit shape {shape} after byte {pos}")
            out.append((key, _view(buf, dtype, shape, base + begin, numel)))
            pos = end
        if base + pos != len(buf):
            raise ValueError("bytes left over after the last tensor")
    except (KeyError, TypeError, ValueError, AttributeError, struct.error, RecursionError) as e:
        raise SealError(f"{name} is not a valid safetensors file: {e}") from None
    return out


def _view(buf: Buffer, dtype: torch.dtype, shape: list[int], offset: int, numel: int) -> torch.Tensor:
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if offset % dtype.itemsize:  # a hand-made file; torch wants aligned element pointers
        return torch.frombuffer(bytearray(memoryview(buf)[offset : offset + numel * dtype.itemsize]), dtype=dtype).view(
            shape
        )
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)
