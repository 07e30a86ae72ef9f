"""Two models behind one real gateway (TLS, JWT, the official openai client): routing, parity with transformers,
per-token model lists, 403s, per-model limits, the audit trail's model, warm-up, and start-up refusals."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from audit import search
from audit.source import SpoolSource
from gateway.cli import main as cli
from gateway.server import StartupError, build_app_and_config
from gateway.settings import WarmupPrompt, load_settings
from gateway.warmup import prefix_ids
from security.tls import client_ssl_context
from tests.gateway_server import RunningGateway, run_gateway
from tests.parity.conftest import hf_greedy
from tests.tiny_model import build_tiny_chat_model

SYSTEM = (
    "You are the assistant of the ACME bank. Answer briefly and politely. Never give investment advice. "
    "Quote the capital of France when asked: Paris."
)
BLOCK = 16


def config(path: Path, alpha: Path, beta: Path, extra: str = "") -> Path:
    path.write_text(
        f"""
[engine]
block_size = {BLOCK}
max_model_len = 512

[[models]]
name = "alpha"
path = "{alpha}"
warmup_tenants = ["acme"]
warmup_prompts = [{SYSTEM!r}]

[[models]]
name = "beta"
path = "{beta}"
[models.ratelimit]
requests_per_minute = 3

[aliases]
chat = "alpha"
{extra}"""
    )
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return build_tiny_chat_model(root / "alpha", seed=0), build_tiny_chat_model(root / "beta", seed=1, tied=False)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, dirs: tuple[Path, Path]) -> Iterator[RunningGateway]:
    home = tmp_path_factory.mktemp("home")
    with run_gateway(home, None, config=config(home / "tianmen.toml", *dirs)) as g:
        yield g


def client(gw: RunningGateway, **claims: object) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gw.url + "/v1",
        api_key=gw.token(**claims),  # type: ignore[arg-type]
        http_client=httpx.Client(verify=client_ssl_context(gw.pki.ca_cert)),
        max_retries=0,
    )


def chat(c: openai.OpenAI, model: str, user: str, **kw: object) -> openai.types.chat.ChatCompletion:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return c.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0, **kw)  # type: ignore[call-overload]


def cached(r: openai.types.chat.ChatCompletion) -> int:
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return int(r.usage.prompt_tokens_details.cached_tokens or 0)


# ---- warm-up: these run first, before any other request could have cached the system prompt -----------------
def test_the_first_request_sharing_a_warmed_prefix_hits_it_under_its_tenant_only(gw: RunningGateway) -> None:
    alpha = gw.models.resolve("alpha").engine  # type: ignore[union-attr]
    full_blocks = len(prefix_ids(alpha.tokenizer, WarmupPrompt(["acme"], system=SYSTEM))) // BLOCK * BLOCK
    assert full_blocks >= 2 * BLOCK
    assert alpha.stats()["prefix_cache_pinned_tokens"] == full_blocks
    assert gw.models.resolve("beta").engine.stats()["kv_blocks_pinned"] == 0  # type: ignore[union-attr]
    with client(gw, tenant="acme") as c:
        assert cached(chat(c, "alpha", "Where is Paris?")) >= full_blocks
    with client(gw, sub="bob", tenant="globex") as c:
        assert cached(chat(c, "alpha", "Where is Paris?")) == 0  # the warm-up was for acme
    with client(gw, tenant="acme") as c:
        assert cached(chat(c, "beta", "Where is Paris?")) == 0  # and for alpha: beta has its own cache


# ---- routing -------------------------------------------------------------------------------------------------
def test_each_model_answers_with_its_own_greedy_tokens(gw: RunningGateway, dirs: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = gw.models.resolve("alpha").engine.tokenizer  # type: ignore[union-attr]
    prompt = tokenizer.encode("The capital of France is")
    texts = {}
    with client(gw) as c:
        for name, path in zip(("alpha", "beta"), dirs):
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            expected = tokenizer.decode(hf_greedy(hf, prompt, 8))
            r = c.completions.create(
                model=name, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            assert r.model == name and r.choices[0].text == expected
            texts[name] = expected
        assert texts["alpha"] != texts["beta"]  # the two are told apart: routing is visible
        r = c.completions.create(
            model="chat", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.model == "alpha" and r.choices[0].text == texts["alpha"]  # the alias serves its model


def test_models_are_listed_and_allowed_per_token(gw: RunningGateway) -> None:
    with client(gw) as c:
        assert [m.id for m in c.models.list().data] == ["alpha", "beta", "chat"]
    with client(gw, models=["beta"]) as c:
        assert [m.id for m in c.models.list().data] == ["beta"]
        assert chat(c, "beta", "hi").model == "beta"
        for name in ("alpha", "chat"):  # the alias names alpha: no way around the claim
            with pytest.raises(openai.PermissionDeniedError) as e:
                chat(c, name, "hi")
            assert e.value.status_code == 403 and e.value.code == "model_not_allowed"
        with pytest.raises(openai.NotFoundError):
            chat(c, "gamma", "hi")
    with client(gw, models=["chat"]) as c:  # a token naming the alias may use the model it names
        listed = c.models.list().data
        assert [m.id for m in listed] == ["alpha", "chat"] and listed[1].alias_of == "alpha"  # type: ignore[attr-defined]
        assert chat(c, "alpha", "hi").model == "alpha"
        with pytest.raises(openai.PermissionDeniedError):
            chat(c, "beta", "hi")


def test_ready_lists_every_model(gw: RunningGateway) -> None:
    r = httpx.get(gw.url + "/ready", verify=client_ssl_context(gw.pki.ca_cert))
    assert r.status_code == 200 and r.json() == {"status": "ready", "models": ["alpha", "beta"]}


def test_the_audit_trail_names_the_model_that_served(gw: RunningGateway) -> None:
    ids = {}
    with client(gw, sub="auditee") as c:
        for name in ("alpha", "beta", "chat"):
            raw = c.chat.completions.with_raw_response.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            ids[name] = raw.headers["x-request-id"]
    spool = SpoolSource(gw.settings.audit.spool_dir)  # type: ignore[arg-type]
    events = asyncio.run(search(spool, user="auditee", limit=100))
    model_of = {e["event"]["id"]: e["tianmen"]["model"] for e in events}
    assert model_of[ids["alpha"]] == "alpha" and model_of[ids["beta"]] == "beta"
    assert model_of[ids["chat"]] == "alpha"  # the alias resolved: the event names the served model
    assert {e["event"]["id"] for e in asyncio.run(search(spool, model="beta", limit=1000))} >= {ids["beta"]}


def test_limits_configured_for_a_model_are_counted_for_it_alone(gw: RunningGateway) -> None:
    with client(gw, sub="carol") as c:
        for _ in range(3):
            chat(c, "beta", "hi")
        with pytest.raises(openai.RateLimitError) as e:
            chat(c, "beta", "hi")
        assert "on this model" in e.value.message and e.value.response.headers["retry-after"]
        chat(c, "alpha", "hi")  # the same user on another model: not counted against beta's limit
    with client(gw, sub="dave") as c:
        chat(c, "beta", "hi")  # another user has his own


def test_metrics_and_the_profiler_know_every_model(gw: RunningGateway) -> None:
    admin = {"Authorization": f"Bearer {gw.token(sub='ops', scopes=['admin'])}"}
    with httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), timeout=60) as c:
        text = c.get("/metrics", headers=admin).text
        pinned = {
            line.split('"')[1]: float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("tianmen:kv_cache_pinned_blocks{")
        }
        assert pinned["alpha"] >= 2 and pinned["beta"] == 0
        assert c.post("/admin/profile", json={"steps": 1, "model": "chat"}, headers=admin).json()["model"] == "alpha"
        r = c.post("/admin/profile", json={"steps": 1, "model": "gamma"}, headers=admin)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert c.post("/admin/profile", json={"steps": 1, "model": ["beta"]}, headers=admin).status_code == 400
    with client(gw) as oc:
        chat(oc, "alpha", "hi")  # one step of alpha's ends its trace


# ---- start-up -------------------------------------------------------------------------------------------------
def engine_threads() -> int:
    return sum(t.name == "tianmen-engine" and t.is_alive() for t in threading.enumerate())


def test_start_up_refuses_models_that_do_not_fit_naming_them(
    tmp_path: Path, dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    f = config(tmp_path / "t.toml", *dirs)
    f.write_text(f'home = "{tmp_path / "home"}"\n' + f.read_text())
    before = engine_threads()
    monkeypatch.setenv("TIANMEN_SERVER_MAX_MODEL_MEMORY_BYTES", str(1 << 20))
    monkeypatch.setenv("TIANMEN_SERVER_PORT", "1")  # never reached: it refuses before listening
    assert cli(["serve", "--config", str(f)]) == 1
    err = capsys.readouterr().err
    assert "do not fit in cpu memory" in err and "alpha:" in err and "beta:" in err and "KV cache" in err
    assert "server.max_model_memory_bytes" in err and engine_threads() == before  # nothing was loaded


def test_a_model_that_fails_to_load_stops_the_start_naming_it(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(dirs[1], broken)
    (broken / "model.safetensors").unlink()
    settings = load_settings(config(tmp_path / "t.toml", dirs[0], broken), environ={"TIANMEN_HOME": str(tmp_path)})
    before = engine_threads()
    with pytest.raises(StartupError, match=r"model 'beta': .*safetensors"):
        build_app_and_config(settings)
    assert engine_threads() == before  # alpha, loaded first, was stopped again: no partial server


def test_a_warm_up_that_cannot_fit_stops_the_start(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    settings = load_settings(
        config(tmp_path / "t.toml", *dirs),
        environ={"TIANMEN_HOME": str(tmp_path), "TIANMEN_ENGINE_MAX_MODEL_LEN": "32"},
    )
    with pytest.raises(StartupError, match=r"model 'alpha': warmup_prompts\[0\].*context length"):
        build_app_and_config(settings)
