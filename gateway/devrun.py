"""`make run`: serve the embedded default and print a curl command that works as printed."""

from __future__ import annotations

import json
import shlex

from gateway.demo import ensure_demo_model
from gateway.server import serve
from gateway.settings import load_settings
from security.devpki import ensure_dev_pki, mint_token


def main() -> None:
    settings = load_settings()
    pki = ensure_dev_pki(settings.home)
    model = settings.engine.model or ensure_demo_model(settings.home)
    name = settings.engine.served_model_name or model.name
    token = mint_token(pki.jwt_key, pki.kid, sub="alice", tenant="acme", ttl_s=8 * 3600)
    scheme = "http" if settings.server.insecure_http else "https"
    body = json.dumps(
        {
            "model": name,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
            "temperature": 0,
        }
    )
    cacert = "" if settings.server.insecure_http else f"--cacert {shlex.quote(str(pki.ca_cert))} "
    curl = (
        f"curl {cacert}{scheme}://{settings.server.host}:{settings.server.port}/v1/chat/completions \\\n"
        f"  -H 'Authorization: Bearer {token}' \\\n  -H 'Content-Type: application/json' \\\n"
        f"  -d {shlex.quote(body)}"
    )

    def on_ready() -> None:
        print(f"\nTianmen is serving {name}. Try (a dev token for alice@acme, valid 8h):\n\n{curl}\n", flush=True)

    serve(settings, on_ready)


if __name__ == "__main__":
    main()
