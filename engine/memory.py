"""What a model will hold in memory, known before its weights are read, and what the device has free.

The gateway sums the plans of every model it is configured to serve and refuses to start when they exceed what
is available, before loading any of them: several models that cannot fit would otherwise end in the OOM killer
halfway through the start, or in a KV cache that pages. The plan counts the weights as the engine will hold them
(dtype, bf16 storage, quantized layers: the model's own modules, built on the meta device) and the KV cache
(`kv_cache_bytes`, or its default); activations, packed GEMM copies and the tokenizer come on top.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core import model_max_len
from engine.loader import ModelFiles, build_model, read_json
from engine.model_runner import bf16_weight_storage, kv_bytes_per_block, kv_cache_blocks

log = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    weights_bytes: int
    kv_bytes: int
    kv_blocks: int
    device: str  # "cpu", "cuda:0", ...: plans on one device share its memory

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes


def plan_memory(config: EngineConfig, files: ModelFiles) -> MemoryPlan:
    """Weights and KV cache of `config`'s model, from its config.json alone (no weight is read)."""
    hf_config = read_json(files, "config.json")
    dtype = config.torch_dtype
    # bf16 storage keeps only the checkpoint's bf16 tensors bf16 (others widen): config.json says which it holds
    stored = hf_config.get("dtype", hf_config.get("torch_dtype"))
    model = build_model(hf_config, torch.device("meta"), dtype, bf16_weight_storage(config) and stored == "bfloat16")
    seen: set[int] = set()
    weights = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:  # tied embeddings are one tensor
            seen.add(id(t))
            weights += t.numel() * t.element_size()
    per_block = kv_bytes_per_block(model, dtype, config.block_size)
    blocks = kv_cache_blocks(config, per_block, model_max_len(config, hf_config))
    return MemoryPlan(weights, blocks * per_block, blocks, device_key(config.torch_device))


def device_key(device: torch.device) -> str:
    if device.type in ("cuda", "npu"):
        return f"{device.type}:{device.index or 0}"
    return device.type


def available_bytes(device: str) -> int | None:
    """Free memory on `device` for new models: the host's MemAvailable within the cgroup's limit (CPU), the
    GPU's free memory (CUDA); None where it cannot be known."""
    if device == "cpu":
        return _host_available()
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return None


def _host_available() -> int | None:
    found: list[int] = []
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v2: a container's limit, less what it already uses
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            found.append(max(0, int(limit) - int((CGROUP / "memory.current").read_text())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def resident_bytes() -> int | None:
    """This process's resident memory (Linux), for the start-up report of what loading a model really took."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
