"""Prometheus metrics, named like vLLM's (vllm:* → tianmen:*) so existing dashboards port over."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.state import RequestState

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _StatsCollector(Collector):
    """Engine and audit gauges read at scrape time, so the step loop never touches Prometheus."""

    def __init__(
        self,
        engine_stats: Mapping[str, Callable[[], dict[str, Any]]],
        audit_stats: Callable[[], dict[str, Any]] | None,
    ) -> None:
        self.engine_stats, self.audit_stats = engine_stats, audit_stats

    def collect(self):  # type: ignore[no-untyped-def]
        stats = {model: read() for model, read in self.engine_stats.items()}
        for name, key, doc in (
            ("tianmen:num_requests_running", "num_running", "Requests in the running batch."),
            ("tianmen:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
            ("tianmen:kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use (0-1)."),
            ("tianmen:kv_cache_pinned_blocks", "kv_blocks_pinned", "KV-cache blocks pinned by warm-up prompts."),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model"])
            for model, s in stats.items():
                g.add_metric([model], float(s[key]))
            yield g
        for name, key, doc in (
            ("tianmen:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("tianmen:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            ("tianmen:num_preemptions", "preemptions_total", "Requests preempted (recomputed) for lack of KV blocks."),
        ):
            c = CounterMetricFamily(name, doc, labels=["model"])
            for model, s in stats.items():
                c.add_metric([model], float(s[key]))
            yield c
        yield from _rank_metrics({model: s.get("ranks") or [] for model, s in stats.items()})
        if self.audit_stats is not None:
            a = self.audit_stats()
            for name, key, doc in (
                ("tianmen:audit_spool_bytes", "spool_bytes", "Bytes in the local audit spool."),
                ("tianmen:audit_unshipped_events", "unshipped_events", "Audit events not yet in Elasticsearch."),
            ):
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], float(a.get(key) or 0))
                yield g
            lag = GaugeMetricFamily("tianmen:audit_shipping_lag_seconds", "Seconds since the last successful ship.")
            last = a.get("last_ship_time")
            lag.add_metric([], time.time() - float(last) if isinstance(last, (int, float)) else float("nan"))
            yield lag


def _rank_metrics(ranks_by_model: Mapping[str, list[dict[str, Any]]]):  # type: ignore[no-untyped-def]
    """Per engine rank (tensor-parallel rank, data-parallel replica): steps, and seconds stepping and in
    collectives; a worker's figures are at most a second old, and absent until its first step."""
    labels = ["model", "replica", "rank"]
    for name, key, doc in (
        ("tianmen:engine_steps", "steps", "Model steps run by this rank."),
        ("tianmen:engine_step_seconds", "step_seconds", "Seconds this rank spent in model steps."),
        ("tianmen:engine_comm_seconds", "comm_seconds", "Seconds of those in tensor-parallel collectives."),
    ):
        c = CounterMetricFamily(name, doc, labels=labels)
        for model, ranks in ranks_by_model.items():
            for r in ranks:
                if key in r:
                    c.add_metric([model, str(r.get("replica", 0)), str(r["rank"])], float(r[key]))
        yield c


class Metrics:
    def __init__(
        self,
        engine_stats: Mapping[str, Callable[[], dict[str, Any]]],
        audit_stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """`engine_stats`: each served model's engine.stats."""
        self.registry = r = CollectorRegistry()
        labels = ["model", "tenant"]
        self.ttft = Histogram(
            "tianmen:time_to_first_token_seconds", "Time to first token.", labels, buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "tianmen:inter_token_latency_seconds",
            "Time between output tokens.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tianmen:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("tianmen:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("tianmen:generation_tokens", "Tokens generated.", labels, registry=r)
        self.http_requests = Counter("tianmen:http_requests", "HTTP requests by status.", ["status"], registry=r)
        self.auth_failures = Counter("tianmen:auth_failures", "Refused credentials by reason.", ["reason"], registry=r)
        self.ratelimit_refusals = Counter("tianmen:ratelimit_refusals", "429s by limit.", ["limit"], registry=r)
        r.register(_StatsCollector(engine_stats, audit_stats))
        self._children: dict[tuple[str, str], tuple[Any, ...]] = {}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_request(self, state: RequestState) -> None:
        """Called once per finished request with its record."""
        self.http_requests.labels(str(state.status)).inc()
        if state.auth_failure is not None:
            self.auth_failures.labels(state.auth_failure).inc()
        decision = state.ratelimit or ""
        if decision.startswith("refused:"):
            self.ratelimit_refusals.labels(decision.split(":")[1]).inc()
        model, tenant = state.model, state.tenant
        if model is None or tenant is None or state.ttft_ms is None:
            return
        children = self._children.get((model, tenant))
        if children is None:  # labels() costs a lock and a tuple key per metric: once per (model, tenant)
            per_model = (self.prompt_tokens, self.generation_tokens, self.ttft, self.e2e, self.itl)
            children = self._children[(model, tenant)] = tuple(m.labels(model, tenant) for m in per_model)
        prompt, generated, ttft, e2e, itl = children
        prompt.inc(state.prompt_tokens or 0)
        generated.inc(state.completion_tokens or 0)
        ttft.observe(state.ttft_ms / 1e3)
        e2e.observe(state.duration_s)
        for gap in state.itl_s:
            itl.observe(gap)
