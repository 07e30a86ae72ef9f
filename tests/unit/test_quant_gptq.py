"""GPTQ (`tianmen quantize --gptq`): values on round-to-nearest's own grid, a lower layer-output error than it on
the calibration inputs, checkpoints that load, and clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.errors import ModelLoadError
from engine.layers.linear import Linear
from engine.loader import DirectoryFiles
from engine.quant.calibrate import calibration_ids, float_core, prefill
from engine.quant.gptq import Grid, Hessian, gptq
from engine.quant.gptq_model import GPTQ_TOKENS, GptqSettings, TakenLayer, dequantize, gptq_model
from engine.quant.grid import rtn_int4, rtn_int8
from engine.quant.layouts import unpack_int32
from engine.quant.quantize import quantize
from gateway.cli import main as cli
from tests.parity.conftest import make_core, step_logits
from tests.tiny_model import build_tiny_chat_model

PROMPTS = {"a": [5, 9, 33, 100, 7, 8, 200, 41], "b": [17, 3, 250]}
GRIDS = [Grid(None), Grid(32), Grid(32, symmetric=False)]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("gptq") / "tiny", tied=False)


def _rtn(w: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if grid.group_size is None:
        return (*rtn_int8(w, torch.float32), None)
    return rtn_int4(w, grid.group_size, torch.float32, grid.symmetric)


@pytest.mark.parametrize("grid", GRIDS, ids=["int8", "int4", "int4-asym"])
def test_without_correlated_inputs_gptq_is_round_to_nearest(grid: Grid) -> None:
    """A diagonal Hessian spreads no error: every value, scale and zero point is RTN's, bit for bit."""
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0))
    got, want = gptq(w, torch.diag(torch.rand(256) + 0.5), grid), _rtn(w, grid)
    for g, r in zip(got, want, strict=True):
        assert (g is None and r is None) or torch.equal(g, r)  # type: ignore[arg-type]


@pytest.mark.parametrize("grid", GRIDS, ids=["int8", "int4", "int4-asym"])
def test_gptq_lowers_the_output_error_of_correlated_inputs(grid: Grid) -> None:
    gen = torch.Generator().manual_seed(1)
    w, x = (
        torch.randn(64, 256, generator=gen),
        torch.randn(1024, 256, generator=gen) @ torch.randn(256, 256, generator=gen),
    )
    h = Hessian(256)
    for part in x.split(300):  # the running mean over several calls is the one over all rows
        h.add(part)
    assert torch.allclose(h.h, 2 * x.T @ x / len(x), rtol=1e-4, atol=1e-2)
    err_gptq = (x @ (w - dequantize(*gptq(w, h.h, grid))).T).norm()
    err_rtn = (x @ (w - dequantize(*_rtn(w, grid))).T).norm()
    assert err_gptq < 0.8 * err_rtn


def test_the_float_target_brings_a_layer_on_drifted_inputs_closer_to_the_float_layer() -> None:
    """A 4-bit layer whose inputs X̃ drifted from the float model's X (the quantized layers before it): aiming at
    W·X rather than W·X̃ lowers ‖W X − Ŵ X̃‖, the error the rest of the model sees."""
    gen = torch.Generator().manual_seed(3)
    mix = torch.randn(256, 256, generator=gen) / 16
    w, x = torch.randn(64, 256, generator=gen), torch.randn(1024, 256, generator=gen) @ mix
    drifted = x @ (torch.eye(256) + 0.1 * torch.randn(256, 256, generator=gen) / 16)  # a systematic drift
    grid, rows = Grid(32, symmetric=False), [("layer", 0, 64)]
    recorder = TakenLayer(rows, w, None, None, grid, GptqSettings(), False, recording=True)
    assert torch.equal(recorder(x), x @ w.T) and recorder.hessian is None  # the float run computes in float
    assert recorder.reference is not None and torch.equal(recorder.reference, x)
    errors = []
    for reference in (recorder.reference, None):
        t = TakenLayer(rows, w, None, None, grid, GptqSettings(), False)
        t.reference = reference
        t(drifted)
        assert t.reference is None and t.cross is None and t.hessian is None  # nothing [T, K] outlives its layer
        errors.append(float((x @ w.T - drifted @ t.used.T).norm()))
    assert errors[0] < 0.7 * errors[1]
    int8 = TakenLayer(rows, w, None, None, Grid(None), GptqSettings(), True, recording=True)
    int8(x)
    assert int8.reference is None  # W8A8 layers keep the plain target: nothing recorded


