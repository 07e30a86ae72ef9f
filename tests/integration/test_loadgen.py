"""`tianmen bench serve` against the real gateway (uvicorn + TLS 1.3 + JWT + engine on a tiny model)."""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.loadgen import LoadReport, _one, add_parser, histogram, main, percentile, run_load
from security.tls import client_ssl_context
from tests.gateway_server import RunningGateway, free_port, run_gateway
from tests.tiny_model import build_tiny_chat_model

ROW = r"^{}\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    model = build_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat")
    with run_gateway(tmp_path_factory.mktemp("home"), model) as g:
        yield g


async def load(gw: RunningGateway, token: str | None = None, **kw: object) -> LoadReport:
    args: dict[str, object] = dict(
        concurrency=4, prompt_tokens=16, output_tokens=8, duration_s=None, num_requests=12, ca_file=gw.pki.ca_cert
    )
    args.update(kw)
    return await run_load(gw.url, token or gw.token(sub="bench"), gw.model, **args)  # type: ignore[arg-type]


def latency_rows(text: str) -> dict[str, list[float]]:
    rows = {}
    for name in ("TTFT", "TPOT", "ITL", "E2E"):
        m = re.search(ROW.format(name), text, re.MULTILINE)
        assert m, f"no {name} row in\n{text}"
        rows[name] = [float(x) for x in m.groups()]
    return rows


async def test_every_request_is_timed_token_by_token(gw: RunningGateway) -> None:
    report = await load(gw)
    assert len(report.results) == 12 and len(report.completed) == 12 and report.errors == {}
    for r in report.results:
        assert r.status == 200 and r.output_tokens == 8 and r.prompt_tokens > 16
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) == 7 and all(g >= 0 for g in r.itl_s)
        assert sum(r.itl_s) <= r.e2e_s - r.ttft_s + 1e-6  # the gaps lie between the first and the last token
        assert r.tpot_s is not None and r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 7)
    text = report.format()
    assert "12 completed, 0 failed" in text and "Errors" not in text
    rows = latency_rows(text)
    mean, p50, p90, p99 = rows["E2E"]
    assert p50 <= p90 <= p99 and p99 <= max(r.e2e_s for r in report.results) * 1e3 + 0.01
    assert mean == pytest.approx(sum(r.e2e_s for r in report.results) / 12 * 1e3, abs=0.01)
    assert rows["TTFT"][3] <= p99 + 0.01
    bars = [line for line in text.splitlines() if re.match(r"^\s+\d+\.\d+ - +\d+\.\d+ \| #* +\d+$", line)]
    assert 1 <= len(bars) <= 10 and sum(int(b.split()[-1]) for b in bars) == 12
    assert "E2E latency histogram (ms), 12 requests" in text


async def test_chunk_timing_without_logprobs(gw: RunningGateway) -> None:
    report = await load(gw, num_requests=4, logprobs=False)
    assert len(report.completed) == 4
    for r in report.completed:
        # a chunk may hold several tokens (a character split across tokens is sent whole), never fewer than one
        assert r.output_tokens == 8 and r.ttft_s is not None and r.ttft_s <= r.e2e_s and len(r.itl_s) <= 7


async def test_duration_bounds_the_run(gw: RunningGateway) -> None:
    report = await load(gw, concurrency=2, num_requests=None, duration_s=0.5, output_tokens=4)
    assert len(report.completed) >= 2 and report.errors == {}
    # requests already sent finish; none starts after the deadline
    assert report.duration_s < 0.5 + max(r.e2e_s for r in report.results) + 0.5


async def test_a_bad_token_is_reported_not_raised(gw: RunningGateway) -> None:
    report = await load(gw, token="not-a-jwt", num_requests=10, concurrency=2)
    # both workers sent one request before the first 401 came back; then nothing more is sent
    assert report.completed == [] and report.errors == {"401": 2}
    assert all(r.status == 401 and r.detail for r in report.results)
    text = report.format()
    assert "0 completed, 2 failed" in text and re.search(r"^  401 x2: .+", text, re.MULTILINE)
    assert "Stopped early: the server answered 401" in text and "No request completed" in text


