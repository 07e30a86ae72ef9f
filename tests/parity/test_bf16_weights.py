"""bf16 checkpoints computed in float32 through the bf16-weight kernel (engine.kernels.wbf16) against
transformers loading the same files in float32: the weights widen exactly, so the results must agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.layers.linear import Linear
from engine.layers.mlp import GatedMLP
from tests.parity.conftest import (
    hf_expected,
    hf_model,
    make_core,
    mixed_prompts,
    run_core,
    same_length_prompts,
    step_logits,
)

NEW_TOKENS = 32


def _linears(core) -> list[Linear]:  # type: ignore[no-untyped-def]
    return [m for m in core.runner.model.modules() if isinstance(m, Linear)]


def test_kernel_holds_every_weight_as_bf16(bf16_dir: Path) -> None:
    core = make_core(bf16_dir, gemm_path="wbf16")
    mlps = [m for m in core.runner.model.modules() if isinstance(m, GatedMLP)]
    # the gated MLPs' [gate; up] projection through the fused entry (silu(gate) * up in its epilogue)
    assert mlps and all(m.gate_up_act is not None and set(m.gate_up_act.names) == {"wbf16-silu"} for m in mlps)
    linears = [m for m in _linears(core) if not any(m is g.gate_up_proj for g in mlps)]
    assert linears and all(m.plan is not None and set(m.plan.names) == {"wbf16"} for m in linears)
    assert core.runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert core.runner.model.model.norm.weight.dtype == torch.float32  # the math stays float32


def test_prefill_logits_match(bf16_dir: Path, hf_models: dict) -> None:
    prompts = mixed_prompts(3)
    captured = step_logits(make_core(bf16_dir), prompts, 1)
    hf = hf_model(hf_models, bf16_dir)
    for i, p in enumerate(prompts.values()):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(captured[0][i], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gemm_path", ["auto", "wbf16"])
@pytest.mark.parametrize("prompts", [mixed_prompts(), same_length_prompts()], ids=["mixed", "same-length"])
def test_greedy_batch_matches_generate(
    bf16_dir: Path, hf_models: dict, prompts: dict[str, list[int]], gemm_path: str
) -> None:
    expected = hf_expected(hf_models, bf16_dir, prompts, NEW_TOKENS)
    assert run_core(make_core(bf16_dir, gemm_path=gemm_path), prompts, NEW_TOKENS) == expected


def test_compact_weights_off_widens_to_float32_with_the_same_tokens(bf16_dir: Path, hf_models: dict) -> None:
    core = make_core(bf16_dir, compact_weights=False)
    assert not any(m.plan is not None and "wbf16" in m.plan.names for m in _linears(core))
    assert core.runner.model.model.embed_tokens.weight.dtype == torch.float32
    prompts = mixed_prompts(4)
    assert run_core(core, prompts, NEW_TOKENS) == hf_expected(hf_models, bf16_dir, prompts, NEW_TOKENS)


def _load(path: Path, bf16_storage: bool) -> torch.nn.Module:
    from engine.loader import DirectoryFiles, load_model, read_json

    files = DirectoryFiles(path)
    return load_model(files, read_json(files, "config.json"), torch.device("cpu"), torch.float32, bf16_storage)


def test_loader_never_widens_a_bf16_checkpoint(bf16_dir: Path) -> None:
    model = _load(bf16_dir, bf16_storage=True)
    weights = [m.weight for m in model.modules() if isinstance(m, (Linear, torch.nn.Embedding))]
    assert weights and all(w.dtype == torch.bfloat16 for w in weights)
    assert model.model.norm.weight.dtype == torch.float32
    widened = _load(bf16_dir, bf16_storage=False).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t.float(), widened[name]), name  # exact: bf16 widens losslessly


def test_loader_widens_what_the_checkpoint_holds_in_float32(model_dir: Path) -> None:
    """A float32 checkpoint under bf16_storage loads exactly as without it: nothing is rounded to bf16."""
    got, want = _load(model_dir, bf16_storage=True).state_dict(), _load(model_dir, bf16_storage=False).state_dict()
    assert got.keys() == want.keys()
    for name, t in got.items():
        assert t.dtype == torch.float32 and torch.equal(t, want[name]), name
