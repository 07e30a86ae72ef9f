from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ConfigError

GEMM_PATHS = ("auto", "onednn", "torch", "bf16mm", "bf16fma", "amxmm", "wbf16")
QUANTIZATIONS = ("auto", "none", "w8a8", "w4a16")
DECODE_PROGRAM_MODES = ("auto", "program", "layers")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _cpu_has_bf16() -> bool:
    """Native bf16 arithmetic, not oneDNN's emulation of it.

    On x86 oneDNN says "supported" on any AVX-512 CPU, but without AVX512-BF16 or AMX it converts in
    software: measured on a Cascade Lake (AVX-512 + VNNI only), bf16 GEMMs ran at 40-45 GFLOP/s against
    fp32's 120-200, and the engine's batch throughput was 3.4x lower than in float32.
    """
    try:
        if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
            return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # aarch64: oneDNN checks the BF16 extension
    except (AttributeError, RuntimeError):
        return False


@dataclass
class EngineConfig:
    """Engine knobs, named as in vLLM. Invalid combinations raise ConfigError on construction."""

    model: str | Path
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | bfloat16 | float32 | float16
    device: str = "auto"  # auto | cpu | cuda | npu
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 4096
    # while other requests run or wait, one prompt's prefill takes at most this many tokens a step (0: no cap),
    # so a long prompt delays neither the running streams' next tokens nor a newcomer's first
    long_prefill_token_threshold: int = 512
    # while other requests run or wait, all prefill chunks of one step together take at most this many tokens
    # (0: no cap). Prompts that arrive together are then prefilled a few at a time, and the first of them start
    # streaming while the rest prefill, instead of all waiting for one step that prefills every one of them.
    # Off here (offline batches want throughput, not first tokens); `tianmen serve` sets 1024, as vLLM's
    # defaults differ between its LLM class and its server
    max_prefill_tokens_per_step: int = 0
    max_model_len: int = 2048  # capped by the model's max_position_embeddings
    block_size: int = 16
    kv_cache_bytes: int | None = None  # None: room for max_num_seqs full-length sequences, at most 4 GiB
    enable_prefix_caching: bool = True
    max_waiting: int = 1024  # bounded queue: beyond it, submissions fail with EngineOverloadedError
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's default
    keep_freed_memory: bool = True  # CPU: glibc malloc reuses freed memory instead of faulting it in (engine.malloc)
    # CPU, a model whose weights do not fit in half the last-level cache: once loaded, the weights, KV cache and
    # buffers move to 2 MiB pages where Linux can (engine.hugepages); the GEMM selection times its candidates there
    huge_pages: bool = True
    # before the first request, one step of the largest prefill the scheduler forms and one decode step of up to
    # max_num_seqs rows, on placeholder tokens (as vLLM's profile run): the steps' memory is faulted in and each
    # kernel's first-call work done at start, not in the first requests' steps (engine.core)
    warm_start: bool = True
    # CPU, float32: weights that are exactly bf16 (a bf16 checkpoint) stay bf16 in memory and are widened in
    # registers by a kernel built for this CPU (engine.kernels.wbf16); same results, half the bytes per step
    compact_weights: bool = True
    # CPU: kernels compiled for this CPU (engine.kernels) are candidates: GEMMs (the bf16-weight kernel above,
    # an AVX512-BF16 GEMM), RMSNorm, RoPE, decode attention, argmax. False: oneDNN and torch only
    cpu_kernels: bool = True
    # CPU: how each linear layer runs. auto: the fastest measured on this CPU, per weight shape and batch size
    # (engine.kernels.select, cached), and the other kernels only where they beat torch; a path's name forces it
    # wherever it applies and binds every other kernel that builds, untimed (debugging, tests)
    # With cpu_kernels False only torch is honoured (oneDNN otherwise): F.linear, and quantized layers dequantized
    gemm_path: str = "auto"
    gemm_layouts: int = 2  # at most this many packed copies of a weight, each run for the batch sizes it wins
    # CPU, Llama-family models (bf16 or float32 math, W8A8 / W4A16 too): a decode step's kernels as one C call
    # (engine.models.llama_program). auto: where it measured faster than the layers' Python on the first steps of
    # each batch class; program | layers force one way (debugging, tests)
    decode_program: str = "auto"
    # what the checkpoint's quantization_config holds (engine.quant): auto takes it; none | w8a8 | w4a16 insist on
    # it (a checkpoint holding something else is refused). After loading: what was loaded, never auto
    quantization: str = "auto"
    # tensor parallel: the model split over this many ranks (processes, one device each), which the engine starts
    # itself (torch.multiprocessing) or finds started by torchrun (RANK / WORLD_SIZE in the environment)
    tensor_parallel_size: int = 1
    # DeepSeek MoE: routed experts spread whole over the tensor-parallel ranks instead of each split across them
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1  # whole engine replicas behind one front; a request goes to one of them
    # a collective that waits longer than this fails the engine (a hung rank); a dead rank fails it at once
    distributed_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        if self.served_model_name is None:
            self.served_model_name = self.model.name
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda", "npu") and not self.device.startswith(("cuda:", "npu:")):
            raise ConfigError(f"device must be auto, cpu, cuda or npu; got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.max_prefill_tokens_per_step < 0:
            raise ConfigError(f"max_prefill_tokens_per_step must be >= 0; got {self.max_prefill_tokens_per_step}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be >= 0; got {self.long_prefill_token_threshold}")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two; got {self.block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode in one step"
            )
        if self.gemm_path not in GEMM_PATHS:
            raise ConfigError(f"gemm_path must be one of {', '.join(GEMM_PATHS)}; got {self.gemm_path!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if self.decode_program not in DECODE_PROGRAM_MODES:
            modes = ", ".join(DECODE_PROGRAM_MODES)
            raise ConfigError(f"decode_program must be one of {modes}; got {self.decode_program!r}")
        if self.gemm_layouts < 1:
            raise ConfigError(f"gemm_layouts must be >= 1; got {self.gemm_layouts}")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1; got {getattr(self, name)!r}")
        if not self.distributed_timeout_s > 0:
            raise ConfigError(f"distributed_timeout_s must be > 0; got {self.distributed_timeout_s}")
        if self.tensor_parallel_size > 1 and self.device.startswith("npu"):
            raise ConfigError("tensor_parallel_size > 1 on npu (HCCL) is not implemented yet")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError(f"kv_cache_bytes must be > 0; got {self.kv_cache_bytes}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("npu"):
            try:
                import torch_npu  # noqa: F401  # registers the "npu" device with torch
            except ImportError as e:
                raise ConfigError("device 'npu' needs torch_npu: pip install 'tianmen[npu]'") from e
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            return torch.bfloat16 if _cpu_has_bf16() else torch.float32
        return torch.bfloat16
