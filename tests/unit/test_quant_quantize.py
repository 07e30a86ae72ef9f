"""`tianmen quantize`: what it writes, what it keeps, and the clear answers it gives for what it cannot do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.loader import DirectoryFiles, load_model, read_json
from engine.quant.modules import QuantLinear
from engine.quant.quantize import quantize, rtn_int8
from gateway.cli import main as cli
from tests.parity.conftest import build_llama


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("quantize") / "llama")  # untied head, hidden 64, MLP 160


def _names(path: Path) -> set[str]:
    names: set[str] = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, framework="pt") as st:
            names |= set(st.keys())
    return names


def test_w8a8_keeps_embeddings_norms_and_the_head(src: Path, tmp_path: Path) -> None:
    report = quantize(src, tmp_path / "q", "w8a8")
    names = _names(tmp_path / "q")
    assert "model.layers.0.self_attn.q_proj.weight_scale" in names and "lm_head.weight_scale" not in names
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert report.quantized == 14 and report.kept == ["lm_head"]
    with safe_open(tmp_path / "q" / "model.safetensors", framework="pt") as st:
        assert st.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.int8
        assert st.get_tensor("model.embed_tokens.weight").dtype == torch.float32


def test_the_head_is_quantized_when_asked(src: Path, tmp_path: Path) -> None:
    assert cli(["quantize", str(src), str(tmp_path / "q"), "--scheme", "w4a16", "--group-size", "32",
                "--quantize-lm-head"]) == 0  # fmt: skip
    cfg = read_json(DirectoryFiles(tmp_path / "q"), "config.json")
    assert cfg["quantization_config"]["ignore"] == []
    model = load_model(DirectoryFiles(tmp_path / "q"), cfg, torch.device("cpu"), torch.float32)
    assert isinstance(model.lm_head, QuantLinear) and model.quantization == "w4a16"


def test_large_models_are_sharded_with_an_index(src: Path, tmp_path: Path) -> None:
    quantize(src, tmp_path / "q", "w8a8", shard_bytes=64 << 10)
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and set(index["weight_map"]) == _names(tmp_path / "q")
    model = load_model(DirectoryFiles(tmp_path / "q"), read_json(DirectoryFiles(tmp_path / "q"), "config.json"),
                       torch.device("cpu"), torch.float32)  # fmt: skip
    assert model.quantization == "w8a8"


def test_rtn_int8_scale_maps_the_largest_weight_to_127_5_steps() -> None:
    w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]])
    q, scale = rtn_int8(w, torch.float32)
    assert torch.allclose(scale[0], torch.tensor([1 / 127.5])) and q[0, 0] == 127 and bool((q[1] == 0).all())


def test_a_group_size_that_does_not_divide_a_layer_is_named(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["quantize", str(src), str(tmp_path / "q"), "--scheme", "w4a16", "--group-size", "128"]) == 1
    assert "down_proj: in_features 160 is not a multiple of the group size 128" in capsys.readouterr().err


@pytest.mark.parametrize("group", ["0", "12"])
def test_bad_group_sizes_are_refused(src: Path, tmp_path: Path, group: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["quantize", str(src), str(tmp_path / "q"), "--scheme", "w4a16", "--group-size", group]) == 1
    assert "group size must be a positive multiple of 8" in capsys.readouterr().err


def test_an_unknown_scheme_is_refused(src: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        cli(["quantize", str(src), str(tmp_path / "q"), "--scheme", "int3"])
    assert e.value.code == 2
    with pytest.raises(ModelLoadError, match="scheme must be one of w8a8, w4a16"):
        quantize(src, tmp_path / "q", "fp8")


def test_it_refuses_a_quantized_source_and_a_full_destination(src: Path, tmp_path: Path) -> None:
    quantize(src, tmp_path / "q", "w8a8")
    with pytest.raises(ModelLoadError, match="already quantized"):
        quantize(tmp_path / "q", tmp_path / "qq", "w4a16")
    with pytest.raises(ModelLoadError, match="is not empty"):
        quantize(src, tmp_path / "q", "w8a8")
    with pytest.raises(ModelLoadError, match="does not exist"):
        quantize(tmp_path / "nowhere", tmp_path / "q2", "w8a8")


def test_a_failed_run_leaves_the_destination_empty(src: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a multiple of the group size 128"):
        quantize(src, tmp_path / "q", "w4a16", 128, shard_bytes=1 << 10)  # several shards written first
    assert list((tmp_path / "q").iterdir()) == []
    assert quantize(src, tmp_path / "q", "w4a16", 32).quantized == 14  # and a rerun may use it


def test_asymmetric_w4a16_writes_zero_points_and_loads(src: Path, tmp_path: Path) -> None:
    argv = ["quantize", str(src), str(tmp_path / "q"), "--scheme", "w4a16", "--group-size", "32", "--asymmetric"]
    assert cli(argv) == 0
    files = DirectoryFiles(tmp_path / "q")
    cfg = read_json(files, "config.json")
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] is False
    assert "model.layers.1.mlp.gate_proj.weight_zero_point" in _names(tmp_path / "q")
    model = load_model(files, cfg, torch.device("cpu"), torch.float32)
    assert model.quantization == "w4a16" and not bool(
        (model.model.layers[1].mlp.gate_up_proj.quantized.zero == 8).all()
    )
    with pytest.raises(ModelLoadError, match="w8a8 weights are symmetric"):
        quantize(src, tmp_path / "q8", "w8a8", symmetric=False)
