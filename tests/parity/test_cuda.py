"""The engine on a CUDA device: float32 against transformers and against the CPU engine, bf16 against transformers'
bf16 choices (run on a GPU machine; skipped without CUDA, so never in CI).

No engine.kernels code runs on CUDA (each kernel declines tensors that are not on the CPU): these check the
torch paths the engine takes there (paged KV cache, prefix caching, chunked prefill, preemption, MLA, MoE, the
sampler) on the device, where float32 sums run in another order than on the CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.core import EngineCore
from engine.quant.quantize import quantize
from tests.parity.conftest import (
    build_llama,
    build_mistral,
    build_qwen2,
    hf_model,
    make_core,
    mixed_prompts,
    run_core,
    step_logits,
)
from tests.parity.test_bf16_math import NEAR_TIE
from tests.parity.test_deepseek import build_deepseek
from tests.parity.test_tensor_parallel import _run
from tests.parity.test_tensor_parallel_quant import _logits_and_tokens
from tests.unit.test_quant_loading import _write

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NEW_TOKENS = 24
MODELS = {
    "llama": build_llama,
    "qwen2": build_qwen2,  # QKV biases, tied embeddings, 1 KV head
    "mistral": build_mistral,
    "deepseek-v2-grouped": lambda p: build_deepseek("v2-grouped", p),  # MLA with q_lora, group-limited MoE, YaRN
    "deepseek-v3": lambda p: build_deepseek("v3", p),  # sigmoid routing with correction bias
}


@pytest.fixture(scope="module", params=list(MODELS))
def path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return MODELS[request.param](tmp_path_factory.mktemp(request.param))


def _on_cuda(core: EngineCore) -> EngineCore:
    assert core.runner.device.type == "cuda"
    assert next(core.runner.model.parameters()).device.type == "cuda"
    return core


def test_prefill_and_decode_logits_match_transformers(path: Path, hf_models: dict) -> None:
    prompts = mixed_prompts(3)
    captured = [t.cpu() for t in step_logits(_on_cuda(make_core(path, device="cuda")), prompts, 2)]
    hf = hf_model(hf_models, path)  # on the CPU, float32: the reference
    for i, p in enumerate(prompts.values()):
        with torch.no_grad():
            first = hf(torch.tensor([p])).logits[0, -1]
            second = hf(torch.tensor([p + [int(captured[0][i].argmax())]])).logits[0, -1]
        torch.testing.assert_close(captured[0][i], first, rtol=1e-4, atol=1e-4)  # prefill
        torch.testing.assert_close(captured[1][i], second, rtol=1e-4, atol=1e-4)  # decode through the paged cache


def test_cuda_matches_the_cpu_engine_through_prefix_hits_chunks_and_preemption(path: Path) -> None:
    """The tensor-parallel suite's run (a shared prefix cached, then hit; 32-token chunks; too few blocks for every
    sequence at once) on the GPU and on the CPU: the same tokens, and logits step by step."""
    cfg = dict(max_num_seqs=5, max_num_batched_tokens=32, block_size=8, max_model_len=160)
    per_block = make_core(path, **cfg).runner.kv_bytes_per_block()
    cpu = make_core(path, **cfg, kv_cache_bytes=per_block * 26)
    gpu = _on_cuda(make_core(path, **cfg, device="cuda", kv_cache_bytes=per_block * 26))
    assert cpu.block_manager.num_blocks == gpu.block_manager.num_blocks == 26
    tokens1, logits1, _ = _run(cpu)
    tokens2, logits2, scheds = _run(gpu)
    assert tokens2 == tokens1
    assert len(logits2) == len(logits1)
    for a, b in zip(logits1, logits2):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4)
    stats = gpu.stats()
    assert stats["prefix_cache_hits"] >= 5 * 40 // 8 * 8
    assert stats["preemptions_total"] > 0
    assert any(len(q.token_ids) > 1 and q.start > 0 for sched in scheds for q in sched.seqs)


def test_bf16_greedy_tokens_are_transformers_bf16_choices(bf16_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf16 = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16).eval().cuda()
    prompts = mixed_prompts()
    ours = run_core(_on_cuda(make_core(bf16_dir, dtype="bfloat16", device="cuda")), prompts, NEW_TOKENS)
    for rid, prompt in prompts.items():
        assert len(ours[rid]) == NEW_TOKENS
        with torch.no_grad():  # transformers' logits at every position we sampled, given our tokens before it
            ids = torch.tensor([prompt + ours[rid]], device="cuda")
            logits = hf16(ids).logits[0, len(prompt) - 1 : -1].float().cpu()
        chosen = logits.gather(1, torch.tensor(ours[rid])[:, None])[:, 0]
        gap = (logits.max(1).values - chosen) / logits.abs().max(1).values
        assert gap.max() <= NEAR_TIE, f"{rid}: token {int(gap.argmax())} trails transformers' choice by {gap.max():.3g}"


def test_sampling_with_a_seed_repeats_on_the_device(path: Path) -> None:
    from engine.params import SamplingParams
    from engine.request import Request

    def sample() -> list[int]:
        core = make_core(path, device="cuda")
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
        core.add_request(Request("s", mixed_prompts(1)["r0"], params))
        out: list[int] = []
        while core.has_unfinished():
            for o in core.step():
                out.extend(o.new_token_ids)
        return out

    first = sample()
    assert len(first) == NEW_TOKENS and first == sample()


def _tianmen(scheme: str, build: Callable[[Path], Path], **kw: object) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        quantize(build(tmp / "src"), tmp / "q", scheme, group_size=8, **kw)
        return tmp / "q"

    return make


def _other(fmt: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:  # a GPTQ / AWQ / asymmetric compressed-tensors checkpoint (groups of 64)
        _write(build_llama(tmp / "src", hidden_size=128, intermediate_size=256), tmp / "q", fmt)
        return tmp / "q"

    return make


QUANTIZED = {
    "w4a16-qwen2": _tianmen("w4a16", build_qwen2),
    "w4a16-deepseek-v3": _tianmen("w4a16", lambda p: build_deepseek("v3", p)),
    "w4a16-asym-llama": _tianmen("w4a16", build_llama, symmetric=False),
    "w4a16-rotated-qwen2": _tianmen("w4a16", build_qwen2, rotate=True),  # Hadamard on down_proj's inputs online
    "gptq": _other("gptq"),
    "awq": _other("awq"),
    "ct-asym": _other("ct-asym"),
}


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_checkpoints_give_the_cpu_engine_s_logits_and_tokens(tmp_path: Path, name: str) -> None:
    """W4A16 checkpoints on the GPU (torch's path over the same int weights, unpacked on the device) against the
    CPU engine's kernels: only float rounding differs."""
    path = QUANTIZED[name](tmp_path)
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=8, max_model_len=160)
    cpu, gpu = (make_core(path, **cfg, device=device) for device in ("cpu", "cuda"))
    assert cpu.config.quantization == _on_cuda(gpu).config.quantization != "none"
    logits1, tokens1 = _logits_and_tokens(cpu)
    logits2, tokens2 = _logits_and_tokens(gpu)
    assert tokens2 == tokens1
    assert len(logits2) == len(logits1)
    for a, b in zip(logits1, logits2, strict=True):
        err = (a - b.cpu()).abs().max() / a.abs().max()
        assert err <= 1e-4, float(err)


