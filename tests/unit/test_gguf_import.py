from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from engine.errors import ModelLoadError
from engine.gguf_import import import_gguf

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world! What is the capital of France? Paris, of course: 1234 5678.",
    "can't won't I'll we've\n\ttabs and  double  spaces\n\n",
]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TEXTS = [
    "Hello world",
    " The lazy dog",
    "  two leading spaces\n\nand newlines\t tab",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>",
    "think: <think>hmm</think> done",
    "unicode é ü 中文 🎉 not in the corpus",
    "1234567890 can't",
    "</s> hello<s>world</s>",
    "thequickbrownfox jumpsoverthe lazydog, Whatisthecapital ofFrance",
    "is double the quick dog France, spaces of course Paris",
    "",
]
# GGUF tensor suffix -> type, per layer; every supported type appears at least once
LAYER_TYPES = [
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.F16, "ffn_gate": Q.Q4_0},
    {"attn_q": Q.F16, "attn_k": Q.Q8_0, "attn_v": Q.BF16, "attn_output": Q.Q4_0, "ffn_gate": Q.Q8_0},
]
LAYER_TYPES[0] |= {"ffn_up": Q.Q4_1, "ffn_down": Q.F32}
LAYER_TYPES[1] |= {"ffn_up": Q.F16, "ffn_down": Q.Q4_1}
HF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _train(pre_tokenizer: Any, vocab_size: int) -> tuple[list[str], list[str]]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet))
    model = json.loads(tok.to_str())["model"]
    return list(model["vocab"]), [" ".join(m) for m in model["merges"]]


def _add_tokenizer(writer: gguf.GGUFWriter, kind: str, space_prefix: bool | None, pre: str) -> int:
    """`kind` is "gpt2", "llama", "none" (no tokenizer at all) or any other name for a byte-level vocabulary."""
    if kind == "none":
        return 320
    if kind != "llama":
        tokens, merges = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), 300)
        types = [1] * len(tokens)
        tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
        types += [3, 3, 3, 4, 4]
        writer.add_tokenizer_model(kind)
        writer.add_tokenizer_pre(pre)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(len(tokens) - 4)
        writer.add_eos_token_id(len(tokens) - 3)
        writer.add_pad_token_id(len(tokens) - 5)
        writer.add_eot_token_id(len(tokens) - 5)
        writer.add_add_bos_token(True)
    else:
        # an old SentencePiece vocabulary: byte fallback tokens, scores, no merges
        pieces, _ = _train(pre_tokenizers.Metaspace(), 160)
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
        types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
        writer.add_tokenizer_model("llama")
        # shuffled scores with ties, so the merge order rebuilt from them (tie-breaks included) decides the splits
        scores = np.random.default_rng(1).integers(0, 16, len(pieces)).astype(float).tolist()
        writer.add_token_scores([0.0] * 259 + scores)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        if space_prefix is not None:
            writer.add_add_space_prefix(space_prefix)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(writer: gguf.GGUFWriter, name: str, weight: np.ndarray, qtype: Q) -> np.ndarray:
    """Write `weight` as `qtype`; return what dequantizing it gives back."""
    if qtype == Q.F32:
        writer.add_tensor(name, weight)
        return weight
    packed = quantize(weight, qtype)
    writer.add_tensor(name, packed, raw_dtype=None if qtype == Q.F16 else qtype)
    return dequantize(packed, qtype)


def _roundtrip(weight: np.ndarray, qtype: Q) -> np.ndarray:
    return weight if qtype == Q.F32 else dequantize(quantize(weight, qtype), qtype)


