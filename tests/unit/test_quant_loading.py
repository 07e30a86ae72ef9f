"""GPTQ, AWQ and compressed-tensors checkpoints, written here from a tiny Llama / Qwen2, load into the engine
(merged q/k/v and gate/up shards included) and give the logits of the same weights dequantized into a plain
checkpoint; the modules swap as they should, and mismatches are refused."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ConfigError, ModelLoadError
from engine.layers.linear import Linear
from engine.layers.mlp import GatedMLP
from engine.loader import DirectoryFiles, load_model, read_json
from engine.models.registry import model_class
from engine.quant.layouts import to_weight
from engine.quant.modules import QuantLinear, quantize_modules
from engine.quant.quantize import pack_int4_words, quantize
from engine.quant.spec import QuantSpec, quant_spec
from tests.parity.conftest import build_llama, build_qwen2, make_core, mixed_prompts, step_logits
from tests.parity.test_deepseek import build_deepseek
from tests.unit.test_quant_formats import _as_int32, _awq_pack, _gptq_pack

G = 64


def _rtn_asym(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] → unsigned values [N, K], zero points [N, K/G] and fp16 scales [N, K/G]."""
    n, k = w.shape
    grouped = w.view(n, k // g, g)
    lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.round(grouped / scale.float()[..., None] + zero[..., None]).clamp(0, 15)
    return q.view(n, k).long(), zero.long(), scale


def _write(src: Path, dst: Path, fmt: str) -> None:
    """`src` rewritten as a `fmt` (gptq | awq | ct-asym) checkpoint in `dst`, and its dequantized twin beside."""
    state = load_file(str(src / "model.safetensors"))
    quant, dense = {}, {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if not (name.endswith("proj.weight") and ".layers." in name):
            quant[name] = dense[name] = w
            continue
        q, z, s = _rtn_asym(w.float(), G)
        dense[name] = ((q - z.repeat_interleave(G, 1)) * s.float().repeat_interleave(G, 1)).float()
        if fmt == "gptq":
            qweight, qzeros = _gptq_pack(q.T, z.T, v1=True)
            quant |= {f"{module}.g_idx": torch.arange(w.shape[1], dtype=torch.int32) // G}
        elif fmt == "awq":
            qweight, qzeros = _awq_pack(q.T, z.T)
        else:
            quant |= {f"{module}.weight_packed": pack_int4_words((q - 8).to(torch.int8)), f"{module}.weight_scale": s,
                      f"{module}.weight_shape": torch.tensor(list(w.shape))}  # fmt: skip
            quant[f"{module}.weight_zero_point"] = _as_int32(_pack_rows((z - 8).to(torch.int8)))
            continue
        quant |= {f"{module}.qweight": qweight, f"{module}.qzeros": qzeros, f"{module}.scales": s.T.contiguous()}
    cfg = json.loads((src / "config.json").read_text())
    qc: dict = {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False, "sym": False},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"},
        "ct-asym": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                        "num_bits": 4, "type": "int", "strategy": "group", "group_size": G, "symmetric": False}}}},
    }[fmt]  # fmt: skip
    for out, tensors, config in (
        (dst, quant, {**cfg, "quantization_config": qc}),
        (dst.with_name(dst.name + "-dense"), dense, cfg),
    ):
        out.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(config))


def _pack_rows(zp: torch.Tensor) -> torch.Tensor:
    """compressed-tensors packs zero points along the output dimension: words [N/8, K/G]."""
    return pack_int4_words(zp.T.contiguous()).T.long()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant-load")
    return {
        "llama": build_llama(root / "llama", hidden_size=128, intermediate_size=192),
        "qwen2": build_qwen2(root / "qwen2"),
    }


