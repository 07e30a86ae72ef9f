"""Privacy policy cost: what screening a prompt adds to a request, and what filtering a stream adds per chunk.

    python -m benchmarks.privacy [--requests 2000] [--terms 10000] [--chars 2000]

Prompt: a chat request whose 2,000-character message (Chinese and English business text with a card number,
an ID, a mobile number and an e-mail address in it) goes through `PrivacySession.screen` with every detector on
and a term list of 10,000 terms: the policy object built per request, detection, masking, the new body. Rows:
every policy `audit` (the default: detect and count), and `mask`.

Adversarial (--adversarial): one scan of 1 MiB texts built to be expensive ("1 1 1 …", "@@@…", a term that
overlaps itself at every position, 1 MiB of valid card numbers), every detector and a term list on.

Stream: an answer of about 2,000 characters fed to the completion filter in chunks of 1-6 characters (about a
token each), every detector and the term list on, `mask`. Per chunk: the filter's CPU time, and the hold-back
delay: for each character, how many chunks after its own it was released (0: in the chunk it came in).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from gateway.privacy import build_privacy
from gateway.protocol import ChatCompletionRequest
from gateway.settings import PrivacySettings
from gateway.state import RequestState
from security.pii_stream import StreamFilter
from tests import pii_samples as gen

FILLER_ZH = "尊敬的客户，您好！关于您在本行办理的理财产品，收益按季度结算，请留意到期日并及时续约。"
FILLER_EN = "Thank you for contacting the bank. Your request about the wealth-management product is in review. "


def prompt_text(rng: random.Random, chars: int) -> str:
    parts: list[str] = []
    pii = [
        f"卡号{gen.card(rng, 16)}，",
        f"身份证号{gen.id18(rng)}。",
        f"手机 {gen.mobile(rng)} ",
        "email zhang.san@example.com.cn ",
    ]
    while sum(map(len, parts)) < chars:
        parts.append(rng.choice([FILLER_ZH, FILLER_EN]))
        if pii and rng.random() < 0.3:
            parts.append(pii.pop())
    parts.extend(pii)
    return "".join(parts)[:chars]


def term_file(directory: Path, n: int, rng: random.Random) -> Path:
    alphabet = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可里后"
    terms = {"".join(rng.choice(alphabet) for _ in range(rng.randint(3, 6))) for _ in range(n * 2)}
    path = directory / "terms.txt"
    path.write_text("\n".join(sorted(terms)[:n]) + "\n", encoding="utf-8")
    return path


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=100)
    return q[49], q[89], q[98]


def bench_prompt(settings: PrivacySettings, text: str, requests: int) -> tuple[float, float, float, int]:
    privacy = build_privacy(settings)
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    )
    times: list[float] = []
    for i in range(requests + 50):
        t = time.perf_counter()
        state = RequestState("r")
        session = privacy.session("bench", state)
        session.screen(body, None)
        dt = time.perf_counter() - t
        if i >= 50:  # warm-up
            times.append(dt)
    hits = sum(state.policy_hits.values())
    return (*(x * 1e3 for x in quantiles(times)), hits)


def bench_stream(settings: PrivacySettings, text: str, rng: random.Random, runs: int) -> dict[str, float]:
    privacy = build_privacy(settings)
    session = privacy.session("bench", RequestState("r"))
    per_chunk: list[float] = []
    delays: list[int] = []
    held: list[int] = []
    for _ in range(runs):
        chunks, pos = [], 0
        while pos < len(text):
            n = rng.randint(1, 6)
            chunks.append(text[pos : pos + n])
            pos += n
        f = StreamFilter(session.completion_scanner, session.policy.completion)
        arrived: list[int] = []  # chunk index of each character not yet released
        released = 0
        for k, chunk in enumerate(chunks):
            arrived.extend([k] * len(chunk))
            t = time.perf_counter()
            f.feed(chunk)
            per_chunk.append(time.perf_counter() - t)
            held.append(f.held)
            newly = len(arrived) - f.held - released  # masking keeps lengths: released counts map 1:1
            delays.extend(k - a for a in arrived[released : released + newly])
            released += newly
        f.finish()
    p50, _, p99 = quantiles(per_chunk)
    return {
        "chunk_us_p50": p50 * 1e6,
        "chunk_us_p99": p99 * 1e6,
        "delay0": sum(d == 0 for d in delays) / len(delays),
        "delay_le1": sum(d <= 1 for d in delays) / len(delays),
        "delay_p99": statistics.quantiles(delays, n=100)[98],
        "delay_max": max(delays),
        "held_mean": statistics.fmean(held),
    }


def bench_adversarial() -> None:
    from security.pii_detectors import detectors
    from security.pii_scan import Scanner
    from security.pii_terms import TermMatcher

    scanner = Scanner(detectors(), [("t", TermMatcher([f"词{i}" for i in range(1000)] + ["a" * 10]))])
    scanner.scan("１@ a 1")  # builds the NFKC and folding tables once
    print("| 1 MiB of | scan s | hits |")
    print("|---|---|---|")
    cases = ["1 ", "@", "1.", "a@", "a" * 60 + "@", "x123456789012345678901234567890", "6222021234567894 ", "客户"]
    for unit in cases:
        text = unit * ((1 << 20) // len(unit))
        t = time.perf_counter()
        hits, _ = scanner.scan(text)
        print(f"| `{unit[:20]}`… | {time.perf_counter() - t:.3f} | {len(hits)} |")


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration, subprocess.CalledProcessError):
        return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--terms", type=int, default=10_000)
    ap.add_argument("--chars", type=int, default=2000)
    ap.add_argument("--stream-runs", type=int, default=20)
    ap.add_argument("--adversarial", action="store_true", help="only the 1 MiB adversarial scans")
    args = ap.parse_args()
    if args.adversarial:
        print(f"CPU: {cpu()}; Python {platform.python_version()}")
        bench_adversarial()
        return
    rng = random.Random(0)
    text = prompt_text(rng, args.chars)
    print(f"CPU: {cpu()}; Python {platform.python_version()}; {args.chars}-character prompt, {args.terms} terms")
    with tempfile.TemporaryDirectory() as tmp:
        terms = str(term_file(Path(tmp), args.terms, rng))
        print("| policy | p50 ms | p90 ms | p99 ms | hits per request |")
        print("|---|---|---|---|---|")
        for name, action in (("off (detectors not run)", "off"), ("audit (the default)", "audit"), ("mask", "mask")):
            s = PrivacySettings(
                term_lists={"sensitive": terms}, default={"prompt": {"*": action}, "completion": {"*": action}}
            )
            p50, p90, p99, hits = bench_prompt(s, text, args.requests)
            print(f"| {name} | {p50:.3f} | {p90:.3f} | {p99:.3f} | {hits} |")
        s = PrivacySettings(term_lists={"sensitive": terms}, default={"completion": {"*": "mask"}})
        r = bench_stream(s, text, rng, args.stream_runs)
        print()
        print(
            "| stream, chunks of 1-6 chars, mask | per chunk p50 µs | p99 µs | chars out in their own chunk |"
            " within 1 chunk | delay p99 / max (chunks) | chars held (mean) |"
        )
        print("|---|---|---|---|---|---|---|")
        print(
            f"| every detector + {args.terms} terms | {r['chunk_us_p50']:.0f} | {r['chunk_us_p99']:.0f} |"
            f" {r['delay0']:.1%} | {r['delay_le1']:.1%} | {r['delay_p99']:.0f} / {r['delay_max']:.0f} |"
            f" {r['held_mean']:.1f} |"
        )


if __name__ == "__main__":
    main()