def write_tiny_gguf(
    path: Path,
    *,
    tied: bool = False,
    tokenizer: str = "gpt2",
    arch: str = "llama",
    extra: dict[str, np.ndarray] | None = None,
    omit: str | None = None,
    space_prefix: bool | None = None,
    pre: str = "default",
) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF with mixed tensor types; returns the expected HF-named float32 tensors."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    vocab = _add_tokenizer(writer, tokenizer, space_prefix, pre)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)

    def rand(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + rand(HIDDEN, scale=0.1)).astype(np.float32)

    expected = {"model.embed_tokens.weight": _add(writer, "token_embd.weight", rand(vocab, HIDDEN), Q.Q8_0)}
    if not tied:
        expected["lm_head.weight"] = _add(writer, "output.weight", rand(vocab, HIDDEN), Q.Q4_1)
    expected["model.norm.weight"] = _add(writer, "output_norm.weight", norm(), Q.F32)
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
    }
    shapes |= {
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    for i, types in enumerate(LAYER_TYPES):
        prefix = f"model.layers.{i}"
        expected[f"{prefix}.input_layernorm.weight"] = _add(writer, f"blk.{i}.attn_norm.weight", norm(), Q.F32)
        expected[f"{prefix}.post_attention_layernorm.weight"] = _add(writer, f"blk.{i}.ffn_norm.weight", norm(), Q.F32)
        for kind, qtype in types.items():
            hf = rand(*shapes[kind])
            if f"blk.{i}.{kind}.weight" == omit:
                continue
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(kind)
            stored = _add(writer, f"blk.{i}.{kind}.weight", _permute(hf, heads) if heads else hf, qtype)
            # quantization blocks run along rows, so the row permutation commutes with (de)quantizing
            expected[f"{prefix}.{HF_LAYER[kind]}.weight"] = _roundtrip(hf, qtype) if heads else stored
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_config(tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    out = import_gguf(tiny[0], tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    vocab = tiny[1]["model.embed_tokens.weight"].shape[0]
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (LAYERS, HIDDEN, FFN)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (HEADS, KV_HEADS, 16)
    assert (config["vocab_size"], config["max_position_embeddings"], config["rope_theta"]) == (vocab, 256, 10000.0)
    assert config["rms_norm_eps"] == pytest.approx(1e-5) and config["rope_scaling"] is None
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (vocab - 4, vocab - 3, vocab - 5)
    generation = json.loads((out / "generation_config.json").read_text())
    # llama.cpp's end-of-turn token stops generation too
    assert generation == {"bos_token_id": vocab - 4, "eos_token_id": [vocab - 3, vocab - 5], "pad_token_id": vocab - 5}
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE and tok_config["add_bos_token"] is True
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    )


def test_tensors_equal_dequantized_originals(tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    out = import_gguf(tiny[0], tmp_path / "hf", progress=lambda done, total: calls.append((done, total)))
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    state = load_file(out / "model.safetensors")
    assert state.keys() == tiny[1].keys()
    for name, want in tiny[1].items():
        assert state[name].dtype == torch.bfloat16, name
        assert state[name].shape == want.shape, name
        assert torch.equal(state[name], torch.from_numpy(want).to(torch.bfloat16)), name
    assert calls == [(i + 1, len(tiny[1])) for i in range(len(tiny[1]))]


def test_float32_import_loads_in_transformers_with_gguf_loader_logits(
    tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    out = import_gguf(tiny[0], tmp_path / "hf", dtype=torch.float32)
    for name, value in load_file(out / "model.safetensors").items():
        assert torch.equal(value, torch.from_numpy(tiny[1][name])), name
    ours, info = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny[0].parent, gguf_file=tiny[0].name, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "pre"), [("gpt2", "default"), ("gpt2", "llama-bpe"), ("gpt2", "tekken"), ("llama", "default")]
)
def test_tokenizer_matches_transformers_gguf_tokenizer(kind: str, pre: str, tmp_path: Path) -> None:
    path = tmp_path / f"{kind}.gguf"
    write_tiny_gguf(path, tokenizer=kind, tied=True, pre=pre)
    out = import_gguf(path, tmp_path / "hf")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = transformers.AutoTokenizer.from_pretrained(out)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    want_json, got_json = json.loads(ref.backend_tokenizer.to_str()), json.loads(raw.to_str())
    for part in ("model", "normalizer", "pre_tokenizer", "decoder", "post_processor"):
        assert got_json[part] == want_json[part], part
    key = lambda t: t["id"]  # noqa: E731
    assert sorted(got_json["added_tokens"], key=key) == sorted(want_json["added_tokens"], key=key)
    words = " ".join(CORPUS).split()
    rng = np.random.default_rng(2)
    # words glued and spaced at random, so ties in the merge order show up in the splits
    texts = TEXTS + ["".join(w + rng.choice(["", " ", "  ", "\n"]) for w in rng.choice(words, 8)) for _ in range(200)]
    for text in texts:
        want = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == want, text
        assert raw.encode(text).ids == want, text
        assert raw.decode(want, skip_special_tokens=False) == ref.decode(want), text
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == (
        ref.bos_token,
        ref.eos_token,
        ref.unk_token,
        ref.pad_token,
    )
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(messages, tokenize=False) == ref.apply_chat_template(messages, tokenize=False)


def test_sentencepiece_without_space_prefix(tmp_path: Path) -> None:
    # llama.cpp honours add_space_prefix=false (transformers' GGUF loader ignores it)
    path = tmp_path / "sp.gguf"
    write_tiny_gguf(path, tokenizer="llama", tied=True, space_prefix=False)
    raw = Tokenizer.from_file(str(import_gguf(path, tmp_path / "hf") / "tokenizer.json"))
    encoding = raw.encode("The lazy dog")
    assert encoding.tokens[0] == "<s>" and not encoding.tokens[1].startswith("▁")
    assert raw.decode(encoding.ids) == "The lazy dog"


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    expected = write_tiny_gguf(path, tied=True)
    out = import_gguf(path, tmp_path / "hf")
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    assert "lm_head.weight" not in expected
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def test_shards_with_index(tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    out = import_gguf(tiny[0], tmp_path / "hf", max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    state: dict[str, torch.Tensor] = {}
    for file in files:
        shard = load_file(out / file)
        assert all(index["weight_map"][name] == file for name in shard)
        state |= shard
    assert state.keys() == tiny[1].keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())


def _llama3_factors(factor: float, theta: float = 10000.0) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type "llama3"
    old, low, high = 8192, 1.0, 4.0
    out = []
    for freq in 1.0 / theta ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM):
        wavelen = 2 * math.pi / freq
        smooth = (old / wavelen - low) / (high - low)
        out.append(
            1 if wavelen < old / high else factor if wavelen > old / low else 1 / ((1 - smooth) / factor + smooth)
        )
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "llama31.gguf"
    expected = write_tiny_gguf(path, extra={"rope_freqs.weight": _llama3_factors(8.0)})
    out = import_gguf(path, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert load_file(out / "model.safetensors").keys() == expected.keys()
    rope = transformers.AutoConfig.from_pretrained(out).rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("llama3", 8.0, 10000.0)

    bad = tmp_path / "bad.gguf"
    write_tiny_gguf(bad, extra={"rope_freqs.weight": np.linspace(1, 3, HEAD_DIM // 2, dtype=np.float32)})
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        import_gguf(bad, tmp_path / "bad")


def test_refuses_other_architectures(tmp_path: Path) -> None:
    path = tmp_path / "qwen.gguf"
    write_tiny_gguf(path, arch="qwen2")
    with pytest.raises(ModelLoadError, match="'qwen2'"):
        import_gguf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path: Path) -> None:
    path = tmp_path / "int.gguf"
    write_tiny_gguf(path, tied=True, extra={"output.weight": np.zeros((320, HIDDEN), dtype=np.int32)})
    with pytest.raises(ModelLoadError, match=r"'output\.weight' has type I32"):
        import_gguf(path, tmp_path / "hf")


def test_unknown_tensor_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "extra.gguf"
    write_tiny_gguf(path, extra={"blk.0.ffn_gate_exps.weight": np.zeros((2, 4), dtype=np.float32)})
    with pytest.raises(ModelLoadError, match="ffn_gate_exps"):
        import_gguf(path, tmp_path / "hf")


def test_missing_tensor_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.gguf"
    write_tiny_gguf(path, omit="blk.1.ffn_down.weight")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        import_gguf(path, tmp_path / "hf")


@pytest.mark.parametrize(("kind", "message"), [("none", "no embedded tokenizer"), ("bert", "'bert'")])
def test_unusable_tokenizer_is_refused_before_writing(kind: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "tok.gguf"
    write_tiny_gguf(path, tokenizer=kind)
    with pytest.raises(ModelLoadError, match=message):
        import_gguf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
