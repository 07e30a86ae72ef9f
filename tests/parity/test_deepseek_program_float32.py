"""DeepSeek-V2 decode steps as one C call in float32 math (what the AVX2 CPUs run; every CPU can): wbf16's GEMMs
and grouped calls over the bf16 checkpoint's weights, float32 rows, MLA's per-head W_UK / W_UV among the grouped
calls (kv_b_proj stays float32 in this math, and its values convert back to bf16 exactly:
engine.kernels.op_choice._bf16_exact); a quantized checkpoint's over its int4 rows (W4A16) or over each weight as
two exact bf16 halves (W8A8). The same logits, bit for bit, as the layers compute with the same kernels, at every
batch class a step has."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core import EngineCore
from engine.kernels.grouped import GroupedLinear
from tests.parity.conftest import make_core, mixed_prompts, step_logits
from tests.parity.test_deepseek_program import _programs, _save

# DeepSeek-V2's latent width (512 + 64): the float32 latent decode kernel is written for it alone
LATENT: dict[str, object] = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("deepseek-program-f32") / "q-lora", **LATENT)


def _same_as_the_layers(path: Path) -> tuple[dict[str, int], EngineCore]:
    """Steps of 6 rows with prefills between them, then one request alone, in float32 math: the program's logits
    equal the layers', bit for bit. Returns the batch classes that ran as programs (with their stops for Python)
    and the last programmed engine."""
    ran: dict[str, int] = {}
    for prompts in (mixed_prompts(6), {"solo": mixed_prompts(2)["r1"]}):
        core = make_core(path, dtype="float32", gemm_path="wbf16", decode_program="program")
        got = step_logits(core, prompts, 10)
        layers = make_core(path, dtype="float32", gemm_path="wbf16", decode_program="layers")
        want = step_logits(layers, prompts, 10)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        ran |= _programs(core)
    return ran, core


def test_a_float32_deepseek_step_gives_the_layers_logits_bit_for_bit(checkpoint: Path) -> None:
    ran, core = _same_as_the_layers(checkpoint)
    assert "<=8" in ran and "1" in ran and set(ran.values()) == {0}, ran  # no stop for Python: all in C
    mlas = [m for m in core.runner.model.modules() if type(m).__name__ == "MLAttention"]
    assert mlas and all(isinstance(m.absorbed[0], GroupedLinear) for m in mlas)
    assert all(isinstance(m.absorbed[1], GroupedLinear) and m.absorbed[1].kernel.dtype == torch.float32 for m in mlas)


def test_a_float32_checkpoint_keeps_bmm(tmp_path: Path) -> None:
    """kv_b_proj holding values bf16 cannot hold (the same shapes as above, saved in float32): no grouped call over
    rounded weights, the layers' bmm stays."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from tests.parity.test_deepseek_bf16 import CONFIG

    torch.manual_seed(7)
    DeepseekV2ForCausalLM(DeepseekV2Config(**(CONFIG | LATENT))).save_pretrained(tmp_path)  # float32 weights
    core = make_core(tmp_path, dtype="float32", gemm_path="wbf16")
    mlas = [m for m in core.runner.model.modules() if type(m).__name__ == "MLAttention"]
    assert mlas and all(m.absorbed is None for m in mlas)


