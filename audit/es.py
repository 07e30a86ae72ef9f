"""Elasticsearch connection: the async client, dated index names, template + ILM installation."""

from __future__ import annotations

import importlib.util
import logging
from datetime import datetime, timezone
from typing import Any

from elasticsearch import ApiError, AsyncElasticsearch

from audit.config import AuditConfig
from audit.template import POLICY_NAME, TEMPLATE_NAME, TEMPLATE_VERSION, ilm_policy, index_template

log = logging.getLogger("tianmen.audit")


def make_client(config: AuditConfig) -> AsyncElasticsearch:
    """The official async client; retries are the shipper's job, so the client does none."""
    assert config.elasticsearch_url, "no elasticsearch_url configured"
    kwargs: dict[str, Any] = {"request_timeout": 30, "max_retries": 0, "retry_on_timeout": False}
    kwargs["node_class"] = config.es_node_class or _installed_node_class()
    if config.es_api_key:
        kwargs["api_key"] = config.es_api_key
    elif config.es_username and config.es_password:
        kwargs["basic_auth"] = (config.es_username, config.es_password)
    if config.es_ca_certs:
        kwargs["ca_certs"] = str(config.es_ca_certs)
    return AsyncElasticsearch(config.elasticsearch_url, **kwargs)


def _installed_node_class() -> str:
    if importlib.util.find_spec("aiohttp"):
        return "aiohttp"
    if importlib.util.find_spec("httpx"):
        return "httpxasync"
    raise RuntimeError("the async Elasticsearch client needs aiohttp: pip install 'elasticsearch[async]'")


def index_name(prefix: str, timestamp: str) -> str:
    """`<prefix>-YYYY.MM.DD` from an ISO `@timestamp` (UTC); today's index if it does not parse."""
    try:
        day = datetime.fromisoformat(timestamp.replace("Z", "+00:00")).astimezone(timezone.utc)
    except (AttributeError, ValueError):
        day = datetime.now(timezone.utc)
    return f"{prefix}-{day:%Y.%m.%d}"


async def install_index_setup(client: AsyncElasticsearch, config: AuditConfig, *, quiet: bool = False) -> bool:
    """Put the ILM policy and index template when missing or older; False when ILM is unavailable.

    Connection errors propagate (the shipper retries); refusals (no ILM, no permission) are logged
    unless `quiet`, and shipping goes on."""
    ilm = await _ensure_policy(client, config.retention_days, quiet)
    try:
        current = await client.options(ignore_status=404).indices.get_index_template(name=TEMPLATE_NAME)
        templates = current.body.get("index_templates", []) if current.meta.status == 200 else []
        version = templates[0]["index_template"].get("version", 0) if templates else None
        if version is None or version < TEMPLATE_VERSION:
            body = index_template(config.index_prefix, lifecycle=POLICY_NAME if ilm else None)
            await client.indices.put_index_template(name=TEMPLATE_NAME, **body)
            log.info("installed index template %s (version %d)", TEMPLATE_NAME, TEMPLATE_VERSION)
    except ApiError as e:
        if not quiet:
            log.error("cannot install index template %s (HTTP %s); indexing without it", TEMPLATE_NAME, e.meta.status)
    return ilm


async def _ensure_policy(client: AsyncElasticsearch, retention_days: int, quiet: bool) -> bool:
    try:
        got = await client.options(ignore_status=404).ilm.get_lifecycle(name=POLICY_NAME)
        want = ilm_policy(retention_days)
        have = got.body.get(POLICY_NAME, {}).get("policy", {}) if got.meta.status == 200 else None
        if have is None or have.get("phases", {}).get("delete") != want["policy"]["phases"]["delete"]:
            await client.ilm.put_lifecycle(name=POLICY_NAME, **want)
            log.info("installed ILM policy %s (delete after %d days)", POLICY_NAME, retention_days)
        return True
    except ApiError as e:
        if not quiet:
            log.warning(
                "Elasticsearch has no usable ILM (HTTP %s: %s); audit indices will not expire on their own",
                e.meta.status,
                e.message,
            )
        return False
