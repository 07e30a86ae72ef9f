"""Where the serving path's time goes: `tianmen serve` (HTTPS + JWT + limiter + audit, the demo model) in this
process with timers on each stage, driven by `tianmen bench serve` in a subprocess. Run by
`python -m benchmarks.serving --profile`.

Per engine step: wall time of the forward pass, scheduling, input preparation, sampling, the update and output
delivery (step thread), and the event loop's detokenizing. Per request: the gateway's CPU time (thread CPU
clock) in TLS, JWT, JSON, SSE, audit, limiter, and its event loop's whole CPU time. Timers cost a little
themselves; compare profiles with each other, and throughput with benchmarks.serving.
"""

from __future__ import annotations

import argparse
import re
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Generator
from pathlib import Path
from typing import Any

from benchmarks.serving import demo_env
from engine.async_engine import AsyncEngine
from engine.kernels.select import GemmPlan
from engine.layers.attention import PagedAttention
from engine.layers.norm import RMSNorm
from engine.loop import EngineLoop
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.scheduler import Scheduler
from engine.step_thread import StepThread
from gateway import completion, routes
from gateway.audit_hook import AuditHook
from gateway.demo import DEMO_NAME
from gateway.metrics import Metrics
from gateway.server import Server, build_app_and_config, connection_limits
from gateway.settings import load_settings
from gateway.streaming import ResponseBuilder
from security.devpki import ensure_dev_pki, mint_token
from security.jwt import JWTVerifier
from security.ratelimit import RateLimiter

Clock = Callable[[], float]
STEP = "step: schedule + inputs + forward + sample + update"


class Timers:
    """Totals and call counts per key; wrappers replace methods on classes or modules for this process."""

    def __init__(self) -> None:
        self.total: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()

    def wrap(self, owner: Any, name: str, key: str, clock: Clock) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.total[key] += clock() - t
                self.calls[key] += 1

        setattr(owner, name, timed)

    def wrap_async(self, owner: Any, name: str, key: str) -> None:
        """A coroutine's own CPU time: the thread clock runs only while the coroutine itself runs, not while
        it waits (when other requests' work runs on the same thread)."""
        original = getattr(owner, name)
        timers = self

        class _Timed:
            def __init__(self, coro: Awaitable[Any]) -> None:
                self.coro = coro

            def __await__(self) -> Generator[Any, Any, Any]:
                gen = self.coro.__await__()
                value: Any = None
                exc: BaseException | None = None
                try:
                    while True:
                        t = time.thread_time()
                        try:
                            yielded = gen.throw(exc) if exc is not None else gen.send(value)
                        except StopIteration as stop:
                            return stop.value
                        finally:
                            timers.total[key] += time.thread_time() - t
                        exc = None
                        try:
                            value = yield yielded
                        except BaseException as e:  # thrown into us (cancellation): pass it on
                            exc = e
                finally:
                    timers.calls[key] += 1

        async def timed(*args: Any, **kwargs: Any) -> Any:
            return await _Timed(original(*args, **kwargs))

        setattr(owner, name, timed)


def instrument(t: Timers, engine: AsyncEngine) -> None:
    wall = time.perf_counter
    t.wrap(EngineLoop, "step_tokens", STEP, wall)
    t.wrap(Scheduler, "schedule", "  schedule", wall)
    t.wrap(ModelRunner, "_prepare", "  input preparation", wall)
    t.wrap(type(engine.core.runner.model), "forward", "  forward pass", wall)
    t.wrap(GemmPlan, "__call__", "    GEMMs (every linear layer, the LM head's too)", wall)
    t.wrap(PagedAttention, "forward", "    attention (cache write, decode and prefill)", wall)
    t.wrap(PagedAttention, "_decode", "      of which in place (decodes, short prompts)", wall)
    t.wrap(PagedAttention, "_prefill", "      of which prefill (SDPA)", wall)
    t.wrap(RMSNorm, "forward", "    add + RMSNorm", wall)
    t.wrap(type(engine.core.runner.model), "compute_logits", "  logits (lm head)", wall)
    t.wrap(ModelRunner, "_sample", "  sampling", wall)
    t.wrap(Scheduler, "update_from_output", "  update (stop checks, usage)", wall)
    t.wrap(AsyncEngine, "_deliver", "output hand-off to the event loop (step thread)", wall)
    cpu = time.thread_time
    t.wrap(AsyncEngine, "_receive", "outputs on the event loop (detokenize, stops, queues)", cpu)
    t.wrap(OutputProcessor, "process_one", "  of which detokenize + stop strings", cpu)
    for name in ("read", "write", "do_handshake"):
        t.wrap(ssl.SSLObject, name, "TLS (handshakes, record en/decryption)", cpu)
    t.wrap_async(JWTVerifier, "verify", "JWT verification")
    t.wrap(routes, "_parse", "JSON body parse + validation (worker thread)", cpu)
    t.wrap(routes, "_tokenize", "chat template + tokenize", cpu)
    for name in ("chunk", "usage_chunk"):
        t.wrap(ResponseBuilder, name, "SSE chunks (JSON encode)", cpu)
    t.wrap(completion, "merge", "SSE chunks (JSON encode)", cpu)
    t.wrap_async(RateLimiter, "admit", "rate limiter (admit, settle)")
    t.wrap_async(RateLimiter, "settle", "rate limiter (admit, settle)")
    t.wrap_async(AuditHook, "opened", "audit (record at start and at end)")
    t.wrap_async(AuditHook, "__call__", "audit (record at start and at end)")
    t.wrap(Metrics, "observe_request", "metrics", cpu)


