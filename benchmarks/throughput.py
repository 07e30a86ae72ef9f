"""Engine throughput vs HF transformers on the same workload, in the same run.

    python -m benchmarks.throughput [--shape qwen2-0.5b|deepseek-v2-tiny] [--num-prompts 32] [--prompt-len 128]
                                    [--output-len 128] [--vllm /path/to/vllm-venv/bin/python] [--onednn-row]

Batch: N prompts of random token ids, greedy, EOS ignored → output tok/s. Batch-1: ms per decoded token.
Each engine runs in a fresh process of its own, so neither inherits the other's threads, caches or malloc
settings (ours keeps freed memory for reuse, see engine/malloc.py; transformers runs as its users run it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import random
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks.shapes import SHAPES, checkpoint
from engine import LLM, EngineConfig, SamplingParams


def ours(path: str, prompts: list[list[int]], n: int, dtype: str, cpu_kernels: bool = True) -> tuple[float, float]:
    config = EngineConfig(
        model=path, dtype=dtype, max_num_seqs=max(len(prompts), 1), max_model_len=1024, cpu_kernels=cpu_kernels
    )
    llm = LLM(config)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    batch_s = time.perf_counter() - t
    assert all(len(o.token_ids) == n for o in outs)
    t = time.perf_counter()
    llm.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompts[1]], params)
    one_s = time.perf_counter() - t
    return len(prompts) * n / batch_s, (one_s - prefill_s) / (n - 1) * 1e3


def hf(path: str, prompts: list[list[int]], n: int, dtype: torch.dtype) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=4, **kw)
        t = time.perf_counter()
        model.generate(torch.tensor(prompts), max_new_tokens=n, min_new_tokens=n, **kw)
        batch_s = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=1, **kw)
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(torch.tensor([prompts[1]]), max_new_tokens=n, min_new_tokens=n, **kw)
        one_s = time.perf_counter() - t
    return len(prompts) * n / batch_s, (one_s - prefill_s) / (n - 1) * 1e3


def vllm(python: str, path: str, prompts: list[list[int]], n: int, dtype: str) -> tuple[str, float, float]:
    """The same workload on vLLM's CPU build, in its own venv (`python` is that venv's interpreter)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(prompts, f)
        f.flush()
        script = Path(__file__).with_name("vllm_peer.py")
        done = subprocess.run(
            [python, str(script), path, f.name, str(n), dtype], capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        raise SystemExit(f"vLLM peer failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return f"vLLM CPU {result['version']}", result["batch_tok_s"], result["ms_per_token"]


def isolated(fn: Callable[..., tuple[float, float]], *args: object) -> tuple[float, float]:
    """fn(*args) in a fresh interpreter (spawned, not forked)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    ap.add_argument(
        "--onednn-row", action="store_true", help="also run tianmen with cpu_kernels off (every GEMM in oneDNN)"
    )
    ap.add_argument("--vllm", metavar="PYTHON", help="also run vLLM's CPU build with this venv's python")
    args = ap.parse_args()

    path = str(checkpoint(args.shape))
    vocab = SHAPES[args.shape]["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(max(args.num_prompts, 2))]
    dtype = EngineConfig(model=path, dtype=args.dtype).torch_dtype
    dname = str(dtype).removeprefix("torch.")

    rows = [("tianmen", *isolated(ours, path, prompts[: args.num_prompts], args.output_len, dname))]
    if args.onednn_row:
        rows.append(
            ("tianmen-onednn", *isolated(ours, path, prompts[: args.num_prompts], args.output_len, dname, False))
        )
    if not args.no_hf:
        rows.append(
            (
                f"transformers {__import__('transformers').__version__}",
                *isolated(hf, path, prompts[: args.num_prompts], args.output_len, dtype),
            )
        )
    if args.vllm:
        rows.append(vllm(args.vllm, path, prompts[: args.num_prompts], args.output_len, dname))

    print(
        f"\n{args.shape}, {dname}, {args.num_prompts} x {args.prompt_len} -> {args.output_len}, greedy; "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"{'engine':<24} {'batch tok/s':>12} {'batch-1 ms/token':>18}")
    for name, tps, ms in rows:
        print(f"{name:<24} {tps:>12.1f} {ms:>18.1f}")
    for name, tps, ms in rows[1:]:  # > 1: tianmen is faster
        peer = "hf" if name.startswith("transformers") else name.split()[0]
        print(f"{'ratio vs ' + peer:<24} {rows[0][1] / tps:>11.2f}x {ms / rows[0][2]:>17.2f}x faster")


if __name__ == "__main__":
    main()
