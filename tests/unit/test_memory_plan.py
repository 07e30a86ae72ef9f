"""engine.memory: the plan made before loading matches what loading then holds; what the host has free."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import DirectoryFiles, EngineConfig
from engine import memory as mem
from engine.core import EngineCore
from engine.loader import load_model, read_json
from engine.model_runner import bf16_weight_storage
from tests.tiny_model import build_tiny_chat_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny", tied=False)


@pytest.fixture(scope="module")
def bf16_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("m") / "tiny-bf16"
    AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((model / name).read_bytes())
    return out


@pytest.mark.parametrize(
    "kw", [{}, {"kv_cache_bytes": 1 << 20, "block_size": 32}, {"bf16": True}, {"bf16": True, "compact_weights": False}]
)
def test_the_plan_is_what_loading_holds(model: Path, bf16_model: Path, kw: dict) -> None:
    path = bf16_model if kw.pop("bf16", False) else model  # a bf16 checkpoint under float32 math: bf16 storage
    config = EngineConfig(model=path, max_model_len=256, dtype="float32", gemm_path="torch", **kw)
    files = DirectoryFiles(path)
    plan = mem.plan_memory(config, files)
    loaded = load_model(
        files,
        read_json(files, "config.json"),
        torch.device("cpu"),
        torch.float32,
        bf16_storage=bf16_weight_storage(config),
    )
    tensors = {id(t): t for t in [*loaded.parameters(), *loaded.buffers()]}.values()
    assert plan.weights_bytes == sum(t.numel() * t.element_size() for t in tensors)
    runner = EngineCore(config).runner
    assert plan.kv_blocks == runner.num_blocks and plan.kv_bytes == runner.num_blocks * runner.kv_bytes_per_block()
    assert plan.device == "cpu" and plan.total_bytes == plan.weights_bytes + plan.kv_bytes


def test_host_memory_is_the_smaller_of_meminfo_and_the_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    monkeypatch.setattr(mem, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(mem, "CGROUP", cgroup)
    assert mem.available_bytes("cpu") == 2 << 20  # no cgroup files: MemAvailable
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("5\n")
    assert mem.available_bytes("cpu") == 2 << 20
    (cgroup / "memory.max").write_text(str(1 << 20))
    (cgroup / "memory.current").write_text(str(1 << 18))
    assert mem.available_bytes("cpu") == 3 << 18
    assert mem.available_bytes("npu:0") is None
    assert mem.format_bytes(3 << 29) == "1.5 GiB" and mem.format_bytes(1000) == "1000 B"
