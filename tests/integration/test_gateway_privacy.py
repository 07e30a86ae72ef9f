"""The privacy policy through the real HTTPS gateway with the official openai client: block, mask, tokenize
(asserted on what the engine saw), completions masked and blocked as they stream, the term list reloaded under
load, and audit events in a real ES-API server that carry the policy hits but never the text."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from elasticsearch import Elasticsearch

from security.tls import client_ssl_context
from tests.es_server import EsServer
from tests.gateway_server import RunningGateway, run_gateway
from tests.tiny_model import build_tiny_chat_model

CARD = "6222021234567894"  # passes Luhn
ID18 = "11010519491231002X"  # GB 11643's example
CONFIG = """
[privacy]
term_lists = {{ sensitive = "{terms}" }}
terms_check_interval_s = 0.1

[privacy.default]
prompt = {{ bank_card = "mask", id_card = "tokenize", sensitive = "block" }}
completion = {{ bank_card = "mask" }}

[privacy.tenants.strict]
prompt = {{ bank_card = "block" }}
completion = {{ bank_card = "block" }}

[privacy.tenants.watch]
prompt = {{ "*" = "audit" }}
completion = {{ "*" = "audit" }}
"""


class EngineSpy:
    """Records the prompt each request hands the real engine, decoded: what the model saw."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.prompts = engine, []
        self._real = engine.generate_batches
        engine.generate_batches = self._generate

    def _generate(self, prompt: list[int], *args: Any, **kw: Any) -> Any:
        self.prompts.append(self.engine.tokenizer.decode(prompt))
        return self._real(prompt, *args, **kw)


def write_terms(path: Path, terms: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(terms) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: a reader never sees half a file


@pytest.fixture(scope="module")
def es(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EsServer]:
    with EsServer(tmp_path_factory.mktemp("es")) as server:
        yield server


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, es: EsServer) -> Iterator[tuple[RunningGateway, EngineSpy, Path]]:
    home = tmp_path_factory.mktemp("home")
    terms = home / "terms.txt"
    write_terms(terms, ["内部代号"])
    config = home / "tianmen.toml"
    config.write_text(CONFIG.format(terms=terms), encoding="utf-8")
    model = build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")
    env = {
        "TIANMEN_AUDIT_ELASTICSEARCH_URL": es.url,
        "TIANMEN_AUDIT_CONTENT_POLICY": "full",  # the stored content must be the masked content
        "TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE": "100000",
    }
    with run_gateway(home, model, env, config) as g:
        yield g, EngineSpy(g.engine), terms


@pytest.fixture
def gw(setup: tuple[RunningGateway, EngineSpy, Path]) -> RunningGateway:
    return setup[0]


@pytest.fixture
def spy(setup: tuple[RunningGateway, EngineSpy, Path]) -> EngineSpy:
    return setup[1]


OPEN: list[openai.OpenAI] = []


def client(gw: RunningGateway, tenant: str = "acme") -> openai.OpenAI:
    c = openai.OpenAI(
        base_url=gw.url + "/v1",
        api_key=gw.token(tenant=tenant),
        http_client=httpx.Client(verify=client_ssl_context(gw.pki.ca_cert)),
        max_retries=0,
    )
    OPEN.append(c)
    return c


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while OPEN:
        OPEN.pop().close()


def audit_events(es: EsServer, request_ids: list[str]) -> dict[str, dict]:
    """The closing (or only) record of each request, as Kibana shows it."""
    es_client = Elasticsearch(es.url)
    found: dict[str, dict] = {}
    try:
        for _ in range(200):  # the shipper bulk-indexes asynchronously
            es_client.indices.refresh(index="tianmen-audit-*")
            query = {
                "bool": {
                    "filter": [{"terms": {"event.id": request_ids}}],
                    "must_not": [{"term": {"tianmen.phase": "open"}}],
                }
            }
            hits = es_client.search(index="tianmen-audit-*", size=100, query=query)["hits"]["hits"]
            found = {h["_source"]["event"]["id"]: h["_source"] for h in hits}
            if len(found) == len(request_ids):
                break
            asyncio.run(asyncio.sleep(0.1))
    finally:
        es_client.close()
    return found


def zero_token(gw: RunningGateway) -> int:
    (token,) = gw.engine.tokenizer.encode("0", add_special_tokens=False)  # type: ignore[attr-defined]
    return int(token)


def zeros_body(gw: RunningGateway, n: int = 16) -> dict[str, Any]:
    """The tiny model forced to answer n zeros: "0000000000000000" passes Luhn, a card to the detector."""
    return {"max_tokens": n, "temperature": 0, "logit_bias": {str(zero_token(gw)): 100}, "ignore_eos": True}


