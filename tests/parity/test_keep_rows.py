"""The last decoder layer's MLP runs on the rows a step samples only (engine.context.AttentionContext.keep_rows):
a prompt's other rows only fill the cache, which the attention before it has done. Logits stay transformers',
prompts chunked over several steps still decode right, steps a decode program may run keep every row (so program
and layers agree), and the calibrations' engine (`every_row`) still sees every position."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.layers.moe import MoE
from engine.quant.calibrate import float_core
from tests.parity.conftest import (
    assert_prefill_and_decode_logits_match,
    build_llama,
    hf_expected,
    hf_model,
    make_core,
    mixed_prompts,
    run_core,
)
from tests.parity.test_deepseek import build_deepseek


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("keep-rows"), num_hidden_layers=3)


def _core(path: Path, in_place: int = 0, **over: object):  # type: ignore[no-untyped-def]
    """An engine whose prompts of more than `in_place` tokens go through the prefill attention (not as decode rows:
    ModelRunner.prefill_in_place, measured otherwise)."""
    core = make_core(path, **over)
    core.runner.prefill_in_place = in_place
    return core


def _rows_into_last_mlp(core) -> list[int]:  # type: ignore[no-untyped-def]
    """Rows of each call into the last layer's MLP, recorded."""
    seen: list[int] = []
    last = core.runner.model.model.layers[-1]
    last.mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    return seen


def test_a_prefill_runs_the_last_mlp_on_its_sampled_rows_and_keeps_transformers_logits(
    llama: Path, hf_models: dict
) -> None:
    prompts = {f"p{i}": [3 + (7 * i + j) % 500 for j in range(40 + 9 * i)] for i in range(3)}  # 40-58 tokens
    core = _core(llama, decode_program="layers")  # (a program's steps would pass by the hook)
    seen = _rows_into_last_mlp(core)
    assert_prefill_and_decode_logits_match(core, hf_model(hf_models, llama), prompts)
    assert seen[:2] == [3, 3], seen  # the prefill step: 3 sampled rows of 147; the decode step: 3


def test_a_prompt_chunked_over_steps_skips_the_last_mlp_until_its_last_chunk(llama: Path, hf_models: dict) -> None:
    prompt = {"long": [3 + (5 * j) % 500 for j in range(150)]}
    core = _core(llama, max_num_batched_tokens=64, decode_program="layers")  # chunks of 64, 64 and 22 tokens
    seen = _rows_into_last_mlp(core)
    assert run_core(core, prompt, 6) == hf_expected(hf_models, llama, prompt, 6)
    assert seen == [1] * 6, seen  # the first two chunks sampled nothing: the MLP never ran for them


def test_steps_a_program_may_run_and_the_calibrations_keep_every_row(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts short enough to attend as decode rows make steps a program may run: every row is kept, whichever way
    the step runs. The calibrations' engine keeps every row of its prefill."""
    import engine.model_runner

    in_place, through_prefill = _core(llama, in_place=64, decode_program="program"), _core(llama)
    kept: list[object] = []  # each step's keep_rows, from here on (the engines' start-up steps are done)
    set_context = engine.model_runner.set_context
    monkeypatch.setattr(engine.model_runner, "set_context", lambda ctx: kept.append(ctx.keep_rows) or set_context(ctx))
    run_core(in_place, mixed_prompts(4), 2)
    assert kept == [None, None]  # 4 prompts of 3-33 tokens in place, then 4 decodes
    kept.clear()
    run_core(through_prefill, mixed_prompts(4), 2)
    assert len(kept) == 2 and kept[1] is None  # the prefill step kept each prompt's last row (laid out shortest first)
    assert kept[0] is not None and kept[0].tolist() == [2, 27, 60, 10]  # read in the requests' order
    calib = float_core(llama, 64)
    assert calib.runner.every_row
    seen = _rows_into_last_mlp(calib)
    run_core(calib, {"c": list(range(3, 43))}, 1)
    assert seen[0] == 40, seen


def test_deepseeks_last_moe_layer_runs_on_the_sampled_rows(tmp_path: Path, hf_models: dict) -> None:
    path = build_deepseek("v3", tmp_path / "v3")
    prompts = {f"p{i}": [3 + (11 * i + j) % 500 for j in range(30 + 5 * i)] for i in range(2)}
    core = _core(path, decode_program="layers")
    last = core.runner.model.model.layers[-1].mlp
    assert isinstance(last, MoE)
    seen: list[int] = []
    last.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    assert_prefill_and_decode_logits_match(core, hf_model(hf_models, path), prompts)
    assert seen[:2] == [2, 2], seen
