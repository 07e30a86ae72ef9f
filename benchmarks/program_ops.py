"""Where a batch-1 decode step's time goes: each op of the decode program timed in C, and the rest of the step.

    python -m benchmarks.program_ops [--shape deepseek-v2-tiny] [--quantization w4a16|w8a8] [--quantize-lm-head]
                                     [--tokens 200] [--rounds 3] [--layers 2]

One sequence decodes --tokens tokens --rounds times (greedy, a short random prompt) with every op of the batch-1
program timed (engine.kernels.program.Program.profile: a clock read per op, ~0.2% of a step). Prints the wall time
a token, the program's share of it (the rest is the LM head, sampling and the engine's Python), each op kind's
time a token (the mean, and the sum of each op's best run: on a shared VM the means ran 25-35% above the bests,
which are what the kernel selection's timings compare with), and the first --layers layers' ops in order. Run it
alone on the machine: another process on the cores moves every figure.
"""

from __future__ import annotations

import argparse
import collections
import random
import time

from benchmarks.shapes import SHAPES, checkpoint
from benchmarks.throughput import engine, quantized
from engine import SamplingParams
from engine.kernels import program

NAMES = {v: k.removeprefix("OP_").lower() for k, v in vars(program).items() if k.startswith("OP_") and k != "OP_WIDTH"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="deepseek-v2-tiny", choices=sorted(SHAPES))
    ap.add_argument("--quantization", choices=["w8a8", "w4a16"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    if args.tokens < 2 or args.rounds < 1 or args.layers < 0:
        ap.error("--tokens must be at least 2 (one is the prefill's), --rounds at least 1, --layers not negative")
    path = checkpoint(args.shape)
    if args.quantization:
        path = quantized(path, args.quantization, args.group_size, lm_head=args.quantize_lm_head)
    llm = engine(str(path), 1, "auto")  # warmed up: the batch-1 class has settled on its program or the layers
    choice = llm.core.runner.model.programs._choices.get(0)
    if choice is None or choice.program is None or not choice.use:
        raise SystemExit("batch-1 steps do not run as a program here (see the engine's log): nothing to time")
    prog = choice.program
    ns = prog.profile()
    rng, steps, start = random.Random(5), 0, time.perf_counter()
    for _ in range(args.rounds):
        prompt = [rng.randrange(1000) for _ in range(8)]
        llm.generate([prompt], SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True))
        steps += args.tokens - 1  # the first token comes from the prefill
    wall = (time.perf_counter() - start) / steps * 1e6
    per_op, best = (ns[0] / steps / 1e3).tolist(), (ns[1] / 1e3).tolist()  # us a token; each op's best, us
    kinds = [NAMES.get(k, str(k)) for k in prog.table[:, 0].tolist()]
    print(f"{path.name}, batch 1, {steps} decode steps: {wall:.0f} us a token (prefill included), program "
          f"{sum(per_op):.0f} us, the rest (LM head, sampling, Python) {wall - sum(per_op):.0f} us")  # fmt: skip
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for kind, t, b in zip(kinds, per_op, best, strict=True):
        totals[kind][0] += t
        totals[kind][1] += b
    print("  op kind        mean a token   best a token (each op's fastest run, summed)")
    for kind, (t, b) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(f"  {kind:14s} {t:8.1f} us    {b:8.1f} us  ({kinds.count(kind)} ops)")
    layers, norms = [], 0
    for i, kind in enumerate(kinds):  # a layer starts at its input norm: every other `norm` op
        if kind == "norm":
            norms += 1
            if norms % 2 == 1 and len(layers) == args.layers:
                break
            if norms % 2 == 1:
                layers.append(i)
        if layers:
            print(f"  layer {len(layers) - 1} op {i:4d} {kind:14s} {per_op[i]:7.1f} us (best {best[i]:.1f})")


if __name__ == "__main__":
    main()