@pytest.mark.parametrize(
    ("model", "fmt"), [("llama", "gptq"), ("llama", "awq"), ("qwen2", "ct-asym"), ("qwen2", "gptq")]
)
def test_checkpoint_gives_the_logits_of_its_dequantized_weights(
    sources: dict[str, Path], tmp_path: Path, model: str, fmt: str
) -> None:
    _write(sources[model], tmp_path / fmt, fmt)
    prompts = mixed_prompts(3)
    core = make_core(tmp_path / fmt)
    assert core.config.quantization == "w4a16"
    assert all(isinstance(m, QuantLinear) for n, m in core.runner.model.named_modules() if n.endswith("proj"))
    got = step_logits(core, prompts, 3)
    want = step_logits(make_core(tmp_path / f"{fmt}-dense"), prompts, 3)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max().clamp_min(1.0)


def test_engine_config_insists_on_what_it_was_told(sources: dict[str, Path], tmp_path: Path) -> None:
    _write(sources["llama"], tmp_path / "awq", "awq")
    with pytest.raises(ConfigError, match="checkpoint holds w4a16"):
        make_core(tmp_path / "awq", quantization="w8a8")
    with pytest.raises(ConfigError, match="checkpoint holds none"):
        make_core(tmp_path / "awq-dense", quantization="w4a16")
    with pytest.raises(ConfigError, match="quantization must be one of"):
        make_core(tmp_path / "awq", quantization="int3")


def test_a_missing_shard_is_named(sources: dict[str, Path], tmp_path: Path) -> None:
    _write(sources["llama"], tmp_path / "gptq", "gptq")
    path = tmp_path / "gptq" / "model.safetensors"
    state = load_file(str(path))
    del state["model.layers.1.self_attn.k_proj.qzeros"]
    save_file(state, str(path))
    files = DirectoryFiles(tmp_path / "gptq")
    with pytest.raises(ModelLoadError, match=r"lacks weights: model\.layers\.1\.self_attn\.k_proj\.qzeros"):
        load_model(files, read_json(files, "config.json"), torch.device("cpu"), torch.float32)


