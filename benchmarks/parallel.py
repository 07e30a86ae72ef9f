"""What tensor parallel costs in communication: per-step collective time and its share of the step, TP=1 vs TP=N.

    python -m benchmarks.parallel [--shape qwen2-0.5b] [--tp 2] [--num-prompts 8] [--prompt-len 128]
                                  [--output-len 32] [--device cpu]

Runs the same greedy batch (random ids, EOS ignored, prefix caching off) once to warm up, then once timed, at
TP=1 and at TP=N (worker processes the engine starts itself; gloo on CPU, NCCL on CUDA). Prints tokens/s and,
per rank, ms per step, ms per step inside collectives and that share. On a CPU the ranks share the cores (each
gets cores / N threads), so TP cannot be faster there: the communication figure is what a real multi-device
machine pays per step. Rank 0's figures are exact; a worker's are published at most a second apart and may
miss the last steps. A collective's time includes waiting for the slower rank; to tell that from the transport,
the last lines time bare all-reduces of one decode step's activations between two idle processes.
"""

from __future__ import annotations

import argparse
import datetime
import random
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.shapes import SHAPES, checkpoint
from engine import LLM, EngineConfig, SamplingParams
from engine.parallel.launch import join_store, local_store

ROUNDS = 2000


def run(args: argparse.Namespace, tp: int) -> None:
    config = EngineConfig(
        model=checkpoint(args.shape),
        device=args.device,
        tensor_parallel_size=tp,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=max(4096, args.num_prompts * args.prompt_len),
        enable_prefix_caching=False,
    )
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    with LLM(config) as llm:
        llm.generate(prompts, params)  # warm-up: first-touch of weights and caches, GEMM choices
        time.sleep(1.2)  # let the workers publish their warm-up figures, subtracted below
        before = {r["rank"]: r for r in llm.core.executor.rank_stats()}
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        time.sleep(1.2)
        after = llm.core.executor.rank_stats()
    tokens = args.num_prompts * args.output_len
    print(f"TP={tp}: {tokens / seconds:8.1f} tokens/s ({seconds:.2f} s for {tokens} tokens)")
    for r in after:
        b = before.get(r["rank"], {})
        steps = r.get("steps", 0) - b.get("steps", 0)
        if not steps:
            print(f"  rank {r['rank']}: no figures published yet")
            continue
        step = (r["step_seconds"] - b.get("step_seconds", 0.0)) / steps
        comm = (r["comm_seconds"] - b.get("comm_seconds", 0.0)) / steps
        n = (r["collectives"] - b.get("collectives", 0)) / steps
        print(
            f"  rank {r['rank']}: {steps} steps, {step * 1e3:7.2f} ms/step, collectives {comm * 1e3:6.2f} ms/step "
            f"({n:.0f} a step, {comm / step:5.1%} of the step)"
        )


def _peer(port: int, rows: int, hidden: int, dtype: torch.dtype) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("bench", join_store(port, 2, timeout)), 1, 2, timeout)
    x = torch.ones(rows, hidden, dtype=dtype)
    for _ in range(100 + ROUNDS):
        pg.allreduce([x]).wait()


def bare_all_reduce(rows: int, hidden: int, dtype: torch.dtype) -> float:
    """Seconds per gloo all-reduce of [rows, hidden] between two processes that do nothing else."""
    torch.set_num_threads(1)
    store = local_store(2, datetime.timedelta(seconds=60))
    peer = mp.get_context("spawn").Process(target=_peer, args=(store.port, rows, hidden, dtype))
    peer.start()
    timeout = datetime.timedelta(seconds=60)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), 0, 2, timeout)
    x = torch.ones(rows, hidden, dtype=dtype)
    for _ in range(100):
        pg.allreduce([x]).wait()
    t0 = time.perf_counter()
    for _ in range(ROUNDS):
        pg.allreduce([x]).wait()
    seconds = (time.perf_counter() - t0) / ROUNDS
    peer.join()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2-0.5b", choices=list(SHAPES))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    for tp in (1, args.tp):
        run(args, tp)
    hidden = SHAPES[args.shape]["hidden_size"]
    for dtype in (torch.float32, torch.bfloat16):
        s = bare_all_reduce(args.num_prompts, hidden, dtype)
        print(f"bare gloo all-reduce of [{args.num_prompts}, {hidden}] {str(dtype)[6:]}: {s * 1e6:.0f} us")


if __name__ == "__main__":
    main()
