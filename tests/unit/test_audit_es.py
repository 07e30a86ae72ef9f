from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from elastic_transport import ApiResponseMeta, HttpHeaders, NodeConfig
from elasticsearch import BadRequestError

from audit.config import AuditConfig
from audit.es import index_name, install_index_setup
from audit.template import POLICY_NAME, TEMPLATE_NAME, TEMPLATE_VERSION, ilm_policy, index_template


def meta(status: int) -> ApiResponseMeta:
    return ApiResponseMeta(status, "1.1", HttpHeaders(), 0.0, NodeConfig("http", "localhost", 9200))


@dataclass
class Resp:
    status: int
    body: dict[str, Any]

    @property
    def meta(self) -> ApiResponseMeta:
        return meta(self.status)


@dataclass
class FakeES:
    """The calls `install_index_setup` makes (client.ilm.*, client.indices.*); records every PUT."""

    has_ilm: bool = True
    policy: dict[str, Any] | None = None
    template: dict[str, Any] | None = None
    puts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def options(self, **_: Any) -> FakeES:
        return self

    @property
    def ilm(self) -> FakeES:
        return self

    @property
    def indices(self) -> FakeES:
        return self

    async def get_lifecycle(self, name: str) -> Resp:
        if not self.has_ilm:
            raise BadRequestError("no handler found for uri [/_ilm/policy]", meta(400), {})
        return Resp(200, {name: self.policy}) if self.policy else Resp(404, {})

    async def put_lifecycle(self, name: str, **body: Any) -> None:
        self.puts[name] = body

    async def get_index_template(self, name: str) -> Resp:
        if self.template is None:
            return Resp(404, {})
        return Resp(200, {"index_templates": [{"name": name, "index_template": self.template}]})

    async def put_index_template(self, name: str, **body: Any) -> None:
        self.puts[name] = body


def config(tmp_path: Path, days: int = 180) -> AuditConfig:
    return AuditConfig(spool_dir=tmp_path, elasticsearch_url="http://es:9200", retention_days=days)


async def test_fresh_cluster_gets_policy_and_template_with_lifecycle(tmp_path: Path) -> None:
    es = FakeES()
    assert await install_index_setup(es, config(tmp_path)) is True  # type: ignore[arg-type]
    assert es.puts[POLICY_NAME] == ilm_policy(180)
    settings = es.puts[TEMPLATE_NAME]["template"]["settings"]
    assert settings["index.lifecycle.name"] == POLICY_NAME
    assert settings["index.lifecycle.parse_origination_date"] is True


async def test_current_setup_is_left_alone_and_a_changed_retention_is_updated(tmp_path: Path) -> None:
    template = index_template("tianmen-audit", lifecycle=POLICY_NAME)
    es = FakeES(policy=ilm_policy(180), template=template)
    await install_index_setup(es, config(tmp_path))  # type: ignore[arg-type]
    assert es.puts == {}
    await install_index_setup(es, config(tmp_path, days=365))  # type: ignore[arg-type]
    assert list(es.puts) == [POLICY_NAME]
    assert es.puts[POLICY_NAME]["policy"]["phases"]["delete"]["min_age"] == "365d"
    es = FakeES(policy=ilm_policy(180), template={**template, "version": TEMPLATE_VERSION - 1})
    await install_index_setup(es, config(tmp_path))  # type: ignore[arg-type]
    assert list(es.puts) == [TEMPLATE_NAME]


async def test_without_ilm_the_template_goes_in_without_lifecycle(tmp_path: Path) -> None:
    es = FakeES(has_ilm=False)
    assert await install_index_setup(es, config(tmp_path)) is False  # type: ignore[arg-type]
    assert list(es.puts) == [TEMPLATE_NAME]
    assert not any(k.startswith("index.lifecycle") for k in es.puts[TEMPLATE_NAME]["template"]["settings"])


@pytest.mark.parametrize("ts", ["2026-03-01T23:59:59.999Z", "2026-03-02T07:59:59+08:00"])
def test_index_is_the_utc_day_of_the_event(ts: str) -> None:
    assert index_name("tianmen-audit", ts) == "tianmen-audit-2026.03.01"
