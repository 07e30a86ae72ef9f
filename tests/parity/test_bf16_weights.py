"""bf16 checkpoints computed in float32 through the bf16-weight kernel (engine.kernels.wbf16) against
transformers loading the same files in float32: the weights widen exactly, so the results must agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.layers.linear import Linear
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


@pytest.fixture(scope="session")
def bf16_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp(model_dir.name + "-bf16")
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(out)
    return out


def _linears(core) -> list[Linear]:  # type: ignore[no-untyped-def]
    return [m for m in core.runner.model.modules() if isinstance(m, Linear)]


def test_kernel_holds_every_weight_as_bf16(bf16_dir: Path) -> None:
    core = make_core(bf16_dir)
    linears = _linears(core)
    assert linears and all(m.wbf16 is not None and m.packed.dtype == torch.bfloat16 for m in linears)
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


@pytest.mark.parametrize("prompts", [mixed_prompts(), same_length_prompts()], ids=["mixed", "same-length"])
def test_greedy_batch_matches_generate(bf16_dir: Path, hf_models: dict, prompts: dict[str, list[int]]) -> None:
    expected = hf_expected(hf_models, bf16_dir, prompts, NEW_TOKENS)
    assert run_core(make_core(bf16_dir), prompts, NEW_TOKENS) == expected


def test_compact_weights_off_widens_to_float32_with_the_same_tokens(bf16_dir: Path, hf_models: dict) -> None:
    core = make_core(bf16_dir, compact_weights=False)
    assert not any(m.wbf16 is not None for m in _linears(core))
    assert core.runner.model.model.embed_tokens.weight.dtype == torch.float32
    prompts = mixed_prompts(4)
    assert run_core(core, prompts, NEW_TOKENS) == hf_expected(hf_models, bf16_dir, prompts, NEW_TOKENS)
