"""`make run`: serve the embedded default (or `CONFIG=file.toml`) and print a curl command that works as printed."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from gateway.demo import DEMO_NAME
from gateway.server import serve
from gateway.settings import load_settings
from security.devpki import ensure_dev_pki, mint_token


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m gateway.devrun", description="serve for development")
    ap.add_argument("--config", type=Path, help="TOML settings (e.g. deploy/config/two-models.toml)")
    settings = load_settings(ap.parse_args(argv).config)
    pki = ensure_dev_pki(settings.home)
    served = settings.served_models()
    names = [m.name or (m.engine.model.name if m.engine.model else DEMO_NAME) for m in served]
    token = mint_token(pki.jwt_key, pki.kid, sub="alice", tenant="acme", ttl_s=8 * 3600)
    scheme = "http" if settings.server.insecure_http else "https"
    body = json.dumps(
        {
            "model": names[0],
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
    others = f' (also: {", ".join(names[1:])}; set "model" to one of them)' if len(names) > 1 else ""

    def on_ready() -> None:
        print(
            f"\nTianmen is serving {names[0]}{others}. Try (a dev token for alice@acme, valid 8h):\n\n{curl}\n",
            flush=True,
        )

    serve(settings, on_ready)


if __name__ == "__main__":
    main()
