"""Calibration runs for `tianmen quantize` (SmoothQuant, GPTQ): our float engine over a text that ships with
Python, prefilled as one chunk so that every layer sees all of it in one call, and the checkpoint's tensors
read one at a time by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import ModelLoadError
from engine.loader import DirectoryFiles, weight_files
from engine.params import SamplingParams
from engine.request import Request
from engine.tokenizer import Tokenizer


def pydoc_topics(reverse: bool) -> str:
    """Python's own pydoc topics joined, in key order or (reverse) from the end backwards."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics, reverse=reverse))


def calibration_text() -> str:
    """The pydoc topics from the end backwards (fidelity checks read them from the start)."""
    return pydoc_topics(reverse=True)


def calibration_ids(files: DirectoryFiles, hf: dict[str, Any], tokens: int) -> list[int]:
    """The first `tokens` tokens of the calibration text (fewer where the model's context is shorter)."""
    if tokens < 16:
        raise ModelLoadError(f"calibration needs at least 16 tokens; got {tokens}")
    longest = int(hf.get("max_position_embeddings") or tokens + 1) - 1
    return Tokenizer.from_files(files.read).encode(calibration_text(), add_special_tokens=False)[: min(tokens, longest)]


def float_core(src: str | Path, tokens: int, gemm_path: str = "onednn", dtype: str = "float32") -> EngineCore:
    """Our engine on `src`, float32 math (or `dtype`'s), oneDNN / torch kernels only, sized for one prompt of
    `tokens` prefilled in one step. gemm_path torch: F.linear, and quantized layers by their reference math."""
    cfg = EngineConfig(
        model=src,
        dtype=dtype,
        device="cpu",
        max_num_seqs=1,
        cpu_kernels=False,
        gemm_path=gemm_path,
        max_num_batched_tokens=max(tokens, 16),
        max_model_len=tokens + 16,
    )
    core = EngineCore(cfg)
    core.runner.every_row = True  # the calibrations and the fidelity read every position's states through hooks
    return core


def prefill(core: EngineCore, token_ids: list[int]) -> None:
    """Run `token_ids` through the model once (one prefill chunk, then one sampled token)."""
    core.add_request(Request("calibration", token_ids, SamplingParams(max_tokens=1, temperature=0)))
    for _ in range(len(token_ids) + 2):  # bounded: one prefill chunk, then the token; never an endless wait
        if not core.has_unfinished() or any(out.finish_reason is not None for out in core.step()):
            break


class CheckpointTensors:
    """A checkpoint's tensors by name, each read from its file when asked for."""

    def __init__(self, path: Path) -> None:
        files = DirectoryFiles(path)
        self.path, self.where = files.path, {}
        for fname in weight_files(files):
            with safe_open(self.path / fname, framework="pt") as f:
                self.where |= dict.fromkeys(f.keys(), fname)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.path / self.where[name], framework="pt") as f:
            return f.get_tensor(name)