def test_a_quantized_float32_deepseek_step_runs_mlas_products_over_the_int4_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W4A16 in float32 math: kv_b_proj's dequantized float32 values are no bf16 values, so W_UK and W_UV run over
    the checkpoint's own int4 rows through w4f32's grouped call at every batch class (W_UK's query scaled per latent
    group in float32, in C), and the decode steps run as programs with no stop for Python: the same logits, bit
    for bit, as the layers compute with the same calls."""
    import engine.kernels.bind
    from engine.quant.absorbed_key import GroupScaledKey
    from engine.quant.grouped import GroupedQuantLinear
    from engine.quant.paths import quant_paths
    from engine.quant.quantize import quantize

    def ours(dtype: torch.dtype) -> list:  # w4f32's entries first, the gated MLPs' fused ones before the rest
        paths = [p for p in quant_paths(dtype) if p.name.startswith("w4f32")]
        return sorted(paths, key=lambda p: "silu" not in p.name)

    monkeypatch.setattr(engine.kernels.bind, "quant_paths", ours)
    source = _save(tmp_path / "src", q_lora_rank=32, **LATENT)  # every K a multiple of the group size
    quantize(source, tmp_path / "w4a16", "w4a16", group_size=16)
    ran, core = _same_as_the_layers(tmp_path / "w4a16")
    assert "<=8" in ran and "1" in ran and set(ran.values()) == {0}, ran
    mlas = [m for m in core.runner.model.modules() if type(m).__name__ == "MLAttention"]
    assert mlas and all(isinstance(m.absorbed[0], GroupScaledKey) and m.absorbed[0].wide is None for m in mlas)
    assert all(isinstance(m.absorbed[1], GroupedQuantLinear) for m in mlas)
    assert all(m.absorbed[0].dtype == torch.float32 for m in mlas)


@pytest.mark.parametrize("kernel", ["i8avx2", "i8mm"])
def test_a_w8a8_float32_deepseek_step_runs_mlas_products_over_exact_bf16_halves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """W8A8 in float32 math: kv_b_proj's dequantized values (int8 times a bf16 scale) are no bf16 values but each
    is the sum of two (engine.kernels.grouped.bf16_pair), so W_UK and W_UV run through wbf16's grouped call over
    those halves, the rows fed twice; with the experts through i8avx2's grouped call, or on AVX512-VNNI CPUs
    i8mm's over float32 rows, the decode steps run as programs with no stop for Python, the same logits, bit for
    bit, as the layers compute with the same calls."""
    import engine.kernels.bind
    from engine.kernels import i8avx2, i8mm
    from engine.kernels.grouped import SplitGrouped
    from engine.layers.moe import MoE
    from engine.quant.paths import I8MMPath, I8MMSiluPath, _W8A8Path, quant_paths
    from engine.quant.quantize import quantize

    monkeypatch.setattr(_W8A8Path, "accepts", lambda *_: False)  # oneDNN's int8 GEMM: no grouped call
    if kernel == "i8avx2":  # every int8 layer through it (i8mm, where this CPU has it, comes first untimed)
        monkeypatch.setattr(I8MMPath, "accepts", lambda *_: False)
        monkeypatch.setattr(I8MMSiluPath, "accepts", lambda *_: False)
    else:
        if i8mm.kernel() is None:
            pytest.skip("this CPU has no AVX512-VNNI: i8mm does not run")
        monkeypatch.setattr(i8avx2, "kernel", lambda: None)
        monkeypatch.setattr(i8avx2, "kernel_without_prefetch", lambda: None)

    def ours(dtype: torch.dtype) -> list:
        paths = [p for p in quant_paths(dtype) if p.name.startswith(kernel)]
        return sorted(paths, key=lambda p: "silu" not in p.name)

    monkeypatch.setattr(engine.kernels.bind, "quant_paths", ours)
    source = _save(tmp_path / "src", q_lora_rank=32, **LATENT)
    quantize(source, tmp_path / "w8a8", "w8a8")
    ran, core = _same_as_the_layers(tmp_path / "w8a8")
    assert "<=8" in ran and "1" in ran and set(ran.values()) == {0}, ran
    mlas = [m for m in core.runner.model.modules() if type(m).__name__ == "MLAttention"]
    assert mlas and all(
        isinstance(m.absorbed[0], SplitGrouped) and isinstance(m.absorbed[1], SplitGrouped) for m in mlas
    )
    want = i8avx2.I8AVX2 if kernel == "i8avx2" else i8mm.I8MMFloat32Rows
    moes = [m for m in core.runner.model.modules() if isinstance(m, MoE)]
    assert moes and all(isinstance(m.grouped.gate_up.kernel, want) for m in moes)  # type: ignore[union-attr]
