"""Time to first token with and without a warm-up of the system prompt every call shares (~1,000 tokens).

    python -m benchmarks.warmup [--trials 5] [--system-tokens 1000] [--model DIR]

One engine (the demo model unless --model), in-process. Each trial uses a tenant of its own, so nothing is
cached for it beforehand: "cold" sends [system, question] to a tenant whose cache is empty (the first call of
an application after a start without warm-up: it prefills the whole system prompt); "warm" first pins the
system prompt for its tenant with the gateway's warm-up (gateway.warmup, as at start), then sends the same.
Both sample one token greedily; TTFT is from generate() to the first delta.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from engine import AsyncEngine, SamplingParams
from gateway.server import build_engine
from gateway.settings import WarmupPrompt, load_settings
from gateway.warmup import prefix_ids, warm_up

PARAGRAPH = (
    "You are the assistant of the ACME bank's retail customers. Answer in the customer's language, briefly and "
    "politely. Never give investment advice, never quote rates that are not in the documents you are given, and "
    "never ask for passwords, PINs or one-time codes. When a question concerns a card that was lost or stolen, "
    "tell the customer to block it in the app or to call the hotline at once. "
)
QUESTIONS = ["How do I block my card?", "What are your opening hours?", "Can I raise my transfer limit?"]


def system_prompt(engine: AsyncEngine, tokens: int) -> str:
    text = ""
    while len(engine.tokenizer.encode(text)) < tokens:
        text += PARAGRAPH
    return text


async def ttft(engine: AsyncEngine, system: str, question: str, salt: str, rid: str) -> tuple[float, int]:
    ids = engine.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])
    t = time.perf_counter()
    async for out in engine.generate(ids, SamplingParams(max_tokens=1, temperature=0), rid, cache_salt=salt):
        first = time.perf_counter() - t
        return first, out.usage.cached_tokens if out.usage else -1
    raise AssertionError("no output")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--model", type=Path, help="model directory (default: the demo model)")
    args = ap.parse_args()
    settings = load_settings()
    settings.engine.model = args.model
    engine = build_engine(settings)
    system = system_prompt(engine, args.system_tokens)
    prefix = len(prefix_ids(engine.tokenizer, WarmupPrompt(["x"], system=system)))
    asyncio.run(ttft(engine, system[:200], "warm-up call", "bench-init", "init"))  # first-call costs, uncounted
    cold, warm, pin_s, hits = [], [], [], []
    for i in range(args.trials):
        q = QUESTIONS[i % len(QUESTIONS)]
        cold.append(asyncio.run(ttft(engine, system, q, f"cold-{i}", f"c{i}"))[0])
        t = time.perf_counter()
        warm_up(engine, [WarmupPrompt([f"warm-{i}"], system=system)])
        pin_s.append(time.perf_counter() - t)
        s, cached = asyncio.run(ttft(engine, system, q, f"warm-{i}", f"w{i}"))
        warm.append(s)
        hits.append(cached)
    asyncio.run(engine.shutdown())
    print(f"model {engine.model_name}, system prompt {prefix} tokens (the shared prefix), {args.trials} trials")
    print(f"TTFT without warm-up: median {statistics.median(cold) * 1e3:.0f} ms (min {min(cold) * 1e3:.0f})")
    print(
        f"TTFT with warm-up:    median {statistics.median(warm) * 1e3:.0f} ms (min {min(warm) * 1e3:.0f}), "
        f"cached_tokens {min(hits)}-{max(hits)}"
    )
    print(f"warm-up at start:     median {statistics.median(pin_s) * 1e3:.0f} ms per prompt and tenant")


if __name__ == "__main__":
    main()
