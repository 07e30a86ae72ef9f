"""`tianmen` command line: serve, token, import-gguf."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from gateway.loadgen import add_parser as add_loadgen_parser
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
        if settings.models:
            raise SettingsError("--model names the one model of a single-model config; set [[models]] paths instead")
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


def cmd_seal(args: argparse.Namespace) -> int:
    from security.keys import provider_from_spec
    from security.seal import rewrap, seal

    env = _settings(args).environ
    if args.rewrap:
        if args.dst is not None or not args.new_key_provider:
            print("usage: tianmen seal --rewrap DIR --key-provider OLD --new-key-provider NEW", file=sys.stderr)
            return 2
        old, new = provider_from_spec(args.key_provider, env), provider_from_spec(args.new_key_provider, env)
        manifest = rewrap(args.src, old, new)
        print(f"rewrapped {args.src}: key {manifest.key_id}")
        return 0
    if args.dst is None:
        print("usage: tianmen seal SRC DST --key-provider SPEC", file=sys.stderr)
        return 2
    manifest = seal(
        args.src, args.dst, provider_from_spec(args.key_provider, env), chunk_size=args.chunk_size, progress=True
    )
    print(f"sealed {args.src} into {args.dst}: {len(manifest.files)} files, key {manifest.key_id}")
    return 0


def cmd_unseal(args: argparse.Namespace) -> int:
    from security.keys import provider_from_spec
    from security.sealed import verify

    manifest = verify(args.dir, provider_from_spec(args.key_provider, _settings(args).environ), progress=True)
    print(f"{args.dir}: every chunk tag and SM3 digest verifies ({len(manifest.files)} files, key {manifest.key_id})")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from audit import format_report, format_table, open_source, search, verify
    from audit.signer import Sm2Verifier
    from gateway.audit_hook import audit_config

    cfg = audit_config(_settings(args))

    async def run() -> int:
        async with open_source(cfg, spool=args.spool) as source:
            if args.audit_command == "search":
                events = await search(
                    source,
                    user=args.user,
                    tenant=args.tenant,
                    outcome=args.outcome,
                    model=args.model,
                    since=args.since,
                    limit=args.limit,
                )
                print(json.dumps(events, ensure_ascii=False, indent=2) if args.json else format_table(events))
                return 0
            keys = [Sm2Verifier.from_file(cfg.sm2_public_key_path).public_key] if cfg.sm2_public_key_path else []
            report = await verify(source, public_keys=keys)
            print(format_report(report))
            return 0 if report.ok else 1

    return asyncio.run(run())


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from engine.gguf_import import import_gguf

    out = import_gguf(args.file, args.out)
    print(f"wrote {out}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from engine.quant.quantize import quantize

    settings = None
    if args.gptq_tokens is not None or not args.gptq_float_target:
        if not args.gptq:
            raise SettingsError("--gptq-tokens and --no-gptq-float-target set how --gptq calibrates: add --gptq")
        from engine.quant.gptq_model import GPTQ_TOKENS, GptqSettings

        tokens = GPTQ_TOKENS if args.gptq_tokens is None else args.gptq_tokens  # 0 is refused, not the default
        settings = GptqSettings(tokens, float_target=args.gptq_float_target)
    r = quantize(
        args.src,
        args.dst,
        args.scheme,
        args.group_size,
        args.quantize_lm_head,
        symmetric=not args.asymmetric,
        smooth=args.smooth,
        gptq=args.gptq,
        gptq_settings=settings,
        rotate=args.rotate,
    )
    size = f"{r.bytes_in / 2**20:.1f} MiB -> {r.bytes_out / 2**20:.1f} MiB"
    print(f"wrote {args.dst}: {r.quantized} {r.scheme} layers, {size}")
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

    p = sub.add_parser("seal", help="encrypt a model directory with SM4-GCM under a key provider's key")
    p.add_argument("--config", type=Path)
    p.add_argument("src", type=Path, help="the clear model directory (with --rewrap: the sealed one)")
    p.add_argument("dst", type=Path, nargs="?", help="the sealed directory to create")
    p.add_argument("--key-provider", required=True, help="file:PATH | env:VAR | pkcs11:module=..;token=..;key=..")
    p.add_argument("--rewrap", action="store_true", help="move a sealed model to --new-key-provider's key")
    p.add_argument("--new-key-provider")
    p.add_argument("--chunk-size", type=int, default=4 << 20)
    p.set_defaults(func=cmd_seal)

    p = sub.add_parser("unseal", help="check a sealed model without writing plaintext")
    p.add_argument("--config", type=Path)
    p.add_argument("--verify", action="store_true", required=True, help="check every chunk tag and file digest")
    p.add_argument("dir", type=Path)
    p.add_argument("--key-provider", required=True)
    p.set_defaults(func=cmd_unseal)

    p = sub.add_parser("audit", help="search or verify the audit trail (Elasticsearch, or the local spool)")
    audit_sub = p.add_subparsers(dest="audit_command", required=True)
    for name, text in (("search", "find audit events"), ("verify", "check the hash chain and SM2 checkpoints")):
        q = audit_sub.add_parser(name, help=text)
        q.add_argument("--config", type=Path)
        q.add_argument("--spool", action="store_true", help="read the local spool instead of Elasticsearch")
        q.set_defaults(func=cmd_audit)
        if name == "search":
            q.add_argument("--user")
            q.add_argument("--tenant")
            q.add_argument("--outcome", choices=["success", "failure", "unknown"])
            q.add_argument("--model")
            q.add_argument("--since", help="e.g. 30m, 1h, 7d, or an ISO time")
            q.add_argument("--limit", type=int, default=100)
            q.add_argument("--json", action="store_true", help="print the events as JSON")

    add_loadgen_parser(sub)  # tianmen bench serve

    p = sub.add_parser("import-gguf", help="convert a Llama-architecture GGUF into a model directory")
    p.add_argument("file", type=Path)
    p.add_argument("out", type=Path)
    p.set_defaults(func=cmd_import_gguf)

    p = sub.add_parser("quantize", help="write a compressed-tensors W8A8 / W4A16 copy of a bf16/fp32 model directory")
    p.add_argument("src", type=Path, help="the HuggingFace model directory (clear; seal the result afterwards)")
    p.add_argument("dst", type=Path, help="the directory to create")
    p.add_argument("--scheme", required=True, choices=["w8a8", "w4a16"])
    p.add_argument("--group-size", type=int, default=128, help="w4a16: inputs sharing a scale (default 128)")
    p.add_argument("--asymmetric", action="store_true", help="w4a16: a zero point per group (W4A16_ASYM)")
    p.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="quantize the LM head too (default: kept; a head tied to the embeddings gets its own copy)",
    )
    p.add_argument("--smooth", type=float, metavar="ALPHA", help="w8a8: SmoothQuant of strength ALPHA (e.g. 0.5)")
    p.add_argument("--gptq", action="store_true", help="GPTQ instead of round-to-nearest (calibrates on a text)")
    p.add_argument("--gptq-tokens", type=int, metavar="N", help="GPTQ's calibration tokens (default 2048)")
    p.add_argument(
        "--no-gptq-float-target",
        dest="gptq_float_target",
        action="store_false",
        help="GPTQ w4a16: skip the float run whose inputs 4-bit layers aim at (saves T x sum(in_features) x 4 bytes)",
    )
    p.add_argument(
        "--rotate",
        action="store_true",
        help="Llama family: rotate the float model first (QuaRot/SpinQuant R1 + R2, and down_proj's inputs online; "
        "use with --gptq). The head becomes a float matrix of its own",
    )
    p.set_defaults(func=cmd_quantize)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from engine.errors import ModelLoadError
    from gateway.server import StartupError
    from security.keys import KeyProviderError
    from security.manifest import SealError

    try:
        return int(args.func(args))
    except SettingsError as e:
        print(f"tianmen: configuration error: {e}", file=sys.stderr)
        return 2
    except (StartupError, SealError, KeyProviderError, ModelLoadError) as e:
        print(f"tianmen: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
