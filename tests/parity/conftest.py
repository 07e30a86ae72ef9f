from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import EngineConfig
from engine.core import EngineCore
from engine.params import SamplingParams
from engine.request import Request

VOCAB = 512


def _save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_llama(path: Path, **over: object) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.update(over)
    torch.manual_seed(0)
    return _save(LlamaForCausalLM(LlamaConfig(**cfg)).float(), path)


def build_qwen2(path: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():  # random init leaves biases at zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return _save(model, path)


def build_mistral(path: Path) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,  # a multiple of 32, as the AMX decode attention needs: the parity suite runs it where it exists
        max_position_embeddings=512,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(2)
    return _save(MistralForCausalLM(cfg).float(), path)


BUILDERS = {"llama": build_llama, "qwen2": build_qwen2, "mistral": build_mistral}


@pytest.fixture(scope="session", params=list(BUILDERS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def bf16_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp(model_dir.name + "-bf16")
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(out)
    return out  # the same model saved as a bf16 checkpoint


@pytest.fixture(scope="session")
def hf_models() -> dict[Path, torch.nn.Module]:
    return {}


def hf_model(cache: dict[Path, torch.nn.Module], path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if path not in cache:
        cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return cache[path]


def assert_prefill_and_decode_logits_match(
    core: EngineCore, hf: torch.nn.Module, prompts: dict[str, list[int]]
) -> None:
    """Two steps of `core` over `prompts` (all prefilled in the first, each decoding its greedy token in the second)
    give transformers' last-position logits, to float32's rounding."""
    captured = step_logits(core, prompts, 2)
    for i, p in enumerate(prompts.values()):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(captured[0][i], ref, rtol=1e-4, atol=1e-4)  # prefill
    for i, p in enumerate(prompts.values()):  # the second step decoded them all through the cache
        with torch.no_grad():
            ref = hf(torch.tensor([p + [int(captured[0][i].argmax())]])).logits[0, -1]
        torch.testing.assert_close(captured[1][i], ref, rtol=1e-4, atol=1e-4)


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def make_core(path: Path, **over: object) -> EngineCore:
    cfg = dict(model=path, dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=512)
    cfg.update(over)
    return EngineCore(EngineConfig(**cfg))  # type: ignore[arg-type]


def run_core(
    core: EngineCore,
    prompts: dict[str, list[int]],
    n: int,
    arrivals: dict[int, list[str]] | None = None,
    salt: str | None = None,
) -> dict[str, list[int]]:
    """Run to completion; `arrivals` maps a step number to request ids added at that step (others at step 0)."""
    arrivals = arrivals or {0: list(prompts)}
    tokens: dict[str, list[int]] = {r: [] for r in prompts}
    step = 0
    while True:
        for rid in arrivals.get(step, []):
            p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            core.add_request(Request(rid, prompts[rid], p, cache_salt=salt))
        if not core.has_unfinished() and step > max(arrivals):
            break
        for out in core.step():
            tokens[out.req_id].extend(out.new_token_ids)
        step += 1
    return tokens


def step_logits(core: EngineCore, prompts: dict[str, list[int]], n: int) -> list[torch.Tensor]:
    """Run `prompts` for n tokens each and return the logits each step computed, [rows, vocab] per step."""
    captured: list[torch.Tensor] = []
    model = core.runner.model
    original = model.compute_logits
    model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]  # type: ignore[method-assign]
    run_core(core, prompts, n)
    return captured


def mixed_prompts(n: int = 8, seed: int = 0, prefix: list[int] | None = None) -> dict[str, list[int]]:
    """Prompts of different lengths (1 to 64 tokens), optionally behind a shared prefix."""
    rng = random.Random(seed)
    lengths = [3, 17, 33, 8, 64, 1, 40, 25][:n]
    return {f"r{i}": (prefix or []) + [rng.randrange(3, VOCAB) for _ in range(k)] for i, k in enumerate(lengths)}


def same_length_prompts(seed: int = 1) -> dict[str, list[int]]:
    """Runs of equal-length prompts, which the runner prefills as one attention batch per run."""
    rng = random.Random(seed)
    lengths = [24, 24, 24, 9, 9, 24, 1, 1]
    return {f"s{i}": [rng.randrange(3, VOCAB) for _ in range(k)] for i, k in enumerate(lengths)}


def hf_expected(cache: dict, path: Path, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    """transformers' greedy continuations; the same prompts recur across tests, so each is generated once."""
    model = hf_model(cache, path)
    for p in prompts.values():
        if (path, tuple(p)) not in cache:
            cache[path, tuple(p)] = hf_greedy(model, p, n)
    return {r: cache[path, tuple(p)] for r, p in prompts.items()}
