"""The compose stack's one-shot setup job: Elasticsearch users and roles, the audit index template and ILM
policy from deploy/elasticsearch/, and deploy/kibana/saved-objects.ndjson imported through Kibana's API.

Idempotent: every step checks or overwrites, so it runs again after an upgrade or a volume reset.
Standard library only, so it runs on a stock python image:

    python setup.py --elasticsearch http://elasticsearch:9200 --kibana http://kibana:5601 --secrets /run/secrets
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

TEMPLATE_NAME = "tianmen-audit"  # as audit/template.py names them, so the gateway sees its own template
POLICY_NAME = "tianmen-audit-retention"
WRITER_ROLE = "tianmen_audit_writer"
# create_doc: op_type=create only, so the gateway can add events but never overwrite one
WRITER_INDEX_PRIVILEGES = ["create_doc", "create_index", "read", "view_index_metadata"]
WRITER_CLUSTER_PRIVILEGES = ["manage_index_templates", "manage_ilm"]
KIBANA_READY = ("available", "degraded")  # degraded: a plugin is unhappy, saved objects still import


class SetupError(RuntimeError):
    """A step failed; the message names it and what the server answered."""


class Unreachable(SetupError):
    """No HTTP answer (connection refused, DNS, timeout): the service is not up yet."""


class Client(Protocol):
    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]: ...


class Http:
    """JSON over HTTP with basic auth; answers (status, parsed JSON body or text)."""

    def __init__(self, base: str, user: str, password: str, timeout_s: float = 30.0) -> None:
        self.base = base.rstrip("/")
        self.timeout_s = timeout_s
        self._auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", self._auth)
        if raw is None and body is not None:
            req.add_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, _parse(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, _parse(e.read())
        except (urllib.error.URLError, OSError) as e:
            raise Unreachable(f"{self.base}: {getattr(e, 'reason', e)}") from None


def _parse(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return body.decode("utf-8", "replace")


def _expect(what: str, status: int, body: Any, ok: tuple[int, ...] = (200,)) -> Any:
    if status not in ok:
        raise SetupError(
            f"{what}: HTTP {status}: {json.dumps(body)[:500] if not isinstance(body, str) else body[:500]}"
        )
    return body


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float, sleep: Callable[[float], None]) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        try:
            if ready():
                print(f"{what} is ready", flush=True)
                return
            last = "not ready"
        except Unreachable as e:
            last = str(e)
        if time.monotonic() >= deadline:
            raise SetupError(f"{what} was not ready after {timeout_s:.0f} s ({last})")
        sleep(2.0)


def elasticsearch_ready(es: Client) -> bool:
    status, body = es.request("GET", "/_cluster/health?wait_for_status=yellow&timeout=5s")
    return status == 200 and isinstance(body, dict) and body.get("status") in ("yellow", "green")


def kibana_ready(kb: Client) -> bool:
    status, body = kb.request("GET", "/api/status")
    level = ((body or {}).get("status") or {}).get("overall", {}).get("level") if isinstance(body, dict) else None
    return status == 200 and level in KIBANA_READY


def set_kibana_password(es: Client, password: str) -> None:
    status, body = es.request("POST", "/_security/user/kibana_system/_password", {"password": password})
    _expect("set the kibana_system password", status, body)


def ensure_writer(es: Client, user: str, password: str, index_patterns: list[str]) -> None:
    """The gateway's user: append audit events, read them back (search, verify), keep template and ILM current."""
    role = {
        "cluster": WRITER_CLUSTER_PRIVILEGES,
        "indices": [{"names": index_patterns, "privileges": WRITER_INDEX_PRIVILEGES}],
    }
    status, body = es.request("PUT", f"/_security/role/{WRITER_ROLE}", role)
    _expect(f"put role {WRITER_ROLE}", status, body)
    spec = {"password": password, "roles": [WRITER_ROLE], "full_name": "Tianmen gateway (audit writer)"}
    status, body = es.request("PUT", f"/_security/user/{user}", spec)
    _expect(f"put user {user}", status, body)


def ensure_policy(es: Client, policy: dict[str, Any]) -> bool:
    """Put the ILM policy unless the same phases are there; True when written."""
    status, body = es.request("GET", f"/_ilm/policy/{POLICY_NAME}")
    _expect("read the ILM policy", status, body, ok=(200, 404))
    if status == 200 and body.get(POLICY_NAME, {}).get("policy", {}).get("phases") == policy["policy"]["phases"]:
        return False
    status, body = es.request("PUT", f"/_ilm/policy/{POLICY_NAME}", policy)
    _expect(f"put ILM policy {POLICY_NAME}", status, body)
    return True


