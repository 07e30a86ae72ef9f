"""Decode steps as one C call (engine.models.llama_program) on bf16 Llama, Qwen2 (qkv bias) and Mistral models:
the same logits, bit for bit, as the layers compute with the same kernels, at every batch class a step has; the
greedy tokens transformers' bf16 choices (tests/parity/test_bf16_math.py runs that with the program forced too).

The program calls bf16 GEMM kernels (bf16mm, amxmm): CPUs without AVX512-BF16 have none, so no program builds
there, which the last test checks on every CPU."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.kernels import amxmm, bf16mm
from engine.models.decode_program import TRIALS
from tests.parity.conftest import make_core, mixed_prompts, run_core, step_logits

BF16_GEMM = "bf16mm" if bf16mm.supported() else "amxmm" if amxmm.supported() else None
needs_bf16_gemm = pytest.mark.skipif(not BF16_GEMM, reason="this CPU has no bf16 GEMM kernel (AVX512-BF16 or AMX)")


def _core(path: Path, **over: object):  # type: ignore[no-untyped-def]
    """A forced GEMM path binds every other kernel too, untimed (on these tiny shapes torch's RoPE may win the
    timing, and a program calls only kernels the layers run)."""
    return make_core(path, dtype="bfloat16", **{"gemm_path": BF16_GEMM or "auto", **over})


def _programs_run(core) -> list[str]:  # type: ignore[no-untyped-def]
    """The batch classes whose steps ran through a program."""
    from engine.kernels.select import CLASSES

    choices = core.runner.model.programs._choices
    return [CLASSES[c] for c, choice in choices.items() if choice.program is not None]


@needs_bf16_gemm
def test_a_programmed_step_gives_the_layers_logits_bit_for_bit(bf16_dir: Path) -> None:
    prompts = mixed_prompts(8)  # decode steps of 8 rows down to 1 as requests end, prefills between them
    programmed = _core(bf16_dir, decode_program="program")
    got = step_logits(programmed, prompts, 12)
    want = step_logits(_core(bf16_dir, decode_program="layers"), prompts, 12)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert set(_programs_run(programmed)) >= {"<=8"}
    solo = _core(bf16_dir, decode_program="program")
    one = {"solo": prompts["r1"]}
    assert all(torch.equal(a, b) for a, b in zip(step_logits(solo, one, 12), want_solo(bf16_dir, one), strict=True))
    assert "1" in _programs_run(solo)


def want_solo(path: Path, prompts: dict[str, list[int]]) -> list[torch.Tensor]:
    return step_logits(_core(path, decode_program="layers"), prompts, 12)


@needs_bf16_gemm
def test_auto_times_both_ways_then_keeps_one_with_the_same_tokens(
    bf16_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first steps of a class alternate between the program and the layers (the same bits), then the faster
    stays; the choice is logged once."""
    prompt = {"solo": mixed_prompts(1)["r0"]}
    steps = 2 * (TRIALS + 1) + 8
    with caplog.at_level(logging.INFO, logger="engine.models.decode_program"):
        auto = run_core(_core(bf16_dir), prompt, steps)
    assert auto == run_core(_core(bf16_dir, decode_program="layers"), prompt, steps)
    chosen = [r.getMessage() for r in caplog.records if "one program call" in r.getMessage()]
    assert len(chosen) == 1 and chosen[0].startswith("decode steps of 1 rows"), chosen


def test_without_a_bf16_gemm_kernel_no_program_builds_and_the_layers_run(bf16_dir: Path) -> None:
    """oneDNN's GEMMs (forced here; every GEMM on CPUs without AVX512-BF16) are not C entry points a program can
    call: every step runs through the layers, with the tokens they give."""
    prompts = mixed_prompts(3)
    core = _core(bf16_dir, gemm_path="onednn", decode_program="program")
    got = run_core(core, prompts, 8)
    assert _programs_run(core) == []
    assert got == run_core(_core(bf16_dir, gemm_path="onednn", decode_program="layers"), prompts, 8)
