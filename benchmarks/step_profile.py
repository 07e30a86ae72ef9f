"""Where a step's time goes: the throughput workload with a timer around each kind of module call.

    python -m benchmarks.step_profile [--shape qwen2-0.5b] [--num-prompts 32] [--output-len 128] [--no-cpu-kernels]
                                      [--quantization w8a8|w4a16 [--group-size 128] [--quantize-lm-head]]
                                      [--dtype auto|bfloat16|float32]

Runs N prompts x 128 random ids -> --output-len tokens (greedy, EOS ignored, prefix caching off) once to warm
up, then once timed, wrapping Linear, attention, RMSNorm, DeepSeek's MoE and MLA layers and the runner's step
with wall-clock timers. Prints
one row per (module, shape) with its total, call count and ms per call; rows with more than 64 input rows
are the prefill's. The wrappers cost a little themselves; compare runs of this command with each other, and
throughput with benchmarks.throughput. Decode steps run through the layers unless --decode-program says
otherwise: a step run as one program (engine.models.llama_program) has no module calls to time.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.shapes import SHAPES, checkpoint
from benchmarks.throughput import quantized
from engine import LLM, EngineConfig, SamplingParams
from engine.config import DECODE_PROGRAM_MODES, GEMM_PATHS
from engine.kernels.decode_attn import DecodeAttention
from engine.kernels.grouped import GroupedExperts
from engine.kernels.select import GemmPlan, row_class
from engine.layers.attention import PagedAttention
from engine.layers.linear import Linear
from engine.layers.mla import MLAttention
from engine.layers.moe import MoE
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_runner import ModelRunner
from engine.sampler import Sampler

TOTAL: defaultdict[str, float] = defaultdict(float)
CALLS: Counter[str] = Counter()


def _timed(cls: type, method: str, key: Callable[[Any, tuple[Any, ...]], str]) -> None:
    original = getattr(cls, method)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = original(self, *args, **kwargs)
        k = key(self, args)
        TOTAL[k] += time.perf_counter() - t
        CALLS[k] += 1
        return out

    setattr(cls, method, wrapper)


def _gemm_key(plan: GemmPlan, args: tuple[Any, ...]) -> str:
    rows = args[0].numel() // plan.in_features
    return f"gemm K {plan.in_features} via {plan.names[row_class(rows)]}, M {_rows(args[0])}"


def _rows(x: torch.Tensor) -> str:
    return ">64" if x.shape[0] > 64 else str(x.shape[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-cpu-kernels", action="store_true", help="cpu_kernels = false: oneDNN and torch only")
    ap.add_argument("--gemm-path", default="auto", choices=GEMM_PATHS, help="force one GEMM path (default: measured)")
    ap.add_argument(
        "--decode-program",
        default="layers",
        choices=DECODE_PROGRAM_MODES,
        help="decode steps through the layers (default: each module timed) or as one C call (its steps are one row)",
    )
    ap.add_argument("--quantization", choices=["w8a8", "w4a16"], help="profile the shape's quantized copy")
    ap.add_argument("--group-size", type=int, default=128, help="w4a16's group size")
    ap.add_argument("--quantize-lm-head", action="store_true", help="with the LM head quantized too")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="the engine's math")
    args = ap.parse_args()

    _timed(GemmPlan, "__call__", _gemm_key)
    _timed(Linear, "forward", lambda m, a: f"linear {m.out_features} x {m.in_features} (incl. its GEMM)")
    _timed(PagedAttention, "forward", lambda m, a: f"attention, M {_rows(a[0])}")
    _timed(RMSNorm, "forward", lambda m, a: f"add + RMSNorm, M {_rows(a[0])}")
    _timed(DecodeAttention, "__call__", lambda m, a: f"  decode kernel {type(m).__name__}, M {_rows(a[0])}")
    _timed(RotaryEmbedding, "forward", lambda m, a: f"RoPE angles, M {_rows(a[0])}")
    _timed(Sampler, "__call__", lambda m, a: "sampler")
    _timed(MoE, "forward", lambda m, a: f"MoE layer (router, experts, shared), M {_rows(a[0])}")
    _timed(GroupedExperts, "__call__", lambda m, a: f"  routed experts, grouped call, M {_rows(a[0])}")
    _timed(MLAttention, "forward", lambda m, a: f"MLA layer (projections, attention), M {_rows(a[0])}")
    _timed(MLAttention, "_decode", lambda m, a: f"  MLA decode (W_UK, attention, W_UV), M {_rows(a[0])}")
    _timed(ModelRunner, "execute", lambda m, a: "runner step (all of the above and the rest)")

    path = checkpoint(args.shape)
    if args.quantization:  # the copy benchmarks.throughput --quantization makes and keeps
        path = quantized(path, args.quantization, args.group_size, args.quantize_lm_head)
    vocab = SHAPES[args.shape]["vocab_size"]
    config = EngineConfig(
        model=str(path),
        max_num_seqs=args.num_prompts,
        max_model_len=1024,
        dtype=args.dtype,
        enable_prefix_caching=False,
        cpu_kernels=not args.no_cpu_kernels,
        gemm_path=args.gemm_path,
        decode_program=args.decode_program,
    )
    llm = LLM(config)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for _ in range(2):  # the first run warms up; only the second is kept
        TOTAL.clear()
        CALLS.clear()
        prompts = [[rng.randrange(vocab) for _ in range(128)] for _ in range(args.num_prompts)]
        t = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t

    dtype = str(config.torch_dtype).removeprefix("torch.")
    kernels = "off" if args.no_cpu_kernels else "on"
    workload = f"{args.num_prompts} x 128 -> {args.output_len}"
    shape = args.shape + (f" {args.quantization}" if args.quantization else "")
    print(f"\n{shape}, {dtype}, cpu_kernels {kernels}, {workload}: {wall:.2f} s")
    print(f"{'what':<48} {'total ms':>10} {'calls':>7} {'ms/call':>9}")
    for k, v in sorted(TOTAL.items(), key=lambda kv: -kv[1]):
        print(f"{k:<48} {v * 1e3:>10.1f} {CALLS[k]:>7} {v / CALLS[k] * 1e3:>9.3f}")


if __name__ == "__main__":
    main()