def ensure_template(es: Client, template: dict[str, Any]) -> bool:
    """Put the index template unless the same or a newer version is there (a newer gateway installs its own)."""
    status, body = es.request("GET", f"/_index_template/{TEMPLATE_NAME}")
    _expect("read the index template", status, body, ok=(200, 404))
    found = body.get("index_templates", []) if status == 200 else []
    if found and found[0]["index_template"].get("version", 0) >= template.get("version", 0):
        return False
    status, body = es.request("PUT", f"/_index_template/{TEMPLATE_NAME}", template)
    _expect(f"put index template {TEMPLATE_NAME}", status, body)
    return True


def multipart(field: str, filename: str, content: bytes) -> tuple[bytes, str]:
    """A multipart/form-data body with one file; returns (body, content type)."""
    boundary = f"tianmen-{uuid.uuid4().hex}"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{filename}"\r\n'
        "Content-Type: application/ndjson\r\n\r\n"
    ).encode()
    return head + content + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def import_saved_objects(kb: Client, ndjson: bytes) -> int:
    """Import (overwriting) the saved objects; returns how many Kibana accepted."""
    body, content_type = multipart("file", "saved-objects.ndjson", ndjson)
    status, answer = kb.request(
        "POST",
        "/api/saved_objects/_import?overwrite=true",
        raw=body,
        headers={"Content-Type": content_type, "kbn-xsrf": "tianmen-setup"},
    )
    _expect("import the Kibana saved objects", status, answer)
    if not answer.get("success"):
        raise SetupError(f"Kibana refused some saved objects: {json.dumps(answer.get('errors'))[:1000]}")
    return int(answer.get("successCount", 0))


def run(
    es: Client,
    kb: Client,
    secrets: Path,
    deploy: Path,
    es_user: str,
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    template = json.loads((deploy / "elasticsearch" / "index-template.json").read_text())
    policy = json.loads((deploy / "elasticsearch" / "ilm-policy.json").read_text())
    ndjson = (deploy / "kibana" / "saved-objects.ndjson").read_bytes()

    wait_for("Elasticsearch", lambda: elasticsearch_ready(es), timeout_s, sleep)
    set_kibana_password(es, _secret(secrets / "kibana_password"))
    ensure_writer(es, es_user, _secret(secrets / "es_password"), template["index_patterns"])
    print(f"Elasticsearch user {es_user!r} with role {WRITER_ROLE!r} on {template['index_patterns']}", flush=True)
    print(f"ILM policy {POLICY_NAME}: {'installed' if ensure_policy(es, policy) else 'up to date'}", flush=True)
    print(f"index template {TEMPLATE_NAME}: {'installed' if ensure_template(es, template) else 'up to date'}")
    wait_for("Kibana", lambda: kibana_ready(kb), timeout_s, sleep)
    print(f"Kibana saved objects: {import_saved_objects(kb, ndjson)} imported", flush=True)


def _secret(path: Path) -> str:
    try:
        value = path.read_text().strip()
    except OSError as e:
        raise SetupError(f"cannot read the secret {path}: {e.strerror}") from None
    if not value:
        raise SetupError(f"the secret {path} is empty")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Tianmen stack setup: Elasticsearch users, template, ILM; Kibana objects")
    ap.add_argument("--elasticsearch", default="http://elasticsearch:9200")
    ap.add_argument("--kibana", default="http://kibana:5601")
    ap.add_argument("--secrets", type=Path, default=Path("/run/secrets"))
    ap.add_argument("--deploy", type=Path, default=Path(__file__).resolve().parents[1], help="the deploy/ directory")
    ap.add_argument("--es-user", default="tianmen", help="the gateway's Elasticsearch user (audit.es_username)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each service")
    args = ap.parse_args(argv)
    try:
        elastic = _secret(args.secrets / "elastic_password")
        es = Http(args.elasticsearch, "elastic", elastic)
        kb = Http(args.kibana, "elastic", elastic)
        run(es, kb, args.secrets, args.deploy, args.es_user, args.timeout)
    except SetupError as e:
        print(f"setup: {e}", file=sys.stderr)
        return 1
    print("setup: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