def test_block_prompt_is_a_400_naming_the_policy_and_audited_without_the_text(
    gw: RunningGateway, spy: EngineSpy, es: EsServer
) -> None:
    c = client(gw, tenant="strict")
    seen = len(spy.prompts)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=gw.model, messages=[{"role": "user", "content": f"我的卡号是{CARD}，帮我查余额"}], max_tokens=4
        )
    err = e.value
    assert err.status_code == 400 and err.code == "content_policy_violation"
    assert "'bank_card'" in err.message and "block" in err.message and CARD not in err.message
    assert err.body["param"] == "messages.0.content"  # type: ignore[index]
    assert len(spy.prompts) == seen  # the model never saw it
    rid = err.response.headers["x-request-id"]
    ev = audit_events(es, [rid])[rid]
    assert ev["http"]["response"]["status_code"] == 400 and ev["error"]["type"] == "content_policy"
    assert ev["tianmen"]["policy"]["hits"] == [
        {"direction": "prompt", "policy": "bank_card", "action": "block", "count": 1}
    ]
    assert CARD not in json.dumps(ev, ensure_ascii=False)


def test_mask_and_tokenize_what_the_engine_sees_and_the_audit_keeps(
    gw: RunningGateway, spy: EngineSpy, es: EsServer
) -> None:
    c = client(gw)
    prompt = f"卡号：{CARD}；身份证：{ID18}；again {CARD[:4]} {CARD[4:8]} {CARD[8:12]} {CARD[12:]}"
    raw = c.chat.completions.with_raw_response.create(
        model=gw.model, messages=[{"role": "user", "content": prompt}], max_tokens=4, temperature=0
    )
    assert raw.http_response.status_code == 200
    saw = spy.prompts[-1]
    assert "卡号：622202******7894；身份证：[ID_1]；again 6222 02** **** 7894" in saw
    assert CARD not in saw and ID18 not in saw and "0212 3456" not in saw
    rid = raw.headers["x-request-id"]
    ev = audit_events(es, [rid])[rid]
    assert sorted(ev["tianmen"]["policy"]["hits"], key=lambda h: h["policy"]) == [
        {"direction": "prompt", "policy": "bank_card", "action": "mask", "count": 2},
        {"direction": "prompt", "policy": "id_card", "action": "tokenize", "count": 1},
    ]
    assert ev["tianmen"]["policy"]["fired"] == ["bank_card", "id_card"]
    stored = json.dumps(ev, ensure_ascii=False)
    assert "622202******7894" in ev["tianmen"]["prompt"]["text"] and "[ID_1]" in ev["tianmen"]["prompt"]["text"]
    assert CARD not in stored and ID18 not in stored


def test_term_list_blocks_through_spacing_and_width(gw: RunningGateway) -> None:
    c = client(gw)
    for text in ("这是内部代号", "这是内 部·代 号", "这是内部代号".replace("内", "内\u200b")):
        with pytest.raises(openai.BadRequestError, match="'sensitive'"):
            c.completions.create(model=gw.model, prompt=text, max_tokens=2)


def test_completion_is_masked_streamed_or_not_identically(gw: RunningGateway, es: EsServer) -> None:
    c = client(gw)
    msgs = [{"role": "user", "content": "count"}]
    extra = zeros_body(gw)
    raw = c.chat.completions.with_raw_response.create(
        model=gw.model,
        messages=msgs,
        max_tokens=16,
        temperature=0,
        logit_bias=extra["logit_bias"],
        extra_body={"ignore_eos": True},
    )
    body = raw.parse()
    assert body.choices[0].message.content == "000000******0000" and body.choices[0].finish_reason == "length"
    stream = c.chat.completions.create(
        model=gw.model,
        messages=msgs,
        max_tokens=16,
        temperature=0,
        logit_bias=extra["logit_bias"],
        extra_body={"ignore_eos": True},
        stream=True,
    )
    pieces = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert "".join(pieces) == "000000******0000"
    assert all("0000000" not in p for p in pieces)  # no piece carries the raw digits
    rid = raw.headers["x-request-id"]
    ev = audit_events(es, [rid])[rid]
    assert ev["tianmen"]["policy"]["hits"] == [
        {"direction": "completion", "policy": "bank_card", "action": "mask", "count": 1}
    ]
    assert ev["tianmen"]["response"]["text"] == "000000******0000"


def test_audit_only_changes_nothing_in_the_stream_and_counts(gw: RunningGateway, es: EsServer) -> None:
    c = client(gw, tenant="watch")
    extra = zeros_body(gw)
    raw = c.completions.with_raw_response.create(
        model=gw.model, prompt=f"卡号{CARD}", stream=True, extra_body={"ignore_eos": True}, **extra_args(extra)
    )
    texts = [ch.choices[0].text for ch in raw.parse() if ch.choices]
    assert "".join(texts) == "0" * 16  # counted, not changed (that nothing is held back: test_privacy_guard)
    rid = raw.headers["x-request-id"]
    ev = audit_events(es, [rid])[rid]
    assert sorted(ev["tianmen"]["policy"]["hits"], key=lambda h: h["direction"]) == [
        {"direction": "completion", "policy": "bank_card", "action": "audit", "count": 1},
        {"direction": "prompt", "policy": "bank_card", "action": "audit", "count": 1},
    ]