async def test_a_wrong_model_stops_a_timed_run(gw: RunningGateway) -> None:
    report = await run_load(
        gw.url,
        gw.token(sub="bench"),
        "no-such-model",
        concurrency=1,
        prompt_tokens=4,
        output_tokens=4,
        duration_s=30.0,
        num_requests=None,
        ca_file=gw.pki.ca_cert,
    )
    assert report.errors == {"404": 1} and report.duration_s < 5 and report.stopped


async def test_an_unreachable_server_is_reported_not_raised(gw: RunningGateway) -> None:
    url = f"https://127.0.0.1:{free_port()}"
    report = await run_load(
        url,
        "t",
        "m",
        concurrency=2,
        prompt_tokens=4,
        output_tokens=4,
        duration_s=None,
        num_requests=4,
        ca_file=gw.pki.ca_cert,
    )
    assert report.errors == {"ConnectError": 4} and all(r.status is None for r in report.results)
    assert "ConnectError x4" in report.format()


def test_bench_serve_cli_with_defaults_from_settings(
    gw: RunningGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tianmen.toml"
    config.write_text(f'home = "{gw.settings.home}"\n\n[server]\nport = {gw.port}\n')
    ap = argparse.ArgumentParser(prog="tianmen")
    add_parser(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(
        ["bench", "serve", "--config", str(config), "--requests", "4", "--concurrency", "2"]
        + ["--prompt-tokens", "8", "--output-tokens", "4", "--profile-steps", "2"]
    )
    assert args.func(args) == 0  # token minted from the dev PKI, model from /v1/models, CA from the home
    out = capsys.readouterr().out
    assert "4 completed, 0 failed" in out and f"model {gw.model}" in out
    latency_rows(out)
    trace = re.search(r"profiling the next 2 engine steps; Chrome trace: (\S+)", out)
    assert trace, out
    path = Path(trace.group(1))
    assert path.parent == gw.settings.home / "profiles"
    for _ in range(100):  # written by the engine thread once the 2 steps are done
        if path.exists():
            break
        time.sleep(0.05)
    assert path.exists() and b"traceEvents" in path.read_bytes()


def test_bench_serve_cli_without_a_dev_pki(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tianmen.toml"
    config.write_text(f'home = "{tmp_path / "empty"}"\n')
    ap = argparse.ArgumentParser(prog="tianmen")
    add_parser(ap.add_subparsers(dest="command", required=True))
    assert main(ap.parse_args(["bench", "serve", "--config", str(config), "--requests", "1"])) == 2
    assert "pass --token" in capsys.readouterr().err
    assert not (tmp_path / "empty").exists()  # no stray PKI that the server would not trust


def test_percentile_and_histogram() -> None:
    v = [0.001 * i for i in range(1, 101)]
    assert percentile(v, 50) == pytest.approx(0.0505) and percentile(v, 99) == pytest.approx(0.09901)
    assert percentile([2.0], 90) == 2.0
    bars = histogram(v)
    assert len(bars) == 10 and [int(b.split()[-1]) for b in bars] == [10] * 10
    assert histogram([0.5, 0.5]) == [f"  {500.0:>9.1f} - {500.0:>9.1f} | {'#' * 40} 2"]


async def test_a_stream_read_to_its_end_keeps_its_connection(gw: RunningGateway) -> None:
    opened: list[str] = []

    async def trace(name: str, info: dict[str, object]) -> None:
        if name == "connection.connect_tcp.complete":
            opened.append(name)

    async def hook(request: httpx.Request) -> None:
        request.extensions["trace"] = trace

    body = {
        "model": gw.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {gw.token(sub='bench')}"}
    verify = client_ssl_context(gw.pki.ca_cert)
    async with httpx.AsyncClient(verify=verify, event_hooks={"request": [hook]}) as client:
        results = [await _one(client, gw.url + "/v1/chat/completions", headers, body) for _ in range(3)]
    assert [(r.ok, r.output_tokens) for r in results] == [(True, 3)] * 3
    assert len(opened) == 1  # one TCP + TLS handshake for the three requests
