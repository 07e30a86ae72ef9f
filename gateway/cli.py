"""`tianmen` command line: serve, token, import-gguf."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from gateway.settings import Settings, SettingsError, load_settings


def _duration(text: str) -> int:
    m = re.fullmatch(r"(\d+)([smhd]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 1h, 7d)")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(args.config)


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.server import serve

    settings = _settings(args)
    if args.insecure_http:
        settings.server.insecure_http = True
    if args.host:
        settings.server.host = args.host
    if args.port:
        settings.server.port = args.port
    if args.model:
        settings.engine.model = Path(args.model)
    serve(settings)
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    from security.devpki import ensure_dev_pki, mint_token

    settings = _settings(args)
    if settings.auth.external:
        print(
            "tianmen token mints dev tokens only; this server verifies tokens from an external key set "
            "(auth.jwks_file / auth.jwks_url / auth.hs256_secret_file): get a token from your identity provider",
            file=sys.stderr,
        )
        return 2
    pki = ensure_dev_pki(settings.home)
    scopes = [s for group in args.scope for s in group.split()]
    print(
        mint_token(
            pki.jwt_key,
            pki.kid,
            sub=args.sub,
            tenant=args.tenant,
            scopes=scopes,
            models=args.model or None,
            tier=args.tier,
            ttl_s=args.ttl,
            issuer=settings.auth.issuer or "tianmen-dev",
            audience=settings.auth.audience or "tianmen",
        )
    )
    return 0


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from engine.gguf_import import import_gguf

    out = import_gguf(args.file, args.out)
    print(f"wrote {out}")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tianmen", description="Secure inference gateway with an embedded LLM engine")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API over TLS 1.3")
    p.add_argument("--config", type=Path, help="TOML settings file (TIANMEN_* variables override it)")
    p.add_argument("--insecure-http", action="store_true", help="plain HTTP, for development only")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--model", help="model directory (default: the demo model)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("token", help="mint a development JWT signed by the dev key")
    p.add_argument("--config", type=Path)
    p.add_argument("--sub", required=True, help="subject (user id)")
    p.add_argument("--tenant", required=True)
    p.add_argument("--scope", action="append", default=[], help="scope(s); repeat or space-separate")
    p.add_argument("--model", action="append", help="restrict to this model (repeatable; default: all)")
    p.add_argument("--tier", help="rate-limit tier")
    p.add_argument("--ttl", type=_duration, default=3600, help="lifetime, e.g. 30m, 1h (default 1h)")
    p.set_defaults(func=cmd_token)

    p = sub.add_parser("import-gguf", help="convert a Llama-architecture GGUF into a model directory")
    p.add_argument("file", type=Path)
    p.add_argument("out", type=Path)
    p.set_defaults(func=cmd_import_gguf)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SettingsError as e:
        print(f"tianmen: configuration error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
