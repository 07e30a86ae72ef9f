"""The grammar bitmask applied to float32 logits in place (engine/kernels/bitmask.c); the torch definition is
engine.structured.bitmask.apply_torch, which the self-check compares against."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.kernels.cbuild import Once, SelfCheckError, build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bitmask.c")
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class BitmaskKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.apply_bitmask_f32
        self.fn.argtypes = [_i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _int]
        self.fn.restype = None

    @classmethod
    def build(cls) -> BitmaskKernel:
        return cls(build(SOURCE))

    @staticmethod
    def takes(logits: torch.Tensor, words: torch.Tensor) -> bool:
        return (
            logits.device.type == "cpu"
            and logits.dtype == torch.float32
            and logits.dim() == 2
            and logits.stride(1) == 1
            and words.dtype == torch.int32
        )

    def apply(self, logits: torch.Tensor, rows: list[int], words: torch.Tensor) -> torch.Tensor:
        w = words.contiguous()
        index = torch.tensor(rows, dtype=torch.int64)
        self.fn(
            len(rows), logits.shape[1], logits.data_ptr(), logits.stride(0), index.data_ptr(), w.data_ptr(),
            w.shape[1], torch.get_num_threads(),
        )  # fmt: skip
        return logits


def self_check(k: BitmaskKernel) -> None:
    from engine.structured.bitmask import apply_torch

    g = torch.Generator().manual_seed(0)
    for vocab in (37, 64, 1000):
        logits = torch.randn(4, vocab, generator=g)
        words = torch.randint(-(2**31), 2**31 - 1, (2, (vocab + 31) // 32), generator=g, dtype=torch.int32)
        words[0, 0], words[1, -1] = 0, -1
        got = k.apply(logits.clone(), [3, 1], words)
        if not torch.equal(got, apply_torch(logits.clone(), [3, 1], words)):
            raise SelfCheckError(f"self-check failed for the grammar bitmask at vocab {vocab}")


kernel = Once(BitmaskKernel.build, log, "grammar bitmasks will be applied with torch ops (slower)", check=self_check)
