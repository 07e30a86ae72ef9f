"""Rebuild a HuggingFace `tokenizer.json` + `tokenizer_config.json` from a GGUF file's tokenizer metadata.

Mirrors what transformers' GGUF loader builds (`integrations/gguf/gguf_tokenizer_mapping.py`), so the
result tokenizes exactly like `AutoTokenizer.from_pretrained(dir, gguf_file=name)`, without transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from engine.errors import ModelLoadError

# llama.cpp's `tokenizer.ggml.token_type` values
CONTROL = 3
USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> split regex; any other value keeps GPT-2's byte-level regex, as transformers does
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"]
        + ["jina-v5-nano", "dbrx", "smaug-bpe"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equal to the one llama.cpp's metadata describes (byte-level or SentencePiece BPE)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
    merges = (
        [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]] if "tokenizer.ggml.merges" in meta else None
    )
    if kind == "gpt2":
        tokenizer = _byte_level(tokens, merges or [], meta.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        tokenizer = _sentencepiece(tokens, merges, scores, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    else:
        raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2', 'llama'")

    # control tokens stay whole and are special; a byte-level "control" token outside the byte alphabet is a
    # llama.cpp mislabel that transformers skips, so we skip it too
    alphabet = set(bytes_to_unicode().values()) if kind == "gpt2" else None
    special = [
        t for t, kind_id in zip(tokens, token_types) if kind_id == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    special += [s for s in _special_token_strings(meta).values() if s is not None and s not in special]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind_id in zip(tokens, token_types)
            if kind_id == USER_DEFINED and t in vocab
        ]
    )
    tokenizer.post_processor = _post_processor(meta)
    return tokenizer


def tokenizer_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _add_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        **_special_token_strings(meta),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _byte_level(tokens: list[str], merges: list[tuple[str, ...]], pre: str | None) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(
    tokens: list[str], merges: list[tuple[str, ...]] | None, scores: list[float], add_space_prefix: bool
) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is None:
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    # NOTE: transformers ignores `add_space_prefix` and always prepends; we follow llama.cpp when it says not to
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    # old SentencePiece GGUFs carry no merges: every split of a piece into two known pieces, best score first
    # (transformers' `generate_merges`, including its tie-breaking, so ids match)
    ranked: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        ranked.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _post_processor(meta: Mapping[str, Any]) -> processors.TemplateProcessing:
    # the template transformers' `update_post_processor` writes, pair form included
    names = _special_token_strings(meta)
    ids = {"bos": meta.get("tokenizer.ggml.bos_token_id"), "eos": meta.get("tokenizer.ggml.eos_token_id")}
    bos = names["bos_token"] if _add_bos(meta) else None
    eos = names["eos_token"] if meta.get("tokenizer.ggml.add_eos_token") else None
    single = f"{f'{bos}:0 ' if bos else ''}$A:0{f' {eos}:0' if eos else ''}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    special = ([(bos, ids["bos"])] if bos else []) + ([(eos, ids["eos"])] if eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _add_bos(meta: Mapping[str, Any]) -> bool:
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def _special_token_strings(meta: Mapping[str, Any]) -> dict[str, str | None]:
    tokens = meta["tokenizer.ggml.tokens"]
    keys = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    ids = {name: meta.get(f"tokenizer.ggml.{key}_token_id") for name, key in keys.items()}
    return {name: tokens[i] if i is not None and 0 <= i < len(tokens) else None for name, i in ids.items()}