def test_group_size_must_divide_the_inputs(sources: dict[str, Path], tmp_path: Path) -> None:
    _write(sources["llama"], tmp_path / "awq", "awq")
    cfg = json.loads((tmp_path / "awq" / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 96
    (tmp_path / "awq" / "config.json").write_text(json.dumps(cfg))
    files = DirectoryFiles(tmp_path / "awq")
    with pytest.raises(ModelLoadError, match="groups of 96"):
        load_model(files, cfg, torch.device("cpu"), torch.float32)


DEEPSEEK = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "max_position_embeddings": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
}  # fmt: skip


def test_deepseek_swaps_projections_and_experts_but_not_routers_norms_or_the_head() -> None:
    model = model_class(DEEPSEEK)(DEEPSEEK)
    n = quantize_modules(model, QuantSpec("w4a16", "awq", 16, ignore=["lm_head"]))
    swapped = {name for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert n == len(swapped) and "model.layers.1.mlp.experts.3.down_proj" in swapped
    assert (
        "model.layers.1.mlp.shared_experts.gate_up_proj" in swapped and "model.layers.0.self_attn.kv_b_proj" in swapped
    )
    assert not any("norm" in s or "embed" in s or s.endswith(".gate") for s in swapped)
    assert isinstance(model.lm_head, Linear) and not isinstance(model.lm_head, QuantLinear)
    assert not model.model.layers[0].self_attn.kv_b_proj.packable  # read as W_UK / W_UV: dequantized at load


def test_a_layer_quantized_only_in_part_is_refused() -> None:
    model = model_class(DEEPSEEK)(DEEPSEEK)
    spec = QuantSpec("w8a8", "compressed-tensors", ignore=["re:.*layers.0.mlp.up_proj"])
    with pytest.raises(ModelLoadError, match="quantizes only some of"):
        quantize_modules(model, spec)


def _dequantized_twin(qdir: Path, out: Path) -> Path:
    """The quantized checkpoint with every quantized layer dequantized back into a plain float32 `weight`."""
    cfg = json.loads((qdir / "config.json").read_text())
    spec = quant_spec(cfg)
    assert spec is not None
    state = load_file(str(qdir / "model.safetensors"))
    dense = {k: v for k, v in state.items() if not k.rpartition(".")[2].startswith("weight_") and k.endswith("weight")}
    dense |= {k: v for k, v in state.items() if k.endswith("bias") or "e_score" in k}
    for key in [k for k in state if k.endswith(".weight_scale")]:
        module = key.removesuffix(".weight_scale")
        parts = {k.removeprefix(module + "."): v for k, v in state.items() if k.startswith(module + ".")}
        n, k = parts["weight_shape"].tolist() if "weight_shape" in parts else parts["weight"].shape
        dense[f"{module}.weight"] = to_weight(spec, parts, n, k).float()
    out.mkdir()
    save_file(dense, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    return out


@pytest.mark.parametrize(("name", "group"), [("v2-lite", 32), ("v2-grouped", 8)])
def test_deepseek_w4a16_gives_the_logits_of_its_dequantized_weights(tmp_path: Path, name: str, group: int) -> None:
    src = build_deepseek(name, tmp_path / "src")
    report = quantize(src, tmp_path / "q", "w4a16", group)
    assert "model.layers.1.mlp.gate" in report.kept  # the router stays float
    twin = _dequantized_twin(tmp_path / "q", tmp_path / "dense")
    core = make_core(tmp_path / "q")
    mla = core.runner.model.model.layers[1].self_attn
    assert isinstance(mla.o_proj, QuantLinear) and mla.kv_b_proj.weight.shape == (4 * 32, 32)  # dequantized
    assert isinstance(core.runner.model.model.layers[1].mlp.experts[0].down_proj, QuantLinear)
    prompts = mixed_prompts(3)
    got, want = step_logits(core, prompts, 3), step_logits(make_core(twin), prompts, 3)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max().clamp_min(1.0)


def _keep_input(inputs: dict[str, torch.Tensor], name: str, _m: object, args: tuple, _out: object) -> None:
    inputs.setdefault(name, args[0].clone())


def test_deepseek_w8a8_layers_give_the_reference_on_their_real_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every quantized layer of a DeepSeek (MLA projections, routed and shared experts), fed what it sees in a
    prefill, answers as the reference (gemm_path=torch: dequantize, then matmul). Layer by layer: activations
    are quantized in every layer, so a rounding difference far below float tolerance in one layer tips the odd
    int8 step in the next, and whole-model logits cannot be compared at float tolerance. The routed experts run a
    call each here (their own GEMM plans); their grouped call has its own tests (test_grouped_quant*.py)."""
    from engine.kernels import op_choice

    monkeypatch.setattr(op_choice, "choose_quant_experts", lambda *_: None)
    quantize(build_deepseek("v2-grouped", tmp_path / "src"), tmp_path / "q", "w8a8")
    fast, ref = make_core(tmp_path / "q"), make_core(tmp_path / "q", gemm_path="torch")
    shapes = ref.runner.kernel_report.shapes
    assert {n for shape, (_, choice) in shapes.items() if "w8a8" in shape for n in choice.per_class} == {
        "torch-dequant"
    }
    assert any(n != "torch-dequant" for _, (_, c) in fast.runner.kernel_report.shapes.items() for n in c.per_class)
    inputs: dict[str, torch.Tensor] = {}
    ref_modules = dict(ref.runner.model.named_modules())
    for name, m in fast.runner.model.named_modules():
        if (isinstance(m, QuantLinear) and m.plan is not None) or isinstance(m, GatedMLP):
            m.register_forward_hook(partial(_keep_input, inputs, name))
    step_logits(fast, mixed_prompts(6), 1)
    assert any(".experts." in n for n in inputs) and any("self_attn.o_proj" in n for n in inputs)
    fast_modules = dict(fast.runner.model.named_modules())
    for name, x in inputs.items():
        a, b = fast_modules[name], ref_modules[name]
        got, want = (a.gate_up_act(x), b.gate_up_act(x)) if isinstance(a, GatedMLP) else (a(x), b(x))
        assert (got - want).abs().max() <= 1e-4 * want.abs().max().clamp_min(1.0), name
