"""A benchmark shape's random checkpoint as a float16 GGUF file, for llama.cpp to quantize and run (the peer of
benchmarks.throughput --llamacpp).

Only the Llama family (llama, qwen2): GGUF's tensor names are engine.gguf_import's, read the other way. The shapes
carry no tokenizer (the benchmarks feed token ids), but llama.cpp will not load a model without a vocabulary:
placeholder tokens ("t0", "t1", ...) as a byte-pair vocabulary with one idle merge, which nothing here tokenizes.
The weights are random and only speed is measured, so Llama's Q/K rows are not permuted as llama.cpp's own
converter permutes them (the file computes other numbers than the checkpoint, at the same cost).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from engine.gguf_import import _GLOBAL_NAMES, _LAYER_NAMES

ARCHS = ("llama", "qwen2")


def export_gguf(src: Path, dst: Path, config: dict) -> Path:
    """`src` (a benchmarks.shapes checkpoint with `config`) → `dst`, float16 weights and float32 norms."""
    import gguf

    arch = config["model_type"]
    if arch not in ARCHS:
        raise ValueError(f"llama.cpp's peer runs the Llama family here ({', '.join(ARCHS)}), not {arch}")
    state = load_file(str(src / "model.safetensors"))
    names = {hf: g for g, hf in _GLOBAL_NAMES.items()}
    tmp = dst.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"t{i}" for i in range(config["vocab_size"])])
    w.add_token_types([gguf.TokenType.NORMAL] * config["vocab_size"])
    w.add_token_merges(["t 0"])  # llama.cpp insists on merges; one that never applies
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    for name, t in state.items():
        w.add_tensor(_gguf_name(name, names), _array(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(dst)
    return dst


def _gguf_name(hf: str, globals_: dict[str, str]) -> str:
    stem, _, leaf = hf.rpartition(".")  # leaf: weight | bias
    if stem in globals_:
        return f"{globals_[stem]}.{leaf}"
    layer, module = stem.removeprefix("model.layers.").split(".", 1)
    short = next(g for g, m in _LAYER_NAMES.items() if m == module)
    return f"blk.{layer}.{short}.{leaf}"


def _array(t: torch.Tensor) -> np.ndarray:
    """Norms and biases in float32 (as llama.cpp's converter writes them), matrices in float16."""
    if t.dim() == 1:
        return t.float().numpy()
    return t.to(torch.float16).numpy()
