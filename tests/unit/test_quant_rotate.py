"""Rotations for quantization (engine.quant.rotate, engine.quant.transform): a rotated float checkpoint computes
what the original did; the online Hadamard is compressed-tensors' own; its transform_config is refused where we
cannot run it; the searched 4-bit ranges never round worse than min-max."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.transform import TransformConfig
from safetensors.torch import load_file

from engine.errors import ModelLoadError
from engine.quant.grid import clipped_group_params, from_grid, group_params, to_grid
from engine.quant.quantize import DOWN_PROJ, quantization_config
from engine.quant.rotate import orthogonal, rotate_checkpoint
from engine.quant.spec import quant_spec
from engine.quant.transform import InputRotation, hadamard, input_rotations, rotate_blocks, transform_config
from tests.parity.conftest import build_llama, build_qwen2, make_core, step_logits
from tests.tiny_model import build_tiny_chat_model

PROMPTS = {"a": [5, 9, 33, 100, 7, 8, 200, 41], "b": [17, 3, 250]}


def test_hadamard_is_orthogonal_and_symmetric() -> None:
    for n in (1, 2, 16, 64):
        h = hadamard(n)
        assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12) and torch.equal(h, h.T)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(48)


def test_rotate_blocks_mixes_each_block_on_its_own() -> None:
    x = torch.randn(3, 5, 128, dtype=torch.float64)
    want = x @ torch.block_diag(hadamard(32), hadamard(32), hadamard(32), hadamard(32))
    assert torch.allclose(rotate_blocks(x, 32), want, atol=1e-12)
    assert torch.allclose(rotate_blocks(rotate_blocks(x, 32), 32), x, atol=1e-12)  # H·H = I
    with pytest.raises(ValueError, match="whole blocks"):
        rotate_blocks(x, 48)


def test_orthogonal_is_orthogonal_and_seeded() -> None:
    q = orthogonal(96, 0)
    assert torch.allclose(q @ q.T, torch.eye(96, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, orthogonal(96, 0)) and not torch.equal(q, orthogonal(96, 1))


@pytest.mark.parametrize("build", [build_llama, build_qwen2, build_tiny_chat_model], ids=["llama", "qwen2", "chat"])
def test_a_rotated_checkpoint_computes_what_the_original_did(build: object, tmp_path: Path) -> None:
    """Norms folded, R1 over the residual stream, R2 over V's heads; Qwen2's biases, tied heads (which untie)."""
    src = build(tmp_path / "src")  # type: ignore[operator]
    done = rotate_checkpoint(src, tmp_path / "rot")
    cfg = json.loads((tmp_path / "rot" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and done.hidden == cfg["hidden_size"]
    state = load_file(str(tmp_path / "rot" / "model.safetensors"))
    assert "lm_head.weight" in state and torch.equal(state["model.norm.weight"], torch.ones(cfg["hidden_size"]))
    assert torch.equal(state["model.layers.0.input_layernorm.weight"], torch.ones(cfg["hidden_size"]))
    got, want = step_logits(make_core(tmp_path / "rot"), PROMPTS, 3), step_logits(make_core(src), PROMPTS, 3)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max()


def test_rotation_refuses_models_it_does_not_know(tmp_path: Path) -> None:
    src = build_tiny_chat_model(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v2"}))
    with pytest.raises(ModelLoadError, match="rotation supports llama, qwen2, mistral"):
        rotate_checkpoint(src, tmp_path / "rot")


def test_rotation_names_a_missing_shape_key(tmp_path: Path) -> None:
    src = build_tiny_chat_model(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json has no num_hidden_layers"):
        rotate_checkpoint(src, tmp_path / "rot")


def test_our_transform_config_is_compressed_tensors_own() -> None:
    tc = transform_config(InputRotation((DOWN_PROJ,), 64))
    parsed = TransformConfig.model_validate(tc)  # the library's schema
    scheme = parsed.config_groups["R4"]
    assert scheme.type == "hadamard" and scheme.head_dim == 64 and not scheme.randomize
    assert [(a.location, a.inverse) for a in scheme.apply] == [("input", False), ("weight_input", True)]
    qc = quantization_config("w8a8", 128, ["lm_head"], rotation=InputRotation((DOWN_PROJ,), 64))
    spec = quant_spec({"model_type": "llama", "quantization_config": qc})
    assert spec is not None and spec.input_block("model.layers.3.mlp.down_proj") == 64
    assert spec.input_block("model.layers.3.mlp.up_proj") is None
    assert spec.input_block("model.layers.3.self_attn.o_proj") is None


def _mutated(change: object) -> dict:
    tc = transform_config(InputRotation((DOWN_PROJ,), 64))
    change(tc["config_groups"]["R4"])  # type: ignore[operator]
    return tc


@pytest.mark.parametrize(
    ("tc", "model_type", "says"),
    [
        (_mutated(lambda s: s.update(type="random-hadamard")), "llama", "deterministic hadamard"),
        (_mutated(lambda s: s.update(randomize=True)), "llama", "deterministic hadamard"),
        (_mutated(lambda s: s.update(head_dim=48)), "llama", "block size"),
        (_mutated(lambda s: s.update(head_dim=None)), "llama", "block size"),
        (_mutated(lambda s: s["apply"].pop()), "llama", "applies"),
        (_mutated(lambda s: s["apply"][1].update(location="weight_output")), "llama", "applies"),
        (_mutated(lambda s: s["apply"][0].update(targets=["Linear"])), "llama", "targets"),
        (_mutated(lambda s: s["apply"][0].update(targets=["q_proj"])), "llama", "targets"),
        (_mutated(lambda s: [a.update(targets=[3]) for a in s["apply"]]), "llama", "targets"),
        (_mutated(lambda s: [a.update(targets=[""]) for a in s["apply"]]), "llama", "targets"),
        (transform_config(InputRotation((DOWN_PROJ,), 64)), "deepseek_v2", "'deepseek_v2' model"),
        ({"config_groups": {}}, "llama", "no config_groups"),
        ({"transform_groups": {}}, "llama", "no config_groups"),
    ],
)
def test_transforms_we_cannot_run_are_refused_by_name(tc: dict, model_type: str, says: str) -> None:
    with pytest.raises(ModelLoadError, match=f"unsupported transform_config: .*{says}"):
        input_rotations(tc, model_type)


def test_no_transform_config_is_no_rotation() -> None:
    assert input_rotations(None, "llama") == [] and input_rotations({}, "deepseek_v2") == []


@pytest.mark.parametrize("symmetric", [True, False])
def test_searched_ranges_never_round_worse_than_min_max(symmetric: bool) -> None:
    g = torch.randn(64, 8, 32)
    g[:, :, 0] *= 6  # an outlier a group: where clipping pays
    err = []
    for params in (group_params, clipped_group_params):
        scale, zero = params(g, torch.float32, symmetric)
        z = None if zero is None else zero[..., None]
        err.append((from_grid(to_grid(g, scale[..., None], z, (-8, 7)), scale[..., None], z) - g).pow(2).sum(-1))
    assert bool((err[1] <= err[0] + 1e-6).all()) and float(err[1].sum()) < 0.97 * float(err[0].sum())