def test_inputs_that_never_fire_get_zero_weights() -> None:
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(2))
    x[:, 5] = 0
    h = Hessian(64)
    h.add(x)
    q, scale, zero = gptq(torch.randn(16, 64), h.h, Grid(32))
    assert bool((q[:, 5] == 0).all()) and bool(torch.isfinite(scale).all()) and zero is None


def _calibration_inputs(src: Path, layer: str) -> torch.Tensor:
    """What the float engine feeds `layer` (e.g. model.layers.1.mlp.down_proj) over the calibration text."""
    hf = json.loads((src / "config.json").read_text())
    ids = calibration_ids(DirectoryFiles(src), hf, GptqSettings().tokens)
    core = float_core(src, len(ids))
    seen: list[torch.Tensor] = []
    lin = core.runner.model.get_submodule(layer)
    assert isinstance(lin, Linear)
    lin.register_forward_pre_hook(lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1]).clone()))
    prefill(core, ids)
    return torch.cat(seen)


@pytest.mark.parametrize("layer", ["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"])
def test_on_the_calibration_inputs_gptq_beats_rtn(src: Path, layer: str) -> None:
    """One pass (every Hessian from the float model), so the inputs are the float engine's."""
    hf = json.loads((src / "config.json").read_text())
    grid = Grid(32, symmetric=False)
    done = gptq_model(src, hf, lambda _dtype: grid, settings=GptqSettings(sequential=False))
    w, x = load_file(str(src / "model.safetensors"))[f"{layer}.weight"], _calibration_inputs(src, layer)
    err_gptq = (x @ (w - dequantize(*done[layer])).T).norm()
    err_rtn = (x @ (w - dequantize(*_rtn(w, grid))).T).norm()
    assert err_gptq < 0.9 * err_rtn


