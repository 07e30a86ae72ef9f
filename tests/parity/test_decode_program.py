"""Decode steps as one C call (engine.models.llama_program) on Llama, Qwen2 (qkv bias) and Mistral models from
bf16 checkpoints: the same logits, bit for bit, as the layers compute with the same kernels, at every batch class
a step has, in bf16 math (bf16mm / amxmm) and in float32 math (wbf16, every CPU), W8A8 (i8mm; i8avx2 in float32)
and W4A16 (w4mm; w4f32 in float32),
with the gated MLP's fused GEMM or with its GEMM and then the layers' own act in torch; greedy tokens
transformers' (float32) choices.

A GEMM whose plan chose a path with no C entry (oneDNN's, here) runs as the plan's own call between the
program's C calls, with the same bits."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import engine.kernels.bind
import engine.model_runner
from engine.kernels import amxmm, bf16mm, i8avx2, i8mm, w4fp16, w4vnni
from engine.kernels.bind import gemm_paths
from engine.kernels.gemm import FusedSiluPath
from engine.models.decode_program import TRIALS
from engine.quant.paths import quant_paths
from tests.parity.conftest import hf_expected, make_core, mixed_prompts, run_core, step_logits

BF16_GEMM = "bf16mm" if bf16mm.supported() else "amxmm" if amxmm.supported() else None
# dtype, the forced GEMM path (which binds every other kernel too, untimed: the engines compared take the same
# kernels whatever the timings), whether the gated MLP's GEMM is the fused one
VARIANTS = {
    "float32": ("float32", "wbf16", True),
    "float32-unfused": ("float32", "wbf16", False),
    "bf16": ("bfloat16", BF16_GEMM, True),
    "bf16-unfused": ("bfloat16", BF16_GEMM, False),
}


def _core(path: Path, variant: str, monkeypatch: pytest.MonkeyPatch, **over: object):  # type: ignore[no-untyped-def]
    dtype, gemm, fused = VARIANTS[variant]
    if gemm is None:
        pytest.skip("this CPU has no bf16 GEMM kernel (AVX512-BF16 or AMX): no bf16 program to build")
    if not fused:  # the gated MLP's GEMM without its SiLU epilogue: the act runs in torch, between two C calls
        with monkeypatch.context() as m:
            m.setattr(engine.model_runner, "gemm_paths", _without_fused)
            return make_core(path, dtype=dtype, gemm_path=gemm, **over)
    return make_core(path, dtype=dtype, gemm_path=gemm, **over)


def _without_fused(*args: object) -> list:
    return [p for p in gemm_paths(*args) if not isinstance(p, FusedSiluPath)]  # type: ignore[arg-type]


def _programs_run(core, variant: str | None = None) -> list[str]:  # type: ignore[no-untyped-def]
    """The batch classes whose steps ran through a program; with `variant`, each program's Python calls are
    checked: one act per layer where the gated MLP's GEMM is not the fused one, none otherwise."""
    from engine.kernels.select import CLASSES

    model = core.runner.model
    programs = {c: choice.program for c, choice in model.programs._choices.items() if choice.program is not None}
    if variant is not None:
        acts = 0 if VARIANTS[variant][2] else len(model.model.layers)
        assert all(p.python_calls == acts for p in programs.values()), [p.python_calls for p in programs.values()]
    return [CLASSES[c] for c in programs]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_programmed_step_gives_the_layers_logits_bit_for_bit(
    bf16_dir: Path, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = mixed_prompts(8)  # decode steps of 8 rows down to 1 as requests end, prefills between them
    programmed = _core(bf16_dir, variant, monkeypatch, decode_program="program")
    got = step_logits(programmed, prompts, 12)
    layers = _core(bf16_dir, variant, monkeypatch, decode_program="layers")
    want = step_logits(layers, prompts, 12)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert "<=8" in _programs_run(programmed, variant) and _programs_run(layers) == []  # the setting reaches it
    one = {"solo": prompts["r1"]}
    solo = _core(bf16_dir, variant, monkeypatch, decode_program="program")
    got = step_logits(solo, one, 12)
    want = step_logits(_core(bf16_dir, variant, monkeypatch, decode_program="layers"), one, 12)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and "1" in _programs_run(solo, variant)


def test_programs_run_where_torch_won_the_small_ops_timings(bf16_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The selection timed, not forced, and torch winning every small op's timing (RMSNorm, RoPE, argmax,
    sampling): what a program calls is bound anyway where programs may run, and decode steps run through programs,
    with the same bits as the layers; where programs are off, the layers keep torch's code."""
    import engine.kernels.op_choice

    monkeypatch.setattr(engine.kernels.op_choice, "faster", lambda *_: False)
    prompts = mixed_prompts(4)
    programmed = make_core(bf16_dir, dtype="float32", decode_program="program")
    got = step_logits(programmed, prompts, 8)
    model = programmed.runner.model
    assert model.model.norm.kernel is not None and model.model.layers[0].self_attn.kernel is not None
    assert "<=8" in _programs_run(programmed)
    auto = make_core(bf16_dir, dtype="float32", decode_program="auto")
    want = step_logits(auto, prompts, 8)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))  # the layers run the same kernels
    off = make_core(bf16_dir, dtype="float32", decode_program="layers")
    assert off.runner.model.model.norm.kernel is None and off.runner.model.model.layers[0].self_attn.kernel is None