@pytest.mark.parametrize("model", ["qwen2", "deepseek-v3"])
def test_w8a8_on_the_gpu_is_as_close_to_the_float_model_as_on_the_cpu(tmp_path: Path, model: str) -> None:
    """Each token's int8 scale and rounding follow its activations, which float sums in another order move by an
    ulp: a value on a rounding boundary lands one step over, so the GPU's W8A8 logits are not the CPU's to float
    rounding (measured on an H200: 0.5% of the largest logit apart, and greedy tokens part on these tiny random
    models). What must hold: the GPU's are as close to the unquantized model's as the CPU's."""
    src = (build_qwen2 if model == "qwen2" else lambda p: build_deepseek("v3", p))(tmp_path / "src")
    quantize(src, tmp_path / "q", "w8a8")
    prompts = mixed_prompts(4)
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=160)
    want = step_logits(make_core(src, **cfg), prompts, 1)[0]  # the prompts' prefill: the same inputs for all
    cpu = step_logits(make_core(tmp_path / "q", **cfg), prompts, 1)[0]
    gpu = step_logits(_on_cuda(make_core(tmp_path / "q", **cfg, device="cuda")), prompts, 1)[0].cpu()
    err_cpu, err_gpu = (cpu - want).abs().max(), (gpu - want).abs().max()
    assert err_cpu > 0 and err_gpu <= 1.5 * err_cpu, (float(err_cpu), float(err_gpu))
