"""DeepSeek-V2 decode steps as one C call (engine.models.deepseek_program): the same logits, bit for bit, as the
layers compute with the same kernels (bf16 math through bf16mm or amxmm, and W4A16 / W8A8 experts and projections),
at every batch class a step has; with and without a query LoRA (V2-Lite has none), greedy, group-limited (V2) and
sigmoid (V3) routing; greedy tokens as near transformers' as the layers' are (test_deepseek_bf16 holds the layers to
that)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.kernels.bind
from engine.kernels import amxmm, bf16mm, i8mm
from engine.layers.moe import MoE
from engine.quant.paths import quant_paths
from tests.parity.conftest import make_core, mixed_prompts, step_logits
from tests.parity.test_deepseek_bf16 import CONFIG

GEMM = "bf16mm" if bf16mm.supported() else "amxmm" if amxmm.supported() else None
pytestmark = pytest.mark.skipif(GEMM is None, reason="no bf16 GEMM kernel (AVX512-BF16 or AMX): no bf16 program")


def _save(path: Path, v3: bool = False, **over: object) -> Path:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(7)
    config_cls, model_cls = (
        (DeepseekV3Config, DeepseekV3ForCausalLM) if v3 else (DeepseekV2Config, DeepseekV2ForCausalLM)
    )
    model = model_cls(config_cls(**(CONFIG | over)))
    with torch.no_grad():  # random init leaves V3's correction bias at zero: make it count
        for n, t in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                t.normal_(0, 0.1)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek-program")
    return {
        "q-lora": _save(root / "q-lora"),
        "lite": _save(root / "lite", q_lora_rank=None),
        "group-limited": _save(root / "grouped", topk_method="group_limited_greedy", n_group=4, topk_group=2),
        "v3": _save(root / "v3", v3=True, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
        "quantizable": _save(root / "quantizable", q_lora_rank=32),  # every K a multiple of the group size
    }


def _programs(core) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """The batch classes whose steps ran through a program, with each program's stops for Python."""
    from engine.kernels.select import CLASSES

    choices = core.runner.model.programs._choices.items()
    return {CLASSES[c]: ch.program.python_calls for c, ch in choices if ch.program is not None}


def _same(path: Path, n: int = 10, **over: object) -> dict[str, int]:
    """Steps of 6 rows, prefills between them, then one request alone: the program's logits and the layers'."""
    ran: dict[str, int] = {}
    for prompts in (mixed_prompts(6), {"solo": mixed_prompts(2)["r1"]}):
        core = make_core(path, dtype="bfloat16", gemm_path=GEMM, decode_program="program", **over)
        got = step_logits(core, prompts, n)
        layers = make_core(path, dtype="bfloat16", gemm_path=GEMM, decode_program="layers", **over)
        want = step_logits(layers, prompts, n)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        ran |= _programs(core)
    return ran


@pytest.mark.parametrize("name", ["q-lora", "lite", "group-limited", "v3"])
def test_a_programmed_deepseek_step_gives_the_layers_logits_bit_for_bit(
    checkpoints: dict[str, Path], name: str
) -> None:
    ran = _same(checkpoints[name])
    assert "<=8" in ran and "1" in ran and set(ran.values()) == {0}, ran  # no stop for Python: all in C


def test_the_layers_route_in_c_where_the_program_does(checkpoints: dict[str, Path]) -> None:
    """The MoE layers route through the same C pass as the program (so both take the same experts), and the
    forced configuration binds it."""
    core = make_core(checkpoints["q-lora"], dtype="bfloat16", gemm_path=GEMM)
    moes = [m for m in core.runner.model.modules() if isinstance(m, MoE)]
    assert moes and all(m.router is not None for m in moes)


QUANT = {"w8a8": i8mm.supported() and bf16mm.supported(), "w4a16": bf16mm.supported()}


@pytest.mark.parametrize("scheme", list(QUANT))
def test_quantized_deepseek_programs_give_the_layers_logits_bit_for_bit(
    checkpoints: dict[str, Path], tmp_path: Path, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quantized projections through their kernels' entries (the gated MLPs' fused ones), the routed experts and
    MLA's W_UV (the checkpoint's quantized value rows of kv_b_proj; with W4A16 W_UK too, over its key rows, at one
    row) through the grouped W4A16 / W8A8 entries (forced, untimed: the first accepting kernel runs): no stop for
    Python."""
    if not QUANT[scheme]:
        pytest.skip(f"this CPU has no {scheme} kernel a program calls (i8mm: AVX512-VNNI; w4mm: AVX512-BF16)")
    from engine.quant.quantize import quantize

    kernel = "i8mm" if scheme == "w8a8" else "w4mm"

    def ours(dtype: torch.dtype) -> list:  # the gated MLPs' fused entries first
        paths = [p for p in quant_paths(dtype) if p.name.startswith(kernel)]
        return sorted(paths, key=lambda p: "silu" not in p.name)

    monkeypatch.setattr(engine.kernels.bind, "quant_paths", ours)
    quantize(checkpoints["quantizable"], tmp_path / scheme, scheme, group_size=16)
    ran = _same(tmp_path / scheme)
    assert "<=8" in ran and "1" in ran and set(ran.values()) == {0}, ran
    core = make_core(tmp_path / scheme, dtype="bfloat16", gemm_path=GEMM, decode_program="program")
    mlas = [m for m in core.runner.model.modules() if type(m).__name__ == "MLAttention"]
    assert mlas and all(type(m.absorbed[1]).__name__ == "GroupedQuantLinear" for m in mlas)
    # W4A16: W_UK over the checkpoint's int4 key rows too, the query scaled per latent group in C
    want_key = "GroupScaledKey" if scheme == "w4a16" else "GroupedLinear"
    assert all(type(m.absorbed[0]).__name__ == want_key for m in mlas)


def test_gemms_without_a_c_entry_run_as_the_layers_plans_between_the_c_calls(checkpoints: dict[str, Path]) -> None:
    """oneDNN's GEMMs have no C entry: each of MLA's projections and the gated MLPs' GEMMs stops the program for its
    plan's own call, and the logits stay the layers'."""
    prompts = mixed_prompts(6)
    core = make_core(checkpoints["q-lora"], dtype="bfloat16", gemm_path="onednn", decode_program="program")
    got = step_logits(core, prompts, 6)
    layers = make_core(checkpoints["q-lora"], dtype="bfloat16", gemm_path="onednn", decode_program="layers")
    want = step_logits(layers, prompts, 6)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    ran = _programs(core)
    # per layer: the input, query and O projections, then two GEMMs of the dense MLP or of the shared experts
    assert ran and all(stops == 5 * CONFIG["num_hidden_layers"] for stops in ran.values()), ran