def _int4_values(state: dict[str, torch.Tensor], module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    values = unpack_int32(state[f"{module}.weight_packed"], 1)
    zero = state.get(f"{module}.weight_zero_point")
    return values, None if zero is None else unpack_int32(zero, 0)


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_gptq_checkpoint_loads_with_values_on_the_grid(src: Path, tmp_path: Path, symmetric: bool) -> None:
    flags = [] if symmetric else ["--asymmetric"]
    assert cli(["quantize", str(src), str(tmp_path / "q"), "--scheme", "w4a16", "--group-size", "32", "--gptq",
                "--quantize-lm-head", *flags]) == 0  # fmt: skip
    report = json.loads((tmp_path / "q" / "tianmen-quant.json").read_text())
    assert report["method"] == "gptq" and report["gptq"]["sequential"] and report["quantized"] == 15
    assert report["gptq"]["float_target"] and report["gptq"]["tokens"] == GPTQ_TOKENS
    state, rtn_state = load_file(str(tmp_path / "q" / "model.safetensors")), load_file(str(src / "model.safetensors"))
    moved, edge = 0, []
    for module in [m.removesuffix(".weight_packed") for m in state if m.endswith(".weight_packed")]:
        values, zero = _int4_values(state, module)
        assert int(values.min()) >= 0 and int(values.max()) <= 15  # stored offset by 8: -8..7
        groups = (values - 8).view(values.shape[0], -1, 32)
        # min-max: a group's extreme lands on the grid's edge (7.5 steps rounds to -8 / 7); GPTQ moves the values
        # after the scale is chosen, so now and then a group's extreme shrinks below it
        if zero is None:
            edge.append(groups.abs().amax(-1) >= 7)
        else:
            assert int(zero.min()) >= 0 and int(zero.max()) <= 15
            edge.append((groups.amin(-1) == -8) | (groups.amax(-1) == 7))
        rtn, _, _ = rtn_int4(rtn_state[f"{module}.weight"], 32, torch.float32, symmetric)
        moved += int(((values - 8) != rtn).sum())
    assert moved > 0  # GPTQ chose other values than rounding would
    assert float(torch.cat([e.flatten() for e in edge]).float().mean()) >= 0.99
    core = make_core(tmp_path / "q")
    assert core.config.quantization == "w4a16"
    got, want = step_logits(core, PROMPTS, 1)[0], step_logits(make_core(src), PROMPTS, 1)[0]
    assert (got - want).abs().max() <= 0.25 * want.abs().max()  # 4-bit: close, not equal


def test_w8a8_gptq_after_smoothing_keeps_rtn_scales_of_the_smoothed_weights(src: Path, tmp_path: Path) -> None:
    report = quantize(src, tmp_path / "q", "w8a8", smooth=0.5, gptq=True, gptq_settings=GptqSettings(tokens=256))
    assert report.method == "smoothquant+gptq" and report.gptq is not None and report.gptq["tokens"] == 256
    smoothed = quantize(src, tmp_path / "rtn", "w8a8", smooth=0.5)  # the same smoothing, rounded
    assert smoothed.method == "smoothquant+rtn"
    state, rtn_state = (
        load_file(str(tmp_path / "q" / "model.safetensors")),
        load_file(str(tmp_path / "rtn" / "model.safetensors")),
    )
    scales = [k for k in state if k.endswith(".weight_scale")]
    assert len(scales) == 14
    for k in scales:  # per channel, the scale comes from the (smoothed) weight before any error is spread
        assert torch.equal(state[k], rtn_state[k])
    assert any(not torch.equal(state[k], rtn_state[k]) for k in state if k.endswith("proj.weight"))
    core = make_core(tmp_path / "q")
    assert core.config.quantization == "w8a8"
    got, want = step_logits(core, PROMPTS, 1)[0], step_logits(make_core(src), PROMPTS, 1)[0]
    assert (got - want).abs().max() <= 5e-2 * want.abs().max()


def test_what_gptq_cannot_do_is_refused(src: Path, tmp_path: Path) -> None:
    cfg = {**json.loads((src / "config.json").read_text()), "model_type": "deepseek_v2"}
    with pytest.raises(ModelLoadError, match="GPTQ supports llama, qwen2, mistral models; got 'deepseek_v2'"):
        gptq_model(src, cfg, lambda _dtype: Grid(None))
    with pytest.raises(ModelLoadError, match="calibration needs at least 16 tokens"):
        quantize(src, tmp_path / "a", "w8a8", gptq=True, gptq_settings=GptqSettings(tokens=4))
    with pytest.raises(
        ModelLoadError, match=r"self_attn\.v_proj: in_features 64 is not a multiple of the group size 48"
    ):
        quantize(src, tmp_path / "b", "w4a16", 48, gptq=True)


def test_the_cli_sets_how_gptq_calibrates(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["quantize", str(src), str(tmp_path / "q"), "--scheme", "w4a16", "--group-size", "32"]
    assert cli([*base, "--gptq-tokens", "64"]) == 2
    assert "add --gptq" in capsys.readouterr().err
    for bad in ("0", "-5"):
        assert cli([*base, "--gptq", "--gptq-tokens", bad]) != 0
        assert "calibration needs at least 16 tokens" in capsys.readouterr().err
    assert cli([*base, "--gptq", "--gptq-tokens", "64", "--no-gptq-float-target"]) == 0
    report = json.loads((tmp_path / "q" / "tianmen-quant.json").read_text())
    assert report["gptq"]["tokens"] == 64 and not report["gptq"]["float_target"]