QUANT = {"w8a8": i8mm.supported() and bf16mm.supported(), "w4a16": bf16mm.supported()}


@pytest.fixture(scope="module")
def quantized(bf16_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engine.quant.quantize import quantize

    out = tmp_path_factory.mktemp(bf16_dir.name + "-quant")
    made = {}
    for scheme, runs_here in QUANT.items():
        if runs_here:
            quantize(bf16_dir, out / scheme, scheme, group_size=16)
            made[scheme] = out / scheme
    return made


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("scheme", list(QUANT))
def test_quantized_programs_give_the_layers_logits_bit_for_bit(
    quantized: dict[str, Path], scheme: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W8A8 through i8mm's entries, W4A16 through w4mm's (bf16 rows; forced, untimed: the first accepting path
    runs), the gated MLP through the fused entry or through the plain one and then the torch act."""
    if scheme not in quantized:
        pytest.skip(f"this CPU has no {scheme} kernel a program calls (i8mm: AVX512-VNNI; w4mm: AVX512-BF16)")
    kernel = "i8mm" if scheme == "w8a8" else "w4mm"

    def ours(dtype: torch.dtype) -> list:
        paths = [p for p in quant_paths(dtype) if p.name.startswith(kernel) and ("silu" in p.name) == fused]
        return paths + [p for p in quant_paths(dtype) if p.name.startswith(kernel) and "silu" not in p.name]

    monkeypatch.setattr(engine.kernels.bind, "quant_paths", ours)
    prompts = mixed_prompts(6)
    core = make_core(quantized[scheme], dtype="bfloat16", gemm_path=BF16_GEMM, decode_program="program")
    got = step_logits(core, prompts, 10)
    layers = make_core(quantized[scheme], dtype="bfloat16", gemm_path=BF16_GEMM, decode_program="layers")
    want = step_logits(layers, prompts, 10)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert "<=8" in _programs_run(core)
    programs = [c.program for c in core.runner.model.programs._choices.values() if c.program is not None]
    assert all(p.python_calls == (0 if fused else len(core.runner.model.model.layers)) for p in programs)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize(
    ("scheme", "kernel"),
    [("w8a8", "i8avx2"), ("w8a8", "i8avx2-panel"), ("w4a16", "w4f32"), ("w4a16", "w4f32-panel")],
)
def test_float32_quantized_programs_give_the_layers_logits_bit_for_bit(
    bf16_dir: Path, tmp_path: Path, scheme: str, kernel: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32 math (the AVX2 CPUs'): W8A8 through i8avx2's entries, W4A16 through w4f32's (direct and panel), each
    a C call of the program over float32 rows; the gated MLP through the kernel's fused SiLU entry (no stop), or
    through the plain one and then the torch act between two C calls (one stop a layer)."""
    from engine.quant.quantize import quantize

    if scheme == "w8a8" and not i8avx2.supported():
        pytest.skip("i8avx2 needs AVX2")

    def ours(dtype: torch.dtype) -> list:
        mine = [p for p in quant_paths(dtype) if p.name.startswith(kernel)]
        return [p for p in mine if ("silu" in p.name) == fused] + [p for p in mine if ("silu" in p.name) != fused]

    monkeypatch.setattr(engine.kernels.bind, "quant_paths", ours)
    quantize(bf16_dir, tmp_path / "q", scheme, group_size=16)
    prompts = mixed_prompts(6)
    core = make_core(tmp_path / "q", dtype="float32", gemm_path="wbf16", decode_program="program")
    got = step_logits(core, prompts, 10)
    layers = make_core(tmp_path / "q", dtype="float32", gemm_path="wbf16", decode_program="layers")
    want = step_logits(layers, prompts, 10)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert "<=8" in _programs_run(core)
    programs = [c.program for c in core.runner.model.programs._choices.values() if c.program is not None]
    assert programs and all(p.python_calls == (0 if fused else len(core.runner.model.model.layers)) for p in programs)


@pytest.mark.parametrize("entry", ["fp16", "vnni"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_w4_programs_through_the_other_kernels_give_the_layers_logits_bit_for_bit(
    bf16_dir: Path, tmp_path: Path, entry: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W4A16 (group 32: whole fp16 spans, whole VNNI vectors) through w4fp16's or w4vnni's entries where they take
    the shape, forced and untimed as above (w4mm's behind them for a shape they refuse): the program calls the same
    entries and gives the layers' logits bit for bit."""
    from engine.quant.quantize import quantize

    if not (w4fp16 if entry == "fp16" else w4vnni).supported():
        pytest.skip(f"this CPU cannot run w4{entry} (AVX512-FP16; AVX512-VNNI with AVX512-BF16)")
    quantize(bf16_dir, tmp_path / "q", "w4a16", group_size=32)
    name = f"w4mm-{entry}"

    def ours(dtype: torch.dtype) -> list:
        paths = quant_paths(dtype)
        first = [p for p in paths if p.name.startswith(name) and ("silu" in p.name) == fused]
        rest = [p for p in paths if p.name.startswith(name) and "silu" not in p.name]
        return first + rest + [p for p in paths if p.name.startswith("w4mm") and p not in first + rest]

    monkeypatch.setattr(engine.kernels.bind, "quant_paths", ours)
    prompts = mixed_prompts(6)
    core = make_core(tmp_path / "q", dtype="bfloat16", gemm_path=BF16_GEMM, decode_program="program")
    got = step_logits(core, prompts, 10)
    layers = make_core(tmp_path / "q", dtype="bfloat16", gemm_path=BF16_GEMM, decode_program="layers")
    want = step_logits(layers, prompts, 10)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert "<=8" in _programs_run(core)
    chosen = {p for _, choice in core.runner.kernel_report.shapes.values() for p in choice.per_class}
    assert any(p.startswith(name) for p in chosen), chosen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", ["w8a8", "w4a16"])
def test_a_layer_whose_inputs_are_rotated_online_runs_whole_in_the_program(
    bf16_dir: Path, tmp_path: Path, scheme: str, dtype: str
) -> None:
    """`tianmen quantize --rotate` rotates down_proj's inputs online, in the layer's forward, before its plan: a
    program calling the plan's kernel directly skipped the rotation (wrong logits). It calls the layer instead,
    one Python call a layer, and gives the layers' logits bit for bit."""
    from engine.quant.quantize import quantize

    if dtype == "bfloat16" and BF16_GEMM is None:
        pytest.skip("this CPU has no bf16 GEMM kernel (AVX512-BF16 or AMX): no bf16 program to build")
    quantize(bf16_dir, tmp_path / scheme, scheme, group_size=16, rotate=True)
    prompts, gemm = mixed_prompts(4), BF16_GEMM if dtype == "bfloat16" else "wbf16"  # forced: every kernel bound
    core = make_core(tmp_path / scheme, dtype=dtype, gemm_path=gemm, decode_program="program")
    got = step_logits(core, prompts, 8)
    want = step_logits(make_core(tmp_path / scheme, dtype=dtype, gemm_path=gemm, decode_program="layers"), prompts, 8)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert "<=8" in _programs_run(core)
    layers = core.runner.model.model.layers
    assert all(getattr(layer.mlp.down_proj, "input_block", None) for layer in layers)  # the rotation is there
    programs = [c.program for c in core.runner.model.programs._choices.values() if c.program is not None]
    assert programs and all(p.python_calls >= len(layers) for p in programs)


@pytest.mark.parametrize("variant", ["float32", "float32-unfused"])
def test_programmed_greedy_tokens_are_transformers(
    bf16_dir: Path, hf_models: dict, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = mixed_prompts(6)
    core = _core(bf16_dir, variant, monkeypatch, decode_program="program")
    assert run_core(core, prompts, 32) == hf_expected(hf_models, bf16_dir, prompts, 32)  # (32: as cached by others)
    assert _programs_run(core)


def test_auto_times_both_ways_then_keeps_one_with_the_same_tokens(
    bf16_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first steps of a class alternate between the program and the layers (the same bits), then the faster
    stays; the choice is logged once."""
    prompt = {"solo": mixed_prompts(1)["r0"]}
    steps = 2 * (TRIALS + 1) + 8
    with caplog.at_level(logging.INFO, logger="engine.models.decode_program"):
        auto = run_core(_core(bf16_dir, "float32", monkeypatch), prompt, steps)
    assert auto == run_core(_core(bf16_dir, "float32", monkeypatch, decode_program="layers"), prompt, steps)
    chosen = [r.getMessage() for r in caplog.records if "one program call" in r.getMessage()]
    assert len(chosen) == 1 and chosen[0].startswith("decode steps of 1 rows"), chosen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemms_without_a_c_entry_run_as_the_layers_plans_between_the_c_calls(bf16_dir: Path, dtype: str) -> None:
    """oneDNN's GEMMs (forced here; what runs wherever oneDNN or torch's int4 GEMM won the timing) are no C entry
    points: the program stops for each layer's plan call between its C calls (four a layer), and its logits are
    the layers' bit for bit."""
    prompts = mixed_prompts(4)
    core = make_core(bf16_dir, dtype=dtype, gemm_path="onednn", decode_program="program")
    got = step_logits(core, prompts, 8)
    want = step_logits(make_core(bf16_dir, dtype=dtype, gemm_path="onednn", decode_program="layers"), prompts, 8)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert "<=8" in _programs_run(core)
    layers = len(core.runner.model.model.layers)
    programs = [c.program for c in core.runner.model.programs._choices.values() if c.program is not None]
    assert programs and all(p.python_calls == 4 * layers for p in programs)


def test_the_gemms_programs_call_are_timed_as_programs_call_them(bf16_dir: Path) -> None:
    """Each decoder layer's GEMMs (QKV, O, gate/up, down) are chosen by timing them as a program calls them at
    decode classes (engine.kernels.program_step), under shapes keyed apart; the LM head, which no program calls,
    and every GEMM of an engine that runs its steps through the layers are timed from Python."""
    runner = make_core(bf16_dir, dtype="float32", decode_program="auto").runner
    shapes = runner.kernel_report.shapes
    programmed = [s for s in shapes if s.endswith(" program")]
    assert len(programmed) == len(shapes) - 1  # every shape but the head's
    assert sum(shapes[s][0] for s in programmed) == 4 * len(runner.model.model.layers)  # four GEMMs a layer
    layers = make_core(bf16_dir, dtype="float32", decode_program="layers").runner.kernel_report.shapes
    assert not any(s.endswith(" program") for s in layers) and len(layers) == len(shapes)
