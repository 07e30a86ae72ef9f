"""SmoothQuant for W8A8: folding the scales leaves the float model's logits unchanged; `tianmen quantize --smooth`
records it and its checkpoint loads; what it cannot smooth is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from engine.quant.quantize import quantize
from engine.quant.smooth import calibration_text, smoothing, smoothing_scales
from gateway.cli import main as cli
from tests.parity.conftest import make_core, step_logits
from tests.tiny_model import build_tiny_chat_model

PROMPTS = {"a": [5, 9, 33, 100, 7, 8, 200, 41], "b": [17, 3, 250]}


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("smooth") / "tiny")


def test_folded_scales_leave_the_float_model_unchanged(src: Path, tmp_path: Path) -> None:
    cfg = json.loads((src / "config.json").read_text())
    factors = smoothing(src, cfg, 0.5)
    assert set(factors) == {f"model.layers.{i}.{n}" for i in range(2) for n in (
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight")}  # fmt: skip
    assert any(not torch.allclose(f, torch.ones_like(f)) for f in factors.values())
    state = load_file(str(src / "model.safetensors"))
    smoothed = {k: v * factors[k] if k in factors else v for k, v in state.items()}
    shutil.copytree(src, tmp_path / "smoothed")
    save_file(smoothed, str(tmp_path / "smoothed" / "model.safetensors"))
    got, want = step_logits(make_core(tmp_path / "smoothed"), PROMPTS, 3), step_logits(make_core(src), PROMPTS, 3)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max()


def test_scales_balance_activation_and_weight_ranges() -> None:
    act = torch.tensor([4.0, 1.0, 0.0])
    w = torch.tensor([[1.0, 4.0, 2.0]])
    s = smoothing_scales(act, [w], 0.5)
    assert torch.allclose(s, torch.tensor([2.0, 0.5, 1.0]))  # sqrt(4/1), sqrt(1/4); a silent channel keeps 1
    assert torch.allclose((act / s)[:2], (w.abs().amax(0) * s)[:2])  # α = 0.5: both ranges meet


def test_quantize_smooth_records_it_and_loads(src: Path, tmp_path: Path) -> None:
    assert cli(["quantize", str(src), str(tmp_path / "q"), "--scheme", "w8a8", "--smooth", "0.5"]) == 0
    report = json.loads((tmp_path / "q" / "tianmen-quant.json").read_text())
    assert report["method"] == "smoothquant+rtn" and report["smooth_alpha"] == 0.5
    core = make_core(tmp_path / "q")
    assert core.config.quantization == "w8a8"
    got, want = step_logits(core, PROMPTS, 1)[0], step_logits(make_core(src), PROMPTS, 1)[0]
    assert (got - want).abs().max() <= 5e-2 * want.abs().max()  # quantized: close, not equal


def test_what_cannot_be_smoothed_is_refused(src: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="for w8a8 only"):
        quantize(src, tmp_path / "a", "w4a16", 32, smooth=0.5)
    with pytest.raises(ModelLoadError, match="between 0 and 1"):
        quantize(src, tmp_path / "b", "w8a8", smooth=1.5)
    cfg = {**json.loads((src / "config.json").read_text()), "model_type": "deepseek_v2"}
    with pytest.raises(ModelLoadError, match="smoothing supports llama, qwen2, mistral"):
        smoothing(src, cfg, 0.5)


def test_calibration_text_is_not_the_fidelity_text() -> None:
    from pydoc_data.topics import topics

    first = topics[sorted(topics)[0]]
    assert calibration_text()[:2000].find(first[:200]) == -1
