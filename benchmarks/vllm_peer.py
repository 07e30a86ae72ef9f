"""The throughput workload on vLLM's CPU build, run with *that* venv's python by `benchmarks.throughput --vllm`.

    /path/to/vllm-venv/bin/python benchmarks/vllm_peer.py MODEL_DIR PROMPTS_JSON OUTPUT_LEN DTYPE

Standalone on purpose: it imports only vllm (its venv has none of ours). Prints one line
`RESULT {"batch_tok_s": ..., "ms_per_token": ..., "version": ...}` among vLLM's own output, measured as
`benchmarks.throughput` measures our engine.
"""

from __future__ import annotations

import json
import os
import sys
import time

# Run as a script, this file's directory is sys.path[0]: our benchmark modules would shadow top-level packages
# vLLM imports (a `kernels` module here once broke its import).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def main() -> None:
    model, prompts_file, n, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with open(prompts_file) as f:
        prompts: list[list[int]] = json.load(f)
    # vLLM's CPU build keeps one core for itself unless told which to bind (halving its throughput on 2 cores)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    from vllm import LLM, SamplingParams, TokensPrompt

    # on CPU this fraction of RAM is reserved (weights + KV); the default 0.92 fails when anything else runs
    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=1024,
        max_num_seqs=max(len(prompts), 1),
        seed=0,
        gpu_memory_utilization=0.5,
        skip_tokenizer_init=True,  # token ids in and out, as for our engine; the random models have no tokenizer
    )
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)

    def run(batch: list[list[int]], p: SamplingParams) -> float:
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], p, use_tqdm=False)
        elapsed = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == p.max_tokens for o in outs)
        return elapsed

    run([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False))  # warm-up
    batch_s = run(prompts, params)
    prefill_s = run([prompts[0]], first)
    one_s = run([prompts[1]], params)
    result = {"batch_tok_s": len(prompts) * n / batch_s, "ms_per_token": (one_s - prefill_s) / (n - 1) * 1e3}
    result["version"] = __import__("vllm").__version__
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