def thread_cpu(thread: threading.Thread | StepThread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def load(url: str, token: str, ca: Path, args: argparse.Namespace, *count: str) -> int:
    cmd = [sys.executable, "-m", "gateway.cli", "bench", "serve", "--url", url, "--token", token, "--cacert", str(ca)]
    cmd += ["--model", DEMO_NAME, "--concurrency", str(args.concurrency), "--prompt-tokens", str(args.prompt_tokens)]
    cmd += ["--output-tokens", str(args.output_tokens), *count]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=Path(__file__).parent.parent).stdout
    m = re.search(r"^Requests\s+(\d+) completed", out, re.MULTILINE)
    print(out, flush=True)
    return int(m.group(1)) if m else 0


def profile(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="tianmen-profile-") as tmp:
        home = Path(tmp)
        settings = load_settings(environ=demo_env(home, args.port, args.concurrency))
        config, engine = build_app_and_config(settings)
        server = Server(config, None, connection_limits(settings))
        serving = threading.Thread(target=server.run, daemon=True)
        serving.start()
        while not server.started and serving.is_alive():
            time.sleep(0.1)
        pki = ensure_dev_pki(home)
        token = mint_token(pki.jwt_key, pki.kid, sub="bench", tenant="bench", ttl_s=24 * 3600)
        url = f"https://127.0.0.1:{args.port}"
        timers = Timers()
        instrument(timers, engine)
        try:
            load(url, token, pki.ca_cert, args, "--requests", str(args.concurrency))  # warm-up
            timers.reset()
            loop0, step0, cpu0, t0 = thread_cpu(serving), thread_cpu(engine._thread), time.process_time(), wall()
            requests = load(url, token, pki.ca_cert, args, "--duration", str(args.duration))
            loop_cpu, step_cpu = thread_cpu(serving) - loop0, thread_cpu(engine._thread) - step0
            cpu, elapsed = time.process_time() - cpu0, wall() - t0
        finally:
            server.should_exit = True
            serving.join(60)
    print(report(timers, max(requests, 1), loop_cpu, step_cpu, cpu, elapsed))


def wall() -> float:
    return time.perf_counter()


STAGES = (
    "  schedule",
    "  input preparation",
    "  forward pass",
    "  logits (lm head)",
    "  sampling",
    "  update (stop checks, usage)",
)
FORWARD_PARTS = (  # inside the forward pass (the GEMMs' row also counts the LM head's): not added to the rest
    "    GEMMs (every linear layer, the LM head's too)",
    "    attention (cache write, decode and prefill)",
    "      of which in place (decodes, short prompts)",
    "      of which prefill (SDPA)",
    "    add + RMSNorm",
)
HAND_OFF = "output hand-off to the event loop (step thread)"


def report(t: Timers, requests: int, loop_cpu: float, step_cpu: float, cpu: float, elapsed: float) -> str:
    steps = max(t.calls[STEP], 1)
    step_total = max(t.total[STEP], 1e-9)

    def row(name: str, seconds: float) -> str:
        return f"{name:<56}{seconds / steps * 1e3:>10.2f}{seconds / step_total * 100:>10.1f}%"

    lines = [f"\nPer engine step ({t.calls[STEP]} steps; wall time on the step thread)"]
    lines += [f"{'stage':<56}{'ms/step':>10}{'of step':>11}", row(STEP, t.total[STEP])]
    for k in STAGES:
        lines.append(row(k, t.total[k]))
        if k == "  forward pass":
            lines += [row(p, t.total[p]) for p in FORWARD_PARTS]
    lines.append(row("  the rest (Python between the stages)", max(t.total[STEP] - sum(t.total[k] for k in STAGES), 0)))
    lines.append(row(HAND_OFF, t.total[HAND_OFF]))
    lines.append(f"{'step thread CPU (its own; torch workers not counted)':<56}{step_cpu / steps * 1e3:>10.2f}")

    gateway = [k for k in t.total if k not in (STEP, HAND_OFF, *STAGES, *FORWARD_PARTS)]
    lines += ["", f"Per request ({requests} requests; CPU time of the thread that ran each stage)"]
    lines.append(f"{'stage':<56}{'us/request':>12}")
    lines += [f"{k:<56}{t.total[k] / requests * 1e6:>12.1f}" for k in sorted(gateway, key=lambda k: -t.total[k])]
    lines.append(f"{'event loop thread, all of its CPU':<56}{loop_cpu / requests * 1e6:>12.1f}")
    lines.append(f"{'whole process CPU (engine included)':<56}{cpu / requests * 1e6:>12.1f}")
    lines.append(f"over {elapsed:.1f} s: {requests / elapsed:.2f} req/s")
    return "\n".join(lines)
