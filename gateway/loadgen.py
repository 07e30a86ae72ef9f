"""`tianmen bench serve`: streaming chat load against a running server; TTFT / TPOT / ITL / E2E percentiles.

Closed loop: `concurrency` workers each send one streaming request at a time over keep-alive
connections until `num_requests` are sent or `duration_s` has passed. Every request asks for
`ignore_eos` and `max_tokens=output_tokens`, so each produces exactly that many tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import ssl
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.settings import Settings, load_settings

if TYPE_CHECKING:  # httpx loads only when a benchmark runs, so the rest of the CLI works without it
    import httpx

# short, common words: about one token each (with the leading space) in Llama/Qwen-family vocabularies
_WORDS = (
    "the of and to in is was for on are with as at be by this had not but from or have an they which one you "
    "were all we when there can more if no out so what up said about into than them only could new some time "
    "very also two may first like then now over such our man any even most made after well way many where "
    "before must through back years much good those people too little state long great still own under last"
)
WORDS = _WORDS.split()
HISTOGRAM_BUCKETS = 10
# answers that every further request would get too (bad token, missing scope, unknown model): stop sending
FATAL_STATUSES = (401, 403, 404)
HISTOGRAM_WIDTH = 40


class LoadgenError(RuntimeError):
    """The benchmark cannot start (no model list, no token); the message says what to pass."""


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds from the moment it was sent."""

    ok: bool = False
    status: int | None = None  # None: no HTTP response (connection refused, TLS failure, timeout)
    error: str | None = None  # the status code, or the exception's class, or "stream error"
    detail: str | None = None  # the server's error message or the exception text, truncated
    ttft_s: float | None = None  # until the first chunk that carries a token
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # one gap per output token after the first
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(slots=True)
class LoadReport:
    url: str
    model: str
    concurrency: int
    prompt_tokens: int  # the target; the measured mean is in the results' usage
    output_tokens: int
    duration_s: float
    results: list[RequestResult]
    stopped: str | None = None  # why no more requests were sent before the count or the duration ran out

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def errors(self) -> dict[str, int]:
        return dict(sorted(Counter(r.error or "unknown" for r in self.results if not r.ok).items()))

    def format(self) -> str:
        done, dur = self.completed, max(self.duration_s, 1e-9)
        out_tok = sum(r.output_tokens for r in done)
        in_tok = sum(r.prompt_tokens for r in done)
        mean_prompt = f" (mean {in_tok / len(done):.1f} with the chat template)" if done else ""
        lines = [
            f"Tianmen serving benchmark: {self.url}, model {self.model}",
            f"concurrency {self.concurrency}, prompt ~{self.prompt_tokens} tokens{mean_prompt}, "
            f"output {self.output_tokens} tokens, {self.duration_s:.2f} s",
            f"Requests     {len(done)} completed, {len(self.results) - len(done)} failed",
            f"Throughput   {len(done) / dur:.2f} req/s, output {out_tok / dur:.1f} tok/s, "
            f"total {(in_tok + out_tok) / dur:.1f} tok/s",
        ]
        if self.stopped:
            lines.append(f"Stopped early: {self.stopped}")
        if self.errors:
            lines.append("Errors")
            for key, count in self.errors.items():
                detail = next((r.detail for r in self.results if r.error == key and r.detail), None)
                lines.append(f"  {key} x{count}" + (f": {detail}" if detail else ""))
        timed = [r for r in done if r.ttft_s is not None]
        if not timed:
            lines.append("No request completed: no latency figures.")
            return "\n".join(lines)
        series = {
            "TTFT": [r.ttft_s for r in timed if r.ttft_s is not None],
            "TPOT": [t for r in timed if (t := r.tpot_s) is not None],
            "ITL": [g for r in timed for g in r.itl_s],
            "E2E": [r.e2e_s for r in timed],
        }
        lines += ["", f"{'Latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
        for name, values in series.items():
            if not values:
                lines.append(f"{name:<14}{'-':>10}{'-':>10}{'-':>10}{'-':>10}")
                continue
            v = sorted(values)
            row = [sum(v) / len(v), percentile(v, 50), percentile(v, 90), percentile(v, 99)]
            lines.append(f"{name:<14}" + "".join(f"{x * 1e3:>10.2f}" for x in row))
        lines += ["", f"E2E latency histogram (ms), {len(timed)} requests"]
        lines += histogram(series["E2E"])
        return "\n".join(lines)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on an already sorted list."""
    assert sorted_values and 0 <= q <= 100
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def histogram(values: list[float], buckets: int = HISTOGRAM_BUCKETS, width: int = HISTOGRAM_WIDTH) -> list[str]:
    """Text bars of `values` (seconds) in `buckets` equal-width bins between min and max, labelled in ms."""
    lo, hi = min(values), max(values)
    step = (hi - lo) / buckets
    counts = [0] * buckets
    for v in values:
        counts[min(int((v - lo) / step), buckets - 1) if step > 0 else 0] += 1
    if step == 0:
        counts = counts[:1]
    peak = max(counts)
    out = []
    for i, n in enumerate(counts):
        a, b = (lo + i * step) * 1e3, (lo + (i + 1) * step if step > 0 else hi) * 1e3
        bar = "#" * max(1 if n else 0, round(n / peak * width))
        out.append(f"  {a:>9.1f} - {b:>9.1f} | {bar:<{width}} {n}")
    return out


def make_prompt(rng: random.Random, num_tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, num_tokens)))


def _client(ca_file: Path | None, insecure: bool, connections: int, timeout_s: float) -> httpx.AsyncClient:
    import httpx

    verify: ssl.SSLContext | bool = True
    if insecure:
        verify = False
    elif ca_file is not None:
        verify = ssl.create_default_context(cafile=str(ca_file))
    return httpx.AsyncClient(
        verify=verify,
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


def _message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        text = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        text = body.decode("utf-8", "replace")
    return (text or "").strip()[:200]


def _tokens_in(chunk: dict[str, Any]) -> int:
    """Output tokens a chunk carries: its logprob entries when present (exact), else 1 for non-empty text."""
    n = 0
    for choice in chunk.get("choices") or []:
        entries = (choice.get("logprobs") or {}).get("content")
        if entries:
            n += len(entries)
        elif (choice.get("delta") or {}).get("content"):
            n += 1
    return n


async def _one(
    client: httpx.AsyncClient, endpoint: str, headers: dict[str, str], body: dict[str, Any]
) -> RequestResult:
    import httpx

    res = RequestResult()
    t0 = time.perf_counter()
    last, counted, done = 0.0, 0, False
    ended: float | None = None  # when [DONE] came
    try:
        async with client.stream("POST", endpoint, json=body, headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error, res.detail = str(resp.status_code), _message(await resp.aread())
                return res
            # NOTE: read to the end of the body, past [DONE]: leaving early closes the connection instead of
            # returning it to the pool, and every request would pay a new TCP + TLS handshake
            async for line in resp.aiter_lines():
                if done or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done, ended = True, time.perf_counter()
                    continue
                chunk = json.loads(data)
                if "error" in chunk:  # headers were sent: the server reports failures in-band
                    res.error, res.detail = "stream error", _message(data.encode())
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                    res.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                n = _tokens_in(chunk)
                if not n:
                    continue
                now = time.perf_counter() - t0
                if res.ttft_s is None:
                    res.ttft_s = now
                    res.itl_s += [0.0] * (n - 1)
                else:  # several tokens in one chunk share its gap
                    res.itl_s += [(now - last) / n] * n
                last, counted = now, counted + n
    except httpx.HTTPError as e:
        res.error, res.detail = type(e).__name__, (str(e) or repr(e))[:200]
        return res
    except (ValueError, KeyError, TypeError) as e:
        res.error, res.detail = "bad chunk", str(e)[:200]
        return res
    finally:
        res.e2e_s = (ended or time.perf_counter()) - t0
    if not done:
        res.error = "incomplete stream"
        return res
    res.output_tokens = res.output_tokens or counted
    res.ok = True
    return res


async def run_load(
    url: str,
    token: str,
    model: str,
    *,
    concurrency: int,
    prompt_tokens: int,
    output_tokens: int,
    duration_s: float | None,
    num_requests: int | None,
    ca_file: Path | None,
    insecure: bool = False,
    logprobs: bool = True,
    timeout_s: float = 600.0,
    seed: int = 0,
) -> LoadReport:
    """Run the load and return every request's timings; failures are in the report, never raised.

    `logprobs` asks for each token's logprob so every token is timed exactly (one entry per token);
    without it, a chunk with text counts as one token, as vLLM's benchmark does."""
    if duration_s is None and num_requests is None:
        raise ValueError("give duration_s or num_requests")
    if concurrency < 1 or output_tokens < 1 or prompt_tokens < 1:
        raise ValueError("concurrency, prompt_tokens and output_tokens must be >= 1")
    rng = random.Random(seed)
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {token}"}
    results: list[RequestResult] = []
    issued = 0
    stopped: str | None = None
    started = time.perf_counter()
    deadline = None if duration_s is None else started + duration_s

    def more() -> bool:
        under_count = num_requests is None or issued < num_requests
        return stopped is None and under_count and (deadline is None or time.perf_counter() < deadline)

    async with _client(ca_file, insecure, concurrency, timeout_s) as client:

        async def worker() -> None:
            nonlocal issued, stopped
            while more():
                issued += 1
                body: dict[str, Any] = {
                    "model": model,
                    "messages": [{"role": "user", "content": make_prompt(rng, prompt_tokens)}],
                    "max_tokens": output_tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                if logprobs:
                    body["logprobs"] = True
                result = await _one(client, endpoint, headers, body)
                results.append(result)
                if result.status in FATAL_STATUSES and stopped is None:
                    stopped = f"the server answered {result.status}, as it would to every further request"
                if result.status is None:  # unreachable: don't spin through thousands of refusals
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LoadReport(
        url, model, concurrency, prompt_tokens, output_tokens, time.perf_counter() - started, results, stopped
    )


async def list_models(url: str, token: str, ca_file: Path | None, insecure: bool = False) -> list[str]:
    import httpx

    async with _client(ca_file, insecure, 1, 30.0) as client:
        try:
            resp = await client.get(url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {token}"})
        except httpx.HTTPError as e:
            raise LoadgenError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise LoadgenError(f"GET /v1/models answered {resp.status_code}: {_message(resp.content)}")
    models = [m["id"] for m in resp.json().get("data", [])]
    if not models:
        raise LoadgenError("GET /v1/models lists no model this token may use; pass --model")
    return models


async def request_profile(url: str, token: str, steps: int, ca_file: Path | None, insecure: bool = False) -> str:
    """Ask the server to trace the next `steps` engine steps; returns a line for the operator."""
    import httpx

    async with _client(ca_file, insecure, 1, 30.0) as client:
        try:
            resp = await client.post(
                url.rstrip("/") + "/admin/profile",
                json={"steps": steps},
                headers={"Authorization": f"Bearer {token}"},
            )
        except httpx.HTTPError as e:
            return f"profiling not started: {type(e).__name__}: {e}"
    if resp.status_code == 200:
        return f"profiling the next {steps} engine steps; Chrome trace: {resp.json().get('trace')}"
    if resp.status_code == 403:
        return "profiling not started: the token lacks the admin scope (403); running the load without it"
    if resp.status_code == 404:
        return "profiling not started: this server has no /admin/profile (404); running the load without it"
    return f"profiling not started: {resp.status_code} {_message(resp.content)}"


# ---- command line ------------------------------------------------------------------------------------------
def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `bench serve` on the `tianmen` parser's subcommands."""
    bench = subparsers.add_parser("bench", help="measure a running server")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser("serve", help="streaming chat load: TTFT, TPOT, ITL and E2E percentiles, latency histogram")
    p.add_argument("--config", type=Path, help="settings (TIANMEN_HOME, server port) for the defaults below")
    p.add_argument("--url", help="server base URL (default: https://127.0.0.1:<server.port>)")
    p.add_argument("--token", help="bearer token (default: a dev token from TIANMEN_HOME's dev PKI)")
    p.add_argument("--model", help="model id (default: the first of GET /v1/models)")
    p.add_argument("--cacert", type=Path, help="CA of the server certificate (default: TIANMEN_HOME's dev CA)")
    p.add_argument("--insecure", action="store_true", help="do not verify the server certificate")
    p.add_argument("--concurrency", type=_positive, default=8, help="requests in flight (default 8)")
    p.add_argument("--prompt-tokens", type=_positive, default=128, help="prompt length, roughly (default 128)")
    p.add_argument("--output-tokens", type=_positive, default=64, help="tokens per response (default 64)")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, help="seconds to send requests for (default 30)")
    stop.add_argument("--requests", type=_positive, help="send this many requests instead")
    p.add_argument("--profile-steps", type=_positive, help="trace N engine steps with torch.profiler (admin scope)")
    p.add_argument(
        "--no-logprobs",
        action="store_true",
        help="time SSE chunks, not tokens: the server computes no logprobs, a chunk may hold several tokens",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt words seed")
    p.set_defaults(func=main)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _default_url(settings: Settings) -> str:
    host = settings.server.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    host = f"[{host}]" if ":" in host else host
    return f"{'http' if settings.server.insecure_http else 'https'}://{host}:{settings.server.port}"


def _dev_token(settings: Settings, admin: bool) -> str:
    from security.devpki import ensure_dev_pki, mint_token

    if settings.auth.external:
        raise LoadgenError("this configuration verifies tokens from an external key set: pass --token")
    if not (settings.pki_dir / "jwt-signing-key.pem").exists():
        raise LoadgenError(f"no dev PKI under {settings.pki_dir} (set TIANMEN_HOME or --config): pass --token")
    pki = ensure_dev_pki(settings.home)
    scopes = [settings.auth.required_scope or "inference"] + ([settings.auth.admin_scope] if admin else [])
    return mint_token(
        pki.jwt_key,
        pki.kid,
        sub="bench",
        tenant="bench",
        scopes=scopes,
        ttl_s=24 * 3600,
        issuer=settings.auth.issuer or "tianmen-dev",
        audience=settings.auth.audience or "tianmen",
    )


def main(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    url = args.url or _default_url(settings)
    cacert = args.cacert
    dev_ca = settings.pki_dir / "ca.pem"
    if cacert is None and not args.insecure and url.startswith("https:") and dev_ca.exists():
        cacert = dev_ca
    duration = args.duration if args.duration is not None or args.requests is not None else 30.0
    try:
        token = args.token or _dev_token(settings, admin=bool(args.profile_steps))
        return asyncio.run(_bench(args, url, token, cacert, duration))
    except LoadgenError as e:
        print(f"tianmen bench serve: {e}", file=sys.stderr)
        return 2


async def _bench(args: argparse.Namespace, url: str, token: str, cacert: Path | None, duration: float | None) -> int:
    model = args.model or (await list_models(url, token, cacert, args.insecure))[0]
    if args.profile_steps:
        print(await request_profile(url, token, args.profile_steps, cacert, args.insecure), flush=True)
    report = await run_load(
        url,
        token,
        model,
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        duration_s=duration,
        num_requests=args.requests,
        ca_file=cacert,
        insecure=args.insecure,
        logprobs=not args.no_logprobs,
        seed=args.seed,
    )
    print(report.format())
    return 0 if report.completed else 1
