"""The real gateway over a TP=2 engine (a worker process it starts itself): it serves, and when the worker is
killed the request under way fails with a clear error, /health fails, and nothing hangs."""

from __future__ import annotations

import ssl
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from security.tls import client_ssl_context
from tests.gateway_server import RunningGateway, run_gateway
from tests.tiny_model import build_tiny_chat_model

WAIT_S = 120  # a generous bound on waiting for what must happen: the test fails, never hangs


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


def _until(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def test_a_killed_worker_fails_the_request_and_health(model: Path, tmp_path: Path) -> None:
    env = {"TIANMEN_ENGINE_TENSOR_PARALLEL_SIZE": "2", "TIANMEN_ENGINE_MAX_MODEL_LEN": "512"}
    with run_gateway(tmp_path / "home", model, env) as gw:
        verify = client_ssl_context(gw.pki.ca_cert)
        client = openai.OpenAI(
            base_url=gw.url + "/v1", api_key=gw.token(), http_client=httpx.Client(verify=verify), max_retries=0
        )
        try:
            _serve_then_kill(gw, client, verify)
        finally:
            client.close()


def _serve_then_kill(gw: RunningGateway, client: openai.OpenAI, verify: ssl.SSLContext) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    served = client.chat.completions.create(model=gw.model, messages=messages, max_tokens=8)  # type: ignore[arg-type]
    assert served.usage is not None and served.usage.completion_tokens > 0
    admin = {"Authorization": f"Bearer {gw.token(sub='prom', scopes=['admin'])}"}
    with httpx.Client(base_url=gw.url, verify=verify, timeout=WAIT_S, headers=admin) as c:
        _until(lambda: 'rank="1"' in c.get("/metrics").text, "rank 1's figures reach /metrics")
        lines = c.get("/metrics").text.splitlines()
    for rank in ("0", "1"):
        for metric in ("tianmen:engine_steps_total", "tianmen:engine_comm_seconds_total"):
            line = next(x for x in lines if x.startswith(metric) and f'rank="{rank}"' in x)
            assert float(line.split()[-1]) > 0, line

    outcome: list[BaseException | object] = []

    def long_request() -> None:
        try:
            outcome.append(
                client.chat.completions.create(
                    model=gw.model,
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=480,
                    extra_body={"ignore_eos": True},
                    timeout=WAIT_S,
                )
            )
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=long_request)
    thread.start()
    engine = gw.engine
    _until(lambda: engine.stats()["num_running"] > 0, "the request runs")  # type: ignore[attr-defined]
    worker = engine.core.executor.procs[0]  # type: ignore[attr-defined]
    worker.kill()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the request under way hung"
    error = outcome[0]
    assert isinstance(error, openai.APIStatusError), error
    assert error.status_code == 503
    assert error.body["code"] == "engine_dead"  # type: ignore[index]
    assert "worker rank 1 exited" in error.message

    with httpx.Client(base_url=gw.url, verify=verify, timeout=WAIT_S) as c:
        assert c.get("/health").status_code == 503
        assert c.get("/ready").status_code == 503
    with pytest.raises(openai.APIStatusError) as later:
        client.chat.completions.create(model=gw.model, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert later.value.status_code == 503
