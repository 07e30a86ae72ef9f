"""Run the real gateway (uvicorn + TLS 1.3 + JWT + engine) in a thread on a free port, for tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gateway.models import ModelRegistry
from gateway.server import Server, build_app_and_config, connection_limits
from gateway.settings import Settings, load_settings
from security.devpki import DevPKI, ensure_dev_pki, mint_token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningGateway:
    url: str
    port: int
    settings: Settings
    pki: DevPKI
    engine: object  # the first model's
    model: str
    models: ModelRegistry  # every served model

    def token(self, sub: str = "alice", tenant: str = "acme", **kw: object) -> str:
        return mint_token(self.pki.jwt_key, self.pki.kid, sub=sub, tenant=tenant, **kw)  # type: ignore[arg-type]


@contextmanager
def run_gateway(
    home: Path, model: Path | None, env: dict[str, str] | None = None, config: Path | None = None
) -> Iterator[RunningGateway]:
    """`model` None: the demo model, or what `config` (a TOML file, e.g. with [[models]] tables) names."""
    port = free_port()
    environ = {
        "TIANMEN_HOME": str(home),
        "TIANMEN_SERVER_PORT": str(port),
        "TIANMEN_ENGINE_DTYPE": "float32",
        "TIANMEN_SERVER_LOG_LEVEL": "warning",
        "TIANMEN_AUDIT_SPOOL_DIR": str(home / "audit" / f"spool-{port}"),  # one spool per gateway process
    }
    if model is not None:  # None: the embedded default's sealed demo model
        environ["TIANMEN_ENGINE_MODEL"] = str(model)
    environ.update(env or {})
    settings = load_settings(config, environ=environ)
    uv_config, engine = build_app_and_config(settings)
    server = Server(uv_config, None, connection_limits(settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started or not thread.is_alive():
            break
        time.sleep(0.05)
    assert server.started, "the gateway did not start"
    scheme = "http" if settings.server.insecure_http else "https"
    try:
        yield RunningGateway(
            f"{scheme}://127.0.0.1:{port}",
            port,
            settings,
            ensure_dev_pki(home),
            engine,
            engine.model_name,
            uv_config.app.state.deps.models,  # type: ignore[union-attr]
        )
    finally:
        server.should_exit = True
        thread.join(30)