def test_completion_block_ends_the_stream_with_content_filter(gw: RunningGateway, es: EsServer) -> None:
    c = client(gw, tenant="strict")
    extra = zeros_body(gw)
    chunks = []
    with pytest.raises(openai.APIError) as e:
        for ch in c.completions.create(
            model=gw.model, prompt="count", stream=True, extra_body={"ignore_eos": True}, **extra_args(extra)
        ):
            chunks.append(ch)
    assert "'bank_card'" in e.value.message and "0000" not in e.value.message
    assert chunks[-1].choices[0].finish_reason == "content_filter"
    assert "".join(ch.choices[0].text for ch in chunks) == ""
    r = c.completions.with_raw_response.create(
        model=gw.model, prompt="count", extra_body={"ignore_eos": True}, **extra_args(extra)
    )
    done = r.parse()
    assert done.choices[0].finish_reason == "content_filter" and done.choices[0].text == ""
    assert done.usage is not None and done.usage.completion_tokens == 16  # the tokens still count
    rid = r.headers["x-request-id"]
    ev = audit_events(es, [rid])[rid]
    assert ev["tianmen"]["finish_reason"] == "content_filter" and ev["error"]["type"] == "content_policy"
    assert ev["tianmen"]["policy"]["hits"] == [
        {"direction": "completion", "policy": "bank_card", "action": "block", "count": 1}
    ]


def extra_args(extra: dict[str, Any]) -> dict[str, Any]:
    return {"max_tokens": extra["max_tokens"], "temperature": 0, "logit_bias": extra["logit_bias"]}


def test_logprobs_are_refused_where_a_completion_policy_rewrites(gw: RunningGateway) -> None:
    c = client(gw)
    with pytest.raises(openai.BadRequestError, match="logprobs") as e:
        c.chat.completions.create(
            model=gw.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True
        )
    assert e.value.body["param"] == "logprobs"  # type: ignore[index]


def test_term_list_reloads_under_load_without_a_failed_request(
    setup: tuple[RunningGateway, EngineSpy, Path],
) -> None:
    gw, _, terms = setup
    statuses: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def hammer() -> None:
        headers = {"Authorization": f"Bearer {gw.token()}"}
        body = {"model": gw.model, "prompt": "新 词 and more", "max_tokens": 2}
        with httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), timeout=60) as h:
            while not stop.is_set():
                try:
                    r = h.post("/v1/completions", json=body, headers=headers)
                    statuses.append(r.status_code)
                    if r.status_code == 400:
                        assert r.json()["error"]["code"] == "content_policy_violation"
                except BaseException as e:  # any failure is the test's failure
                    errors.append(e)
                    return

    probe_headers = {"Authorization": f"Bearer {gw.token()}"}
    probe = httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), timeout=60)

    def serving(blocked: bool) -> None:
        """Wait until the gateway answers as this version of the list says (the watcher polls every 0.1 s)."""
        body = {"model": gw.model, "prompt": "一个新　词", "max_tokens": 2}
        for _ in range(1200):
            if (probe.post("/v1/completions", json=body, headers=probe_headers).status_code == 400) == blocked:
                return
            asyncio.run(asyncio.sleep(0.05))
        raise AssertionError(f"the term list was not reloaded (blocked={blocked})")

    write_terms(terms, ["内部代号"])
    serving(blocked=False)
    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for round_ in range(4):  # rewrite the list while requests run: each version swaps in whole
            write_terms(terms, ["内部代号", *(["新词"] if round_ % 2 == 0 else []), f"词{round_}"])
            serving(blocked=round_ % 2 == 0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        probe.close()
    assert not errors and statuses and set(statuses) <= {200, 400}  # no request failed while lists swapped


# ---- tokenize end to end: a real model that repeats what it is given -------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningGateway, EngineSpy]]:
    home = tmp_path_factory.mktemp("demo-home")
    config = home / "tianmen.toml"
    config.write_text('[privacy.default]\nprompt = { bank_card = "tokenize" }\n', encoding="utf-8")
    with run_gateway(home, None, None, config) as g:  # the embedded default: SmolLM2-135M-Instruct
        yield g, EngineSpy(g.engine)


def test_tokenize_the_model_sees_placeholders_the_client_gets_the_original(
    demo: tuple[RunningGateway, EngineSpy],
) -> None:
    gw, spy = demo
    c = client(gw)
    msgs = [{"role": "user", "content": f"Repeat this exactly: my card number is {CARD}"}]
    r = c.chat.completions.create(model=gw.model, messages=msgs, max_tokens=24, temperature=0)
    assert "[CARD_1]" in spy.prompts[-1] and CARD not in spy.prompts[-1]
    assert CARD in (r.choices[0].message.content or "") and "[CARD_1]" not in (r.choices[0].message.content or "")
    stream = c.chat.completions.create(model=gw.model, messages=msgs, max_tokens=24, temperature=0, stream=True)
    pieces = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert "".join(pieces) == r.choices[0].message.content  # the placeholder, split over tokens, restored whole
